//! Load: 1,000 concurrent streams and a burst of short calls through the
//! sidecar at once, in two rounds. No call may fail because of the sidecar,
//! every call leaves the in-flight count, every caller connection is closed
//! again (the sidecar's open files return to where they were), and the report
//! gives the sidecar's memory before, at the peak and after each round: equal
//! "after" figures mean the memory stays flat.
//!
//! CI runs it for 30 s; `LOAD_SECS=60 cargo test -p llm-sidecar --test process load::
//! -- --nocapture` is the full-length run, and `LOAD_ROUNDS=6` (default 2)
//! splits it into more rounds to follow the memory after each.

use std::time::Duration;

use crate::support::*;

/// The caller connections the sidecar process still holds: its socket
/// descriptors, by inode, that are a request-plane connection in the kernel's
/// TCP table, or that the kernel has closed already (in no table at all) but
/// the process never let go of.
fn caller_connections(pid: u32, port: u16) -> usize {
    let held: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    // inode -> (local port, state) for TCP; UNIX sockets by inode only.
    let mut tcp = std::collections::BTreeMap::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = cols
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if let (Some(local_port), Some(state), Some(inode)) =
                (local_port, cols.get(3), cols.get(9))
            {
                tcp.insert(inode.to_string(), (local_port, state.to_string()));
            }
        }
    }
    let unix: std::collections::BTreeSet<String> = std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().nth(6).map(str::to_string))
        .collect();
    held.iter()
        .filter(|inode| match tcp.get(*inode) {
            // 0A is LISTEN: the listener itself is not a connection.
            Some((local_port, state)) => *local_port == port && state != "0A",
            None => !unix.contains(*inode),
        })
        .count()
}

fn metric(sidecar: &Sidecar, name: &str) -> f64 {
    sidecar.metric(name).unwrap_or(f64::NAN)
}

#[test]
fn a_thousand_streams_and_a_burst_of_short_calls() {
    let secs: u64 = std::env::var("LOAD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let dir = TempDir::new("load");
    let mock = Mock::start(&dir.0, free_addr(), &["--token-delay", "20ms"]);
    let sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    sidecar.proc.wait_for_line("registered; serving", HANG);
    let pid = sidecar.proc.pid();
    let before = rss_kib(pid);
    let port = sidecar.listen.port();

    let rounds: u64 = std::env::var("LOAD_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
        .max(2);
    let round_secs = (secs / rounds).max(1);
    let duration = format!("{round_secs}s");
    let mut peak = 0;
    let mut peak_in_flight = 0.0_f64;
    let mut peak_connections = 0;
    let mut after = Vec::new();
    let (mut streams_ok, mut burst_ok) = (0, 0);
    for _round in 0..rounds {
        // 1,000 long streams (a token every 20 ms) over 4 connections, and 32
        // callers sending one-token calls as fast as they come back.
        let streams = bench_spawn(
            sidecar.listen,
            &[
                "-c",
                "1000",
                "--connections",
                "4",
                "-n",
                "100",
                "-d",
                &duration,
            ],
        );
        let burst = bench_spawn(sidecar.listen, &["-c", "32", "-n", "1", "-d", &duration]);
        for _ in 0..round_secs * 2 {
            std::thread::sleep(Duration::from_millis(500));
            peak = peak.max(rss_kib(pid));
            peak_in_flight = peak_in_flight.max(metric(&sidecar, "llm_sidecar_in_flight "));
            peak_connections = peak_connections.max(caller_connections(pid, port));
        }
        let streams = bench_report(streams);
        let burst = bench_report(burst);
        assert_eq!(streams["errors"], serde_json::json!({}), "{streams}");
        assert_eq!(burst["errors"], serde_json::json!({}), "{burst}");
        streams_ok += streams["calls_ok"].as_u64().unwrap_or(0);
        burst_ok += burst["calls_ok"].as_u64().unwrap_or(0);
        wait_until(HANG, "in-flight to return to 0", || {
            metric(&sidecar, "llm_sidecar_in_flight ") == 0.0
        });
        // Every caller connection closed: no task or socket left behind.
        wait_until(HANG, "the callers' connections to close", || {
            caller_connections(pid, port) == 0
        });
        std::thread::sleep(Duration::from_secs(2));
        after.push(rss_kib(pid));
    }
    println!(
        "load {secs}s in {rounds} rounds: streams {streams_ok} ok, short calls {burst_ok} ok, \
         no errors; peak in flight {peak_in_flight} on {peak_connections} caller connections, \
         all closed after each round; \
         sidecar RSS before {before} KiB, peak {peak} KiB, after each round {after:?} KiB"
    );
    assert!(streams_ok >= 1000 * rounds);
    assert!(
        peak_connections >= 4,
        "the connection count sees the callers: {peak_connections}"
    );
    assert!(
        peak_in_flight >= 1000.0,
        "a thousand streams were in flight at once: {peak_in_flight}"
    );
    for outcome in [
        "engine_failed",
        "engine_unreachable",
        "refused",
        "cut_at_deadline",
    ] {
        assert_eq!(
            metric(
                &sidecar,
                &format!("llm_sidecar_calls_total{{outcome=\"{outcome}\"}}")
            ),
            0.0,
            "{outcome}"
        );
    }
}
