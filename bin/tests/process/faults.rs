//! Faults, with real processes on loopback and a client load running through
//! each one: whatever happens, every call is accounted for (the client's,
//! the engine's and the sidecar's counts reconcile exactly), and the worker
//! never stays registered in front of an engine it knows is gone.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::support::account::{Load, Shape, reconcile_settled};
use crate::support::relay::Relay;
use crate::support::*;

fn journaled_mock(dir: &TempDir, grpc: std::net::SocketAddr, extra: &[&str]) -> (Mock, PathBuf) {
    Mock::start_journaled(&dir.0, grpc, extra)
}

/// Waits until the record is gone; returns how long that took from `since`.
fn withdrawn_after(sidecar: &Sidecar, since: Instant) -> Duration {
    wait_until(HANG, "the record to be withdrawn", || {
        sidecar.records().is_empty()
    });
    since.elapsed()
}

fn lets_load_run(d: u64) {
    std::thread::sleep(Duration::from_millis(d));
}

#[test]
fn engine_paused_shorter_than_the_loss_windows_loses_no_call() {
    let dir = TempDir::new("pause-short");
    let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    sidecar.wait_serving();
    let load = Load::start(sidecar.listen, Shape::mixed("pause-short"));
    lets_load_run(800);
    mock.proc.signal("STOP");
    std::thread::sleep(Duration::from_secs(2));
    mock.proc.signal("CONT");
    lets_load_run(1500);
    assert_eq!(
        sidecar.state()["state"],
        "Serving",
        "a 2 s pause is no loss"
    );
    assert_eq!(sidecar.records().len(), 1);
    sidecar.proc.stop_cleanly();
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("pause 2s: {report}");
    assert!(ledger.count("ok") > 0 && ledger.count("engine_failed") == 0);
    assert!(sidecar.proc.line_index("ERROR").is_none());
}

#[test]
fn engine_frozen_by_sigstop_is_withdrawn_and_every_call_accounted_for() {
    let dir = TempDir::new("freeze");
    let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    sidecar.wait_serving();
    let load = Load::start(sidecar.listen, Shape::mixed("freeze"));
    lets_load_run(800);
    let frozen = Instant::now();
    mock.proc.signal("STOP");
    let stale = withdrawn_after(&sidecar, frozen);
    let lost = sidecar.proc.wait_for_line("engine lost:", HANG);
    assert!(
        lost.contains("ERROR") && lost.contains("routing load stale for 5"),
        "{lost}"
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    // The supervisor would restart the sidecar; the engine thaws meanwhile and
    // must see every forwarded call reset.
    mock.proc.signal("CONT");
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("freeze: registered in front of a frozen engine for {stale:?}; {report}");
    assert!(
        ledger.count("cut") + ledger.count("refused") > 0,
        "calls met the drain: {report}"
    );
}

#[test]
fn silent_network_shorter_than_the_keepalive_window_is_ridden_out() {
    let dir = TempDir::new("silent-short");
    let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
    let relay = Relay::start(mock.grpc);
    let mut sidecar = Sidecar::start(&dir.0, relay.addr, KEEPALIVE_ONLY);
    sidecar.wait_serving();
    let load = Load::start(sidecar.listen, Shape::mixed("silent-short"));
    lets_load_run(800);
    relay.set_silent(true);
    std::thread::sleep(Duration::from_secs(3));
    relay.set_silent(false);
    lets_load_run(1500);
    assert_eq!(sidecar.state()["state"], "Serving");
    sidecar.proc.stop_cleanly();
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("silent 3s: {report}");
    assert_eq!(ledger.count("engine_failed"), 0, "{report}");
}

#[test]
fn silent_network_longer_than_the_keepalive_window_is_a_loss() {
    let dir = TempDir::new("silent-long");
    let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
    let relay = Relay::start(mock.grpc);
    let mut sidecar = Sidecar::start(&dir.0, relay.addr, KEEPALIVE_ONLY);
    sidecar.wait_serving();
    let load = Load::start(sidecar.listen, Shape::mixed("silent-long"));
    lets_load_run(800);
    let silenced = Instant::now();
    relay.set_silent(true);
    let stale = withdrawn_after(&sidecar, silenced);
    let lost = sidecar.proc.wait_for_line("engine lost:", HANG);
    assert!(lost.contains("liveness stream failed"), "{lost}");
    assert!(
        stale < Duration::from_secs(11 + 2 + 5),
        "noticed within interval + timeout (+ slack): {stale:?}"
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    relay.set_silent(false);
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("silent network: registered for {stale:?} after it went silent; {report}");
    drop(mock);
}

#[test]
fn engine_restarted_on_its_port_with_a_new_identity_is_registered_anew() {
    let dir = TempDir::new("restart");
    let grpc = free_addr();
    let (mut first, journal) = journaled_mock(&dir, grpc, &["--engine-version", "1.0.0"]);
    let mut sidecar = Sidecar::start(&dir.0, grpc, &[]);
    sidecar.wait_serving();
    let old = sidecar.record(&sidecar.records()[0]);
    let load = Load::start(sidecar.listen, Shape::mixed("restart-a"));
    lets_load_run(800);
    let killed = Instant::now();
    first.proc.signal("KILL");
    first.proc.wait_exit_or_signal(HANG);
    let (_second, _) = journaled_mock(&dir, grpc, &["--engine-version", "2.0.0"]);
    let stale = withdrawn_after(&sidecar, killed);
    assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    let mut ledger = load.stop();
    let mut accounts = vec![sidecar.account()];

    // The supervisor restarts the sidecar: it registers the new engine.
    let mut again = Sidecar::start(&dir.0, grpc, &[]);
    again.wait_serving();
    let new = again.record(&again.records()[0]);
    assert_ne!(new["engine"]["identity"], old["engine"]["identity"]);
    assert_eq!(new["engine"]["version"], "2.0.0");
    assert_ne!(new["instance_id"], old["instance_id"]);
    let load = Load::start(again.listen, Shape::mixed("restart-b"));
    lets_load_run(800);
    again.proc.stop_cleanly();
    ledger.merge(load.stop());
    accounts.push(again.account());
    let total = crate::support::account::SidecarAccount::sum(&accounts);
    let report = reconcile_settled(&ledger, &journal, &total, false);
    println!("engine restart: withdrawn {stale:?} after the kill; {report}");
}

#[test]
fn sigterm_twice_keeps_the_first_deadlines() {
    let dir = TempDir::new("term-twice");
    let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &["--router-grace", "4s"]);
    sidecar.wait_serving();
    let load = Load::start(sidecar.listen, Shape::mixed("term-twice"));
    lets_load_run(500);
    // The deadline /state shows while the router grace runs.
    let grace_deadline = |sidecar: &Sidecar| {
        let state = sidecar.state();
        assert_eq!(state["state"], "Draining", "{state}");
        assert_eq!(state["deadline"]["reason"], "router grace", "{state}");
        state["deadline"]["at"]
            .as_str()
            .expect("deadline")
            .to_string()
    };
    sidecar.proc.signal("TERM");
    wait_until(HANG, "the sidecar to drain", || {
        sidecar.state()["state"] == "Draining"
    });
    let first = grace_deadline(&sidecar);
    std::thread::sleep(Duration::from_millis(1000));
    sidecar.proc.signal("TERM");
    sidecar
        .proc
        .wait_for_line("another shutdown signal; already draining", HANG);
    assert_eq!(
        grace_deadline(&sidecar),
        first,
        "the second signal moved the router grace deadline"
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("SIGTERM twice: grace deadline {first} kept; {report}");
    assert!(
        ledger.count("refused") > 0,
        "admission closed after the grace"
    );
}

#[test]
fn sigterm_while_lost_keeps_exit_code_1() {
    let dir = TempDir::new("term-lost");
    let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    sidecar.wait_serving();
    let load = Load::start(sidecar.listen, Shape::mixed("term-lost"));
    // Keeps the sidecar in Lost until the drain deadline, so the signal below
    // always finds it there.
    let long = Load::start(sidecar.listen, Shape::long("term-lost-long"));
    lets_load_run(500);
    mock.control("/liveness?status=2");
    sidecar.proc.wait_for_line("engine lost:", HANG);
    sidecar.proc.signal("TERM");
    sidecar.proc.wait_for_line("exit code stays 1", HANG);
    assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    let mut ledger = load.stop();
    ledger.merge(long.stop());
    assert_eq!(
        ledger.count("cut"),
        1,
        "the long call was cut at the deadline"
    );
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("SIGTERM while lost: {report}");
}

#[test]
fn sigterm_racing_an_engine_loss_exits_with_whichever_came_first() {
    for round in 0..3 {
        let dir = TempDir::new(&format!("race-{round}"));
        let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
        let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
        sidecar.wait_serving();
        let load = Load::start(sidecar.listen, Shape::mixed(&format!("race-{round}")));
        lets_load_run(300);
        // Both at once: the order the sidecar sees them in decides the code.
        std::thread::scope(|s| {
            s.spawn(|| mock.control("/liveness?status=2"));
            s.spawn(|| sidecar.proc.signal("TERM"));
        });
        let code = sidecar.proc.wait_exit(HANG);
        let lost = sidecar.proc.line_index("engine lost:");
        let term = sidecar.proc.line_index("shutdown signal");
        let expected = match (lost, term) {
            (Some(l), Some(t)) if l < t => 1,
            (Some(_), None) => 1,
            _ => 0,
        };
        assert_eq!(code, expected, "log:\n{}", sidecar.proc.log_text());
        assert!(sidecar.records().is_empty(), "withdrawn either way");
        sidecar.proc.assert_withdrawn_before_exit(code);
        let ledger = load.stop();
        let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
        println!("race round {round}: exit {code}; {report}");
    }
}

/// The exit itself under a crowd: 64 callers retry into the draining sidecar
/// as fast as they can, so calls are on the wire when its connections send
/// GOAWAY and close. Every round's account must still reconcile: nothing the
/// sidecar forwarded is lost, and a call that failed with the connection was
/// never forwarded.
#[test]
fn exit_under_a_crowd_of_callers_loses_no_call() {
    let mut unread = 0;
    for round in 0..6 {
        let dir = TempDir::new("crowd");
        let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
        let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
        sidecar.wait_serving();
        let mut shape = Shape::mixed(&format!("crowd-{round}"));
        shape.concurrency = 64;
        let load = Load::start(sidecar.listen, shape);
        lets_load_run(700);
        sidecar.proc.stop_cleanly();
        lets_load_run(200);
        let ledger = load.stop();
        let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
        println!("crowd round {round}: {report}");
        assert!(ledger.count("ok") > 0 && ledger.count("refused") > 0);
        unread += report.unread_refusals;
    }
    println!("crowd: {unread} refusals unread by their callers in 6 exits");
}

#[test]
fn read_only_discovery_dir_delays_registration_and_blocks_withdrawal_loudly() {
    let dir = TempDir::new("ro-dir");
    let (mock, journal) = journaled_mock(&dir, free_addr(), &[]);
    let mount = Tmpfs::mount(&dir.0.join("discovery"), "1m");
    mount.set_read_only(true);
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    let failed = sidecar.proc.wait_for_line("failed: ", HANG).to_lowercase();
    assert!(failed.contains("read-only file system"), "{failed}");
    assert_eq!(sidecar.state()["state"], "Starting");
    assert!(sidecar.records().is_empty());
    mount.set_read_only(false);
    sidecar.wait_serving();
    sidecar
        .proc
        .wait_for_line("discovery writes succeed again", HANG);

    // Read-only again while serving: the withdrawal cannot happen, the sidecar
    // keeps trying until the drain deadline and says that the record remains.
    let load = Load::start(sidecar.listen, Shape::mixed("ro-dir"));
    lets_load_run(500);
    mount.set_read_only(true);
    sidecar.proc.signal("TERM");
    sidecar.proc.wait_for_line("withdrawing instance", HANG);
    sidecar.proc.wait_for_line(
        "drain deadline reached before discovery confirmed the withdrawal",
        HANG,
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    assert_eq!(
        sidecar.records().len(),
        1,
        "the record could not be removed"
    );
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("read-only discovery: {report}");
    mount.set_read_only(false);
}

#[test]
fn full_disk_delays_registration_and_leaves_no_partial_record() {
    let dir = TempDir::new("full");
    let (mock, _journal) = journaled_mock(&dir, free_addr(), &[]);
    let mount = Tmpfs::mount(&dir.0.join("discovery"), "64k");
    let filler = mount.dir.join("filler");
    // Fill the tmpfs to the last byte.
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).expect("filler");
        let block = vec![0u8; 4096];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    let failed = sidecar.proc.wait_for_line("failed: ", HANG).to_lowercase();
    assert!(failed.contains("no space left on device"), "{failed}");
    std::thread::sleep(Duration::from_secs(1));
    assert!(sidecar.records().is_empty());
    assert!(
        mount.temp_files().is_empty(),
        "failed writes leave no temporary files: {:?}",
        mount.temp_files()
    );
    std::fs::remove_file(&filler).expect("free the space");
    sidecar.wait_serving();
    let record = sidecar.record(&sidecar.records()[0]);
    assert_eq!(
        record["transport"], "grpc",
        "a whole record, not a torn one"
    );
    sidecar.proc.stop_cleanly();
    assert!(sidecar.records().is_empty());
}
