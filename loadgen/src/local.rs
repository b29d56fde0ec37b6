//! Driving processes on this machine from outside, as `demo` and the process
//! tests do: a free loopback port, a plain HTTP GET (the admin and control
//! ports speak HTTP/1.1), polling until something holds, the files a `file:`
//! registry holds, and a process's memory.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A loopback address whose port nobody listens on right now, below the
/// kernel's ephemeral range (Linux: 32768–60999 by default, read from
/// `/proc/sys/net/ipv4/ip_local_port_range`). The caller hands the port to a
/// process that binds it a moment later; a port from the ephemeral range
/// could meanwhile be taken by any outgoing connection on the machine (seen
/// once in CI: a mock engine's "Address already in use"), one below it only
/// by another caller of this function, which walks the range from a
/// per-process start. Falls back to an ephemeral port when the range leaves
/// no room below it.
pub fn free_loopback_addr() -> std::io::Result<SocketAddr> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOWEST: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .min(65_536);
    if ephemeral_low > LOWEST + 1_000 {
        let span = ephemeral_low - LOWEST;
        let start = std::process::id().wrapping_mul(2_654_435_761) % span;
        for _ in 0..span.min(5_000) {
            // A stride prime to the span's usual sizes walks every port.
            let step = NEXT.fetch_add(1, Ordering::Relaxed).wrapping_mul(7_919);
            let port = LOWEST + start.wrapping_add(step) % span;
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
                return l.local_addr();
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// `GET path` over HTTP/1.0; the status and the body, or `None` if nothing
/// answers (connect within 2 s, answer within `read_timeout`).
pub fn http_get(addr: SocketAddr, path: &str, read_timeout: Duration) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(read_timeout)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split_whitespace().nth(1)?.parse().ok()?;
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// Calls `check` every `every` until it is true (true) or `limit` passed (false).
pub fn poll_until(limit: Duration, every: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if check() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Every file below `dir` (recursively) that `keep` accepts; none if `dir`
/// does not exist.
pub fn files_under(dir: &Path, keep: &dyn Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p, keep));
        } else if keep(&p) {
            out.push(p);
        }
    }
    out
}

/// The records a `file:` registry rooted at `dir` holds (`*.json` below it).
pub fn record_files(dir: &Path) -> Vec<PathBuf> {
    files_under(dir, &|p| p.extension().is_some_and(|x| x == "json"))
}

/// A process's resident memory in KiB (`VmRSS`), or its peak (`VmHWM`) with
/// `peak`; 0 if the process is gone.
pub fn rss_kib(pid: u32, peak: bool) -> u64 {
    let key = if peak { "VmHWM:" } else { "VmRSS:" };
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}
