//! Load: 1,000 concurrent streams and a burst of short calls through the
//! sidecar at once. No call may fail because of the sidecar, every call leaves
//! the in-flight count, and the report gives the sidecar's memory before,
//! at the peak and after the load.
//!
//! CI runs it for 30 s; `LOAD_SECS=60 cargo test --release -p llm-sidecar
//! --test load -- --nocapture` is the full-length run.

mod support;

use std::time::Duration;

use support::*;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn metric(sidecar: &Sidecar, name: &str) -> f64 {
    sidecar.metric(name).unwrap_or(f64::NAN)
}

fn bench(target: std::net::SocketAddr, args: &[&str]) -> std::process::Child {
    std::process::Command::new(binary())
        .args(["bench", "--target", &target.to_string(), "--json"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("bench")
}

fn report(child: std::process::Child) -> serde_json::Value {
    let out = child.wait_with_output().expect("bench output");
    serde_json::from_slice(&out.stdout).expect("bench report is JSON")
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
    let before = rss_kib(sidecar.proc.pid());

    let duration = format!("{secs}s");
    // 1,000 long streams (a token every 20 ms) over 4 connections, and 32
    // callers sending one-token calls as fast as they come back.
    let streams = bench(
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
    let burst = bench(sidecar.listen, &["-c", "32", "-n", "1", "-d", &duration]);
    let mut peak = 0;
    let mut peak_in_flight = 0.0_f64;
    for _ in 0..secs * 2 {
        std::thread::sleep(Duration::from_millis(500));
        peak = peak.max(rss_kib(sidecar.proc.pid()));
        peak_in_flight = peak_in_flight.max(metric(&sidecar, "llm_sidecar_in_flight "));
    }
    let streams = report(streams);
    let burst = report(burst);
    wait_until(HANG, "in-flight to return to 0", || {
        metric(&sidecar, "llm_sidecar_in_flight ") == 0.0
    });
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_kib(sidecar.proc.pid());
    println!(
        "load {secs}s: streams {} ok / errors {}, short calls {} ok / errors {}; peak in flight \
         {peak_in_flight}; sidecar RSS before {before} KiB, peak {peak} KiB, after {after} KiB",
        streams["calls_ok"], streams["errors"], burst["calls_ok"], burst["errors"]
    );
    assert_eq!(streams["errors"], serde_json::json!({}), "{streams}");
    assert_eq!(burst["errors"], serde_json::json!({}), "{burst}");
    assert!(streams["calls_ok"].as_u64().unwrap_or(0) >= 1000);
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
