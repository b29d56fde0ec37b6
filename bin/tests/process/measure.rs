//! Measurements, not assertions: run on request in release mode.
//!
//! `cargo test --release -p llm-sidecar --test process measure:: -- --ignored --nocapture`

use std::time::{Duration, Instant};

use crate::support::*;

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

/// etcd discovery: liveness flip (control answered) to key deletion, 20 runs;
/// and how long a SIGKILLed sidecar's record lives with the default 10 s TTL.
#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn etcd_liveness_flip_to_key_deletion_and_killed_record_lifetime() {
    const RUNS: usize = 20;
    let dir = TempDir::new("measure-etcd");
    let etcd = crate::support::etcd::Etcd::started(&dir.0);
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

/// Per engine kind, from the moment the engine changes to the moment its
/// record file is gone: liveness flipped NOT_SERVING (from the control
/// request's answer: the status is set by then), and the engine SIGKILLed
/// (from the kill). The table in docs/ENGINES.md comes from this run.
#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn per_kind_not_serving_and_sigkill_to_record_removal() {
    const RUNS: usize = 20;
    let kinds = [
        "trtllm",
        "openengine",
        "vllm",
        "sglang",
        "vllm-native",
        "sglang-native",
    ];
    for kind in kinds {
        let mut flips = Vec::with_capacity(RUNS);
        let mut kills = Vec::with_capacity(RUNS);
        for run in 0..2 * RUNS {
            let dir = TempDir::new("measure-kind");
            let mock = Mock::start(&dir.0, free_addr(), &["--kind", kind]);
            let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
            let record = sidecar.wait_for_record(HANG);
            sidecar.proc.wait_for_line("registered; serving", HANG);
            std::thread::sleep(Duration::from_millis(200));
            let start = if run < RUNS {
                mock.control("/liveness?status=2");
                Instant::now()
            } else {
                let start = Instant::now();
                mock.proc.signal("KILL");
                start
            };
            while record.exists() {
                assert!(start.elapsed() < HANG, "{kind}: record never removed");
                std::thread::sleep(Duration::from_micros(100));
            }
            if run < RUNS {
                flips.push(start.elapsed());
            } else {
                kills.push(start.elapsed());
            }
            assert_eq!(sidecar.proc.wait_exit(HANG), 1, "{kind}");
        }
        flips.sort();
        kills.sort();
        println!(
            "| `{kind}` | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
            percentile(&flips, 0.5).as_secs_f64() * 1e3,
            flips[RUNS - 1].as_secs_f64() * 1e3,
            percentile(&kills, 0.5).as_secs_f64() * 1e3,
            kills[RUNS - 1].as_secs_f64() * 1e3,
        );
    }
}
