//! `--on-engine-loss rejoin`: for supervisors that restart the engine and
//! leave the sidecar running. Each loss is withdrawn and drained as with
//! `exit`; then the same process waits for the engine again and registers it
//! under a new instance id. A signal still ends it with the usual codes.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::support::account::{Load, Shape, reconcile_settled};
use crate::support::*;

#[test]
fn engine_killed_and_restarted_three_times_is_registered_three_times_by_one_process() {
    let dir = TempDir::new("rejoin");
    let grpc = free_addr();
    let (mut engine, journal) = Mock::start_journaled(&dir.0, grpc, &[]);
    let mut sidecar = Sidecar::start(&dir.0, grpc, &["--on-engine-loss", "rejoin"]);
    sidecar.wait_serving();
    let pid = sidecar.proc.pid();
    let mut instances = vec![sidecar.instance_id()];
    let load = Load::start(sidecar.listen, Shape::mixed("rejoin"));
    let mut withdrawn_after = Vec::new();
    let mut serving_again_after = Vec::new();
    for round in 1..=3 {
        std::thread::sleep(Duration::from_millis(600));
        let killed = Instant::now();
        engine.proc.signal("KILL");
        engine.proc.wait_exit_or_signal(HANG);
        wait_until(HANG, "the withdrawal", || sidecar.records().is_empty());
        withdrawn_after.push(killed.elapsed());
        sidecar
            .proc
            .wait_for_line("after the engine loss; waiting for the engine again", HANG);
        assert!(
            sidecar.proc.running(),
            "round {round}: still the same process"
        );

        let restarted = Instant::now();
        engine = Mock::start_journaled(&dir.0, grpc, &[]).0;
        wait_until(HANG, "the new registration", || {
            sidecar.records().len() == 1 && sidecar.state()["state"] == "Serving"
        });
        serving_again_after.push(restarted.elapsed());
        let record = sidecar.record(&sidecar.records()[0]);
        let id = sidecar.instance_id();
        assert_eq!(
            record["instance_id"],
            id.as_str(),
            "round {round}: {record}"
        );
        assert!(
            !instances.contains(&id),
            "round {round}: a new instance id, got {id} again"
        );
        instances.push(id);
    }
    std::thread::sleep(Duration::from_millis(600));
    sidecar.proc.signal("TERM");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0, "a signal while serving: 0");
    assert_eq!(sidecar.proc.pid(), pid);
    let ledger = load.stop();
    drop(engine);

    let distinct: BTreeSet<&String> = instances.iter().collect();
    assert_eq!(distinct.len(), 4, "{instances:?}");
    assert_eq!(sidecar.proc.count_lines("engine lost: "), 3);
    assert_eq!(sidecar.proc.count_lines("registered; serving"), 4);
    assert!(
        ledger.count("ok") > 0 && ledger.count("unexplained") == 0,
        "{:?}",
        ledger.counts()
    );
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), false);
    println!(
        "rejoin: instances {instances:?}; withdrawn {withdrawn_after:?} after each kill, serving \
         again {serving_again_after:?} after each restart; {report}"
    );
}

#[test]
fn a_signal_while_waiting_for_the_engine_again_exits_0_and_one_during_the_drain_exits_1() {
    let dir = TempDir::new("rejoin-signal");
    let grpc = free_addr();
    let engine = Mock::start(&dir.0, grpc, &[]);
    let mut sidecar = Sidecar::start(&dir.0, grpc, &["--on-engine-loss", "rejoin"]);
    sidecar.wait_serving();
    engine.control("/liveness?status=2");
    sidecar.proc.wait_for_line(
        "waiting for the engine again, to register as instance",
        HANG,
    );
    // The engine still answers its API, but its health says NOT_SERVING: it
    // is not back, and the sidecar waits rather than register it to lose it
    // again at once.
    sidecar.proc.wait_for_line(
        "not serving again yet: its health service \"liveness\" reports NOT_SERVING",
        HANG,
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(sidecar.state()["state"], "Starting");
    assert!(sidecar.records().is_empty());
    assert_eq!(sidecar.proc.count_lines("engine lost: "), 1, "no flapping");
    sidecar.proc.signal("TERM");
    assert_eq!(
        sidecar.proc.wait_exit(HANG),
        0,
        "nothing is served while waiting: a signal exits 0"
    );

    // A signal during the loss's drain: exit 1, no rejoin.
    let engine = Mock::start(&dir.0, free_addr(), &["--token-delay", "50ms"]);
    let mut sidecar = Sidecar::start(
        &dir.0,
        engine.grpc,
        &["--on-engine-loss", "rejoin", "--drain-timeout", "10s"],
    );
    sidecar.wait_serving();
    let long = Load::start(sidecar.listen, Shape::long("rejoin-drain"));
    wait_until(HANG, "a call in flight", || {
        sidecar.metric("llm_sidecar_in_flight") == Some(1.0)
    });
    engine.control("/liveness?status=2");
    sidecar.proc.wait_for_line("engine lost: ", HANG);
    sidecar.proc.signal("TERM");
    sidecar.proc.wait_for_line(
        "exiting 1 after the drain instead of waiting for the engine again",
        HANG,
    );
    drop(long);
    assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    assert!(
        sidecar
            .proc
            .line_index("waiting for the engine again, to register")
            .is_none()
    );
}
