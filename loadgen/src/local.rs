//! Driving processes on this machine from outside, as `demo` and the process
//! tests do: a free loopback port, a plain HTTP GET (the admin and control
//! ports speak HTTP/1.1), polling until something holds, the files a `file:`
//! registry holds, and a process's memory.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A loopback address whose port nobody listens on right now (another process
/// may take it before the caller binds it: callers retry on "cannot listen").
pub fn free_loopback_addr() -> std::io::Result<SocketAddr> {
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
