//! Measurements, not assertions: run on request in release mode.
//!
//! `cargo test --release -p llm-sidecar --test measure -- --ignored --nocapture`

mod support;

use std::time::{Duration, Instant};

use support::*;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Time from the mock's liveness flip (control request answered) to the
/// record file disappearing, polled every 100 µs; and the sidecar's idle RSS.
#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn liveness_flip_to_record_removal() {
    const RUNS: usize = 20;
    let mut samples = Vec::with_capacity(RUNS);
    let mut after_answer = Vec::with_capacity(RUNS);
    let mut rss = Vec::new();
    for run in 0..RUNS {
        let dir = TempDir::new("measure");
        let mock = Mock::start(&dir.0, free_addr(), &[]);
        let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
        let record = sidecar.wait_for_record(HANG);
        sidecar.proc.wait_for_line("registered; serving", HANG);
        std::thread::sleep(Duration::from_millis(300));
        if run < 5 {
            rss.push(rss_kib(sidecar.proc.pid()));
        }
        let start = Instant::now();
        mock.control("/liveness?status=2");
        let answered = Instant::now();
        while record.exists() {
            assert!(start.elapsed() < HANG, "record never removed");
            std::thread::sleep(Duration::from_micros(100));
        }
        samples.push(start.elapsed());
        after_answer.push(answered.elapsed());
        assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    }
    samples.sort();
    after_answer.sort();
    println!(
        "liveness NOT_SERVING -> record removed, from the control answer (status already set), {RUNS} runs: median {:?}, worst {:?}",
        percentile(&after_answer, 0.5),
        after_answer[after_answer.len() - 1]
    );
    println!(
        "liveness NOT_SERVING -> record removed, from the control request sent (includes its HTTP round trip), {RUNS} runs: median {:?}, p90 {:?}, worst {:?}, best {:?}",
        percentile(&samples, 0.5),
        percentile(&samples, 0.9),
        samples[samples.len() - 1],
        samples[0]
    );
    println!("sidecar idle RSS while serving: {:?} KiB", rss);
}

fn bench(target: std::net::SocketAddr, concurrency: usize, secs: u64) -> serde_json::Value {
    let out = std::process::Command::new(binary())
        .args([
            "bench",
            "--target",
            &target.to_string(),
            "-c",
            &concurrency.to_string(),
            "-n",
            "256",
            "-d",
            &format!("{secs}s"),
            "--json",
        ])
        .output()
        .expect("run bench");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "bench output: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn vm_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `llm-sidecar bench` straight to the mock engine and through the sidecar,
/// alternating, 3 runs of 5 s per point; medians. Per-token delay 0.
#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn proxy_cost_against_the_engine_direct() {
    let dir = TempDir::new("bench");
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    sidecar.wait_for_record(HANG);
    let idle = vm_kib(sidecar.proc.pid(), "VmRSS:");
    println!(
        "| streams | direct tok/s | sidecar tok/s | ratio | ITL p50 direct/sidecar (us) | ITL p99 direct/sidecar (us) | TTFT p50 direct/sidecar (us) | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for c in [1usize, 16, 64] {
        let (mut dt, mut st, mut dp50, mut sp50, mut dp99, mut sp99, mut dttft, mut sttft) = (
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
        );
        let mut errors = 0u64;
        for _ in 0..3 {
            let d = bench(mock.grpc, c, 5);
            let s = bench(sidecar.listen, c, 5);
            for (r, t, p50, p99, ttft) in [
                (&d, &mut dt, &mut dp50, &mut dp99, &mut dttft),
                (&s, &mut st, &mut sp50, &mut sp99, &mut sttft),
            ] {
                t.push(r["tokens_per_s"].as_f64().unwrap_or(0.0));
                p50.push(r["itl"]["p50_us"].as_f64().unwrap_or(0.0));
                p99.push(r["itl"]["p99_us"].as_f64().unwrap_or(0.0));
                ttft.push(r["ttft"]["p50_us"].as_f64().unwrap_or(0.0));
                errors += r["errors"]
                    .as_object()
                    .map_or(0, |e| e.values().filter_map(|v| v.as_u64()).sum());
            }
        }
        let (d, s) = (median(dt), median(st));
        println!(
            "| {c} | {d:.0} | {s:.0} | {:.2} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {errors} |",
            s / d,
            median(dp50),
            median(sp50),
            median(dp99),
            median(sp99),
            median(dttft),
            median(sttft)
        );
        if c == 64 {
            println!(
                "sidecar RSS after 64 streams: {} KiB (peak {} KiB); idle before load {idle} KiB",
                vm_kib(sidecar.proc.pid(), "VmRSS:"),
                vm_kib(sidecar.proc.pid(), "VmHWM:")
            );
        }
    }
}

/// etcd discovery: liveness flip (control answered) to key deletion, 20 runs;
/// and how long a SIGKILLed sidecar's record lives with the default 10 s TTL.
#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn etcd_liveness_flip_to_key_deletion_and_killed_record_lifetime() {
    const RUNS: usize = 20;
    let dir = TempDir::new("measure-etcd");
    let etcd = support::etcd::Etcd::started(&dir.0);
    let endpoint = etcd.endpoint();
    let mut samples = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let mock = Mock::start(&dir.0, free_addr(), &[]);
        let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &["--discovery", &endpoint]);
        sidecar.proc.wait_for_line("registered; serving", HANG);
        wait_until(HANG, "the key", || etcd.keys().len() == 1);
        let key = etcd.keys().remove(0);
        std::thread::sleep(Duration::from_millis(200));
        mock.control("/liveness?status=2");
        let answered = Instant::now();
        while etcd.get(&key).is_some() {
            assert!(answered.elapsed() < HANG, "key never deleted");
        }
        samples.push(answered.elapsed());
        assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    }
    samples.sort();
    println!(
        "liveness NOT_SERVING -> etcd key deleted, from the control answer, {RUNS} runs: median {:?}, p90 {:?}, worst {:?}, best {:?}",
        percentile(&samples, 0.5),
        percentile(&samples, 0.9),
        samples[samples.len() - 1],
        samples[0]
    );
    let mut lived = Vec::new();
    for _ in 0..3 {
        let mock = Mock::start(&dir.0, free_addr(), &[]);
        let sidecar = Sidecar::start(&dir.0, mock.grpc, &["--discovery", &endpoint]);
        sidecar.proc.wait_for_line("registered; serving", HANG);
        wait_until(HANG, "the key", || etcd.keys().len() == 1);
        let key = etcd.keys().remove(0);
        std::thread::sleep(Duration::from_millis(1500));
        let killed = Instant::now();
        sidecar.proc.signal("KILL");
        while etcd.get(&key).is_some() {
            assert!(killed.elapsed() < HANG, "key never expired");
            std::thread::sleep(Duration::from_millis(5));
        }
        lived.push(killed.elapsed());
    }
    println!("SIGKILLed sidecar's record lived (lease TTL 10s, keepalive every ~3.3s): {lived:?}");
}
