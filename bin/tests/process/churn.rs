//! The supervised churn run: a supervisor restarts the sidecar whenever it
//! exits (as Kubernetes would), the engine is killed or stopped and restarted on
//! a random schedule, and a client keeps calling through it all. At the end the
//! call account reconciles, and the report says how long, at worst, the record
//! pointed at a dead engine.
//!
//! CI runs it for 45 s; `CHURN_SECS=300 cargo test --release -p llm-sidecar
//! --test churn -- --nocapture` is the full-length run.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::support::account::{Load, SidecarAccount, reconcile_settled};
use crate::support::*;

fn secs(var: &str, default: u64) -> Duration {
    Duration::from_secs(
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

/// xorshift64*: a reproducible "random" schedule.
struct Rng(u64);

impl Rng {
    fn between(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        Duration::from_millis(lo_ms + r % (hi_ms - lo_ms))
    }
}

fn spawn_cycle(
    dir: &Path,
    engine: SocketAddr,
    listen: SocketAddr,
    admin: SocketAddr,
    n: u32,
) -> Proc {
    let args = run_args(
        engine,
        listen,
        admin,
        &dir.join("discovery"),
        &["--startup-deadline", "10m"],
    );
    spawn_sidecar(&args, dir.join(format!("sidecar-cycle-{n}.log")))
}

#[test]
fn supervised_churn_loses_no_call_and_never_lingers_in_front_of_a_dead_engine() {
    let run_for = secs("CHURN_SECS", 45);
    let dir = TempDir::new("churn");
    let grpc = free_addr();
    let listen = free_addr();
    let admin = free_addr();
    let journal = dir.0.join("engine.journal");
    let journal_arg = journal.display().to_string();
    let mock_args = ["--token-delay", "5ms", "--journal", &journal_arg];

    let engine_alive = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let mut mock = Some(Mock::start(&dir.0, grpc, &mock_args));
    engine_alive.store(true, Ordering::Release);

    // The supervisor: restart the sidecar whenever it exits.
    let supervisor = {
        let (dir, done) = (dir.0.clone(), done.clone());
        std::thread::spawn(move || {
            let mut cycles = Vec::new();
            let mut n = 0;
            while !done.load(Ordering::Acquire) {
                n += 1;
                let mut p = spawn_cycle(&dir, grpc, listen, admin, n);
                while p.running() && !done.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                if p.running() {
                    p.signal("TERM");
                }
                p.wait_exit_or_signal(HANG);
                let code = p.status.and_then(|s| s.code());
                let text = p.log_text();
                if text.contains("cannot listen on") {
                    // The old process's port is not free yet: try again.
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
                let account = SidecarAccount::from_log(&text)
                    .unwrap_or_else(|| panic!("cycle {n} left no account:\n{text}"));
                let ended = text.contains("engine lost: liveness stream ended");
                cycles.push((code, account, ended));
                std::thread::sleep(Duration::from_millis(100));
            }
            cycles
        })
    };

    // The stale-registration watch: how long, at worst, a record was listed
    // while the engine was dead.
    let watcher = {
        let (dir, done, alive) = (dir.0.clone(), done.clone(), engine_alive.clone());
        std::thread::spawn(move || {
            let (mut worst, mut since): (Duration, Option<Instant>) = (Duration::ZERO, None);
            while !done.load(Ordering::Acquire) {
                let stale = !alive.load(Ordering::Acquire)
                    && !record_files(&dir.join("discovery")).is_empty();
                match (stale, since) {
                    (true, None) => since = Some(Instant::now()),
                    (false, Some(t)) => {
                        worst = worst.max(t.elapsed());
                        since = None;
                    }
                    _ => {}
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            worst
        })
    };

    let load = Load::start(listen, crate::support::account::Shape::mixed("churn"));
    let mut rng = Rng(0x5eed_1234_abcd_0042);
    let (mut kills, mut stops) = (0, 0);
    let start = Instant::now();
    while start.elapsed() < run_for {
        std::thread::sleep(rng.between(1500, 5000));
        let mut m = mock.take().expect("engine up");
        // Dead from the moment we decide: the record must go as fast as it can.
        engine_alive.store(false, Ordering::Release);
        if kills <= stops {
            m.proc.signal("KILL");
            kills += 1;
        } else {
            // TensorRT-LLM's graceful stop: the Watch ends, calls are cancelled
            // after the grace.
            let _ = http_get(m.control, "/stop?grace_ms=300");
            stops += 1;
        }
        m.proc.wait_exit_or_signal(HANG);
        drop(m);
        std::thread::sleep(rng.between(200, 1500));
        mock = Some(Mock::start(&dir.0, grpc, &mock_args));
        engine_alive.store(true, Ordering::Release);
    }
    // Let the last sidecar register, then end the run.
    std::thread::sleep(Duration::from_secs(2));
    done.store(true, Ordering::Release);
    let cycles = supervisor.join().expect("supervisor");
    let worst = watcher.join().expect("watcher");
    let ledger = load.stop();
    let accounts: Vec<SidecarAccount> = cycles.iter().map(|(_, a, _)| a.clone()).collect();
    let report = reconcile_settled(&ledger, &journal, &SidecarAccount::sum(&accounts), false);
    let codes: Vec<String> = cycles
        .iter()
        .map(|(c, _, _)| c.map_or("signal".into(), |c| c.to_string()))
        .collect();
    let stream_ends = cycles.iter().filter(|(_, _, ended)| *ended).count();
    println!(
        "churn {run_for:?}: {} sidecar cycles (exit codes {}), engine killed {kills}x and \
         stopped gracefully {stops}x (\"liveness stream ended\" {stream_ends}x); longest record in front of a dead engine {worst:?}; {report}",
        cycles.len(),
        codes.join(",")
    );
    assert!(kills + stops >= 2, "the engine was lost at least twice");
    assert!(
        cycles.iter().filter(|(c, _, _)| *c == Some(1)).count() >= 2,
        "the sidecar exited 1 for engine losses: {codes:?}"
    );
    assert_eq!(
        cycles.last().map(|(c, _, _)| *c),
        Some(Some(0)),
        "the last run was stopped by SIGTERM"
    );
    assert!(ledger.count("ok") > 0);
    assert!(
        stops == 0 || stream_ends > 0,
        "a graceful engine stop shows as \"liveness stream ended\" ({stops} stops, {stream_ends} such losses)"
    );
    assert!(
        worst < Duration::from_secs(5),
        "a record stayed in front of a dead engine for {worst:?}"
    );
    drop(mock);
}
