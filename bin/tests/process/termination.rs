//! The pod's termination order, played as the kubelet plays it, with a load
//! running through the sidecar and a "router" that stops sending new calls
//! the moment the worker leaves discovery.
//!
//! - Native-sidecar layout (deploy/kubernetes/): SIGTERM to llm-sidecar (the
//!   main container), wait for its exit, only then SIGTERM to the engine (the
//!   restartable init container). Zero failed calls, exit 0.
//! - Both signalled at once (two ordinary containers): exit 0, but a call
//!   longer than the engine's own 5 s stop grace is cut by the engine.
//! - The engine stopped first: that is an engine loss to the sidecar
//!   (withdraw, close admission, drain, exit 1); calls in flight finish inside
//!   the engine's grace, calls that race the withdrawal are refused with
//!   UNAVAILABLE or, after the exit, meet a closed port (both retryable, never
//!   sent to the engine), none is lost unexplained.

use std::time::Duration;

use crate::support::account::{Ledger, Load, Shape, reconcile_settled};
use crate::support::*;

/// Short calls, no errors asked for, no caller going away: every outcome but
/// `ok` is a failure the termination caused.
fn router_traffic(prefix: &str) -> Shape {
    Shape {
        concurrency: 8,
        tokens: 16,
        error_every: 0,
        cancel_every: 0,
        cancel_after: Duration::ZERO,
        prefix: prefix.to_string(),
    }
}

/// A journaled engine and a serving sidecar (router grace 1 s, drain 10 s)
/// with the router's traffic running through it.
struct Pod {
    dir: TempDir,
    engine: Mock,
    journal: std::path::PathBuf,
    sidecar: Sidecar,
    load: Load,
}

fn pod_under_load(name: &str) -> Pod {
    let dir = TempDir::new(&format!("term-{name}"));
    let (engine, journal) = Mock::start_journaled(&dir.0, free_addr(), &[]);
    let sidecar = Sidecar::start(
        &dir.0,
        engine.grpc,
        &["--router-grace", "1s", "--drain-timeout", "10s"],
    );
    sidecar.wait_serving();
    let load = Load::start(sidecar.listen, router_traffic(name));
    Pod {
        dir,
        engine,
        journal,
        sidecar,
        load,
    }
}

/// The router's side: stop starting calls once the record is gone.
fn stop_at_withdrawal(sidecar: &Sidecar, load: Load) -> Ledger {
    wait_until(HANG, "the worker to leave discovery", || {
        sidecar.records().is_empty()
    });
    load.stop()
}

#[test]
fn kubelet_order_sidecar_then_engine_fails_no_call() {
    let Pod {
        dir: _dir,
        engine: mut mock,
        journal,
        mut sidecar,
        load,
    } = pod_under_load("kubelet");
    std::thread::sleep(Duration::from_millis(800));

    sidecar.proc.signal("TERM");
    let ledger = stop_at_withdrawal(&sidecar, load);
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    assert!(
        mock.proc.running(),
        "the engine is stopped only after the sidecar exited"
    );
    mock.proc.signal("TERM");
    mock.proc.wait_exit_or_signal(HANG);

    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("kubelet order (sidecar, then engine): {report}");
    let counts = ledger.counts();
    assert!(ledger.count("ok") > 0, "{counts:?}");
    assert_eq!(
        ledger.count("ok") as usize,
        ledger.calls.len(),
        "every call succeeds: {counts:?}"
    );
    assert!(
        sidecar.proc.line_index("engine lost").is_none(),
        "no loss is seen: the engine outlives the sidecar\n{}",
        sidecar.proc.log_text()
    );
}

#[test]
fn both_signalled_at_once_exit_0_but_the_engine_cuts_long_calls() {
    let Pod {
        dir: _dir,
        engine: mut mock,
        journal,
        mut sidecar,
        load: short,
    } = pod_under_load("together");
    let long = Load::start(sidecar.listen, Shape::long("together-long"));
    std::thread::sleep(Duration::from_millis(800));

    sidecar.proc.signal("TERM");
    mock.proc.signal("TERM");
    let mut ledger = stop_at_withdrawal(&sidecar, short);
    assert_eq!(sidecar.proc.wait_exit(HANG), 0, "a signal came first: 0");
    ledger.merge(long.stop());
    mock.proc.wait_exit_or_signal(HANG);

    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), false);
    println!("signalled together: {report}");
    assert_eq!(
        ledger.count("engine_stopped"),
        1,
        "the long call is cancelled by the engine's 5 s stop grace, not by the drain: {:?}",
        ledger.counts()
    );
    assert!(
        sidecar.proc.line_index("WARN").is_some(),
        "the engine's stop during the drain is a WARN"
    );
}

#[test]
fn engine_stopped_first_is_a_loss_exit_1_and_no_call_unexplained() {
    let Pod {
        dir: _dir,
        engine: mut mock,
        journal,
        mut sidecar,
        load,
    } = pod_under_load("engine-first");
    std::thread::sleep(Duration::from_millis(800));

    mock.proc.signal("TERM");
    let ledger = stop_at_withdrawal(&sidecar, load);
    assert_eq!(sidecar.proc.wait_exit(HANG), 1, "an engine loss: exit 1");
    sidecar.proc.assert_withdrawn_before_exit(1);
    mock.proc.wait_exit_or_signal(HANG);

    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), false);
    println!("engine stopped first: {report}");
    let counts = ledger.counts();
    // A loss has no router grace: the sidecar exits as soon as its drain is
    // done, which can be before this router has read the withdrawal (it polls
    // the registry). A call it starts then meets a closed port: `not_sent`,
    // connection refused, as retryable as a refusal, and the reconciliation
    // above proves the engine never saw it.
    for label in counts.keys() {
        assert!(
            ["ok", "refused", "not_sent"].contains(label),
            "only completed calls and retryable refusals: {counts:?}"
        );
    }
    assert!(ledger.count("ok") > 0, "{counts:?}");
}
