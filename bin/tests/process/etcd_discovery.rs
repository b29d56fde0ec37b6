//! etcd discovery against a real etcd: leases, keepalive, withdrawal,
//! re-registration after an outage, and start-up without etcd.

use std::time::{Duration, Instant};

use crate::support::etcd::Etcd;
use crate::support::*;

fn key_of(etcd: &Etcd) -> String {
    wait_until(HANG, "the key in etcd", || etcd.keys().len() == 1);
    etcd.keys().remove(0)
}

fn serving_on_etcd(dir: &TempDir, etcd: &Etcd, extra: &[&str]) -> (Mock, Sidecar, String) {
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let endpoint = etcd.endpoint();
    let mut args = vec!["--discovery", endpoint.as_str()];
    args.extend_from_slice(extra);
    let sidecar = Sidecar::start(&dir.0, mock.grpc, &args);
    sidecar.wait_serving();
    let key = key_of(etcd);
    (mock, sidecar, key)
}

#[test]
fn the_record_is_put_with_a_lease_of_the_configured_ttl() {
    let dir = TempDir::new("etcd-register");
    let etcd = Etcd::started(&dir.0);
    let (_mock, mut sidecar, key) = serving_on_etcd(&dir, &etcd, &["--lease-ttl", "7s"]);
    let id = sidecar.instance_id();
    assert_eq!(key, format!("v1/instances/dynamo/backend/generate/{id}"));
    let entry = etcd.get(&key).expect("key");
    assert_ne!(entry.lease, 0, "the key is attached to a lease");
    let (remaining, granted) = etcd.lease_ttl(entry.lease);
    assert_eq!(granted, 7, "the lease TTL is --lease-ttl");
    assert!(remaining > 0);
    let record: serde_json::Value =
        serde_json::from_slice(&entry.value).expect("the value is the JSON record");
    assert_eq!(record["instance_id"], id.as_str());
    assert_eq!(record["address"], sidecar.listen.to_string());
    assert_eq!(record["engine"]["kind"], "trtllm");
    assert_eq!(record["pid"], sidecar.proc.pid());
    // Kept alive: after two TTLs the same lease still holds the key.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(etcd.get(&key).map(|e| e.lease), Some(entry.lease));
    sidecar.proc.stop_cleanly();
}

#[test]
fn liveness_not_serving_deletes_the_key_while_running_then_exits_1() {
    let dir = TempDir::new("etcd-loss");
    let etcd = Etcd::started(&dir.0);
    let mock = Mock::start(&dir.0, free_addr(), &["--token-delay", "10ms"]);
    let endpoint = etcd.endpoint();
    let sidecar = Sidecar::start(
        &dir.0,
        mock.grpc,
        &["--discovery", endpoint.as_str(), "--drain-timeout", "30s"],
    );
    let mut sidecar = sidecar;
    sidecar.wait_serving();
    let key = key_of(&etcd);
    // A long call in flight keeps the process draining after the withdrawal.
    let call = bench_spawn(sidecar.listen, &["-c", "1", "-n", "600", "--calls", "1"]);
    wait_until(HANG, "the call to be in flight", || {
        sidecar.metric("llm_sidecar_in_flight") == Some(1.0)
    });
    mock.control("/liveness?status=2");
    wait_until(HANG, "the key to be deleted", || etcd.get(&key).is_none());
    assert!(
        sidecar.proc.running() && sidecar.metric("llm_sidecar_in_flight") == Some(1.0),
        "the key is gone while the sidecar still runs and drains its call"
    );
    assert_eq!(bench_report(call)["calls_ok"], 1, "the call drained");
    assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    sidecar.proc.assert_withdrawn_before_exit(1);
}

#[test]
fn a_killed_sidecars_record_expires_with_its_lease() {
    let dir = TempDir::new("etcd-kill");
    let etcd = Etcd::started(&dir.0);
    let (_mock, sidecar, key) = serving_on_etcd(&dir, &etcd, &["--lease-ttl", "3s"]);
    let killed = Instant::now();
    sidecar.proc.signal("KILL");
    // Generous, yet short of the default 10 s TTL: the key must go with the
    // 3 s lease the flag asked for.
    wait_until(
        Duration::from_secs(3 + 4),
        "the key to expire within TTL + 4s",
        || etcd.get(&key).is_none(),
    );
    println!(
        "SIGKILLed sidecar's record lived {:?} after the kill",
        killed.elapsed()
    );
}

#[test]
fn an_etcd_outage_longer_than_the_ttl_is_survived_with_a_fresh_lease() {
    let dir = TempDir::new("etcd-outage");
    let mut etcd = Etcd::started(&dir.0);
    let (_mock, mut sidecar, key) = serving_on_etcd(&dir, &etcd, &["--lease-ttl", "2s"]);
    let old_lease = etcd.get(&key).expect("key").lease;
    let listen = sidecar.listen;
    etcd.stop();
    // The request plane keeps answering throughout the outage.
    let calls = std::thread::spawn(move || {
        let mut ok = 0;
        for i in 0..8 {
            let out = std::process::Command::new(binary())
                .args([
                    "bench",
                    "--target",
                    &listen.to_string(),
                    "-c",
                    "2",
                    "-n",
                    "16",
                    "--calls",
                    "4",
                    "-d",
                    "30s",
                    "--json",
                ])
                .output()
                .expect("bench");
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report");
            assert_eq!(
                report["errors"],
                serde_json::json!({}),
                "call round {i} failed: {report}"
            );
            ok += report["calls_ok"].as_u64().unwrap_or(0);
            std::thread::sleep(Duration::from_millis(500));
        }
        ok
    });
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        sidecar.proc.running(),
        "an etcd outage never stops the sidecar"
    );
    etcd.start();
    wait_until(HANG, "a re-registration with a new lease", || {
        etcd.get(&key)
            .is_some_and(|e| e.lease != old_lease && e.lease != 0)
    });
    assert_eq!(
        calls.join().expect("calls"),
        32,
        "every call during the outage was answered"
    );
    assert!(sidecar.proc.running());
    let log = sidecar.proc.log_lines();
    let warned = |needle: &str| {
        log.iter()
            .filter(|l| l.contains(needle) && l.contains("WARN"))
            .count()
    };
    assert_eq!(
        warned("registering instance"),
        1,
        "one warning per outage, not per attempt:\n{}",
        log.join("\n")
    );
    assert_eq!(
        warned("etcd unreachable"),
        1,
        "one keepalive warning per outage:\n{}",
        log.join("\n")
    );
    assert!(
        log.iter().any(|l| l.contains("discovery dropped instance")),
        "the lost lease was noticed"
    );
    let new_lease = etcd.get(&key).expect("key").lease;
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        etcd.lease_ttl(old_lease).0,
        -1,
        "the old lease is gone, never reused"
    );
    sidecar.proc.stop_cleanly();
    assert!(etcd.get(&key).is_none());
    assert_eq!(
        etcd.lease_ttl(new_lease).0,
        -1,
        "withdraw revoked the lease"
    );
}

#[test]
fn an_etcd_outage_shorter_than_the_ttl_keeps_the_lease_and_loses_no_call() {
    use crate::support::account::{Load, Shape, reconcile_settled};
    let dir = TempDir::new("etcd-blip");
    let etcd = Etcd::started(&dir.0);
    let (mock, journal) = Mock::start_journaled(&dir.0, free_addr(), &[]);
    let endpoint = etcd.endpoint();
    let mut sidecar = Sidecar::start(
        &dir.0,
        mock.grpc,
        &["--discovery", &endpoint, "--lease-ttl", "6s"],
    );
    sidecar.proc.wait_for_line("registered; serving", HANG);
    let key = key_of(&etcd);
    let lease = etcd.get(&key).expect("key").lease;
    let load = Load::start(sidecar.listen, Shape::mixed("etcd-blip"));
    std::thread::sleep(Duration::from_millis(500));
    // Frozen, not stopped: etcd keeps its state and comes back where it was,
    // after missing one keepalive (TTL/3 = 2 s) but well inside the TTL.
    etcd.signal("STOP");
    std::thread::sleep(Duration::from_millis(2500));
    etcd.signal("CONT");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(etcd.get(&key).expect("key still there").lease, lease);
    assert!(
        sidecar
            .proc
            .line_index("discovery dropped instance")
            .is_none()
    );
    assert_eq!(sidecar.state()["state"], "Serving");
    sidecar.proc.stop_cleanly();
    assert!(etcd.get(&key).is_none());
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("etcd outage 2.5s < TTL 6s: {report}");
    assert_eq!(ledger.count("engine_failed"), 0, "{report}");
}

#[test]
fn etcd_down_at_startup_is_waited_for_until_the_deadline() {
    let dir = TempDir::new("etcd-late");
    let mut etcd = Etcd::new(&dir.0);
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let endpoint = etcd.endpoint();
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &["--discovery", &endpoint]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(sidecar.proc.running(), "no etcd yet: still starting");
    etcd.start();
    key_of(&etcd);
    sidecar.proc.wait_for_line("registered; serving", HANG);
    sidecar.proc.stop_cleanly();

    // Never started: exit 3 at the startup deadline.
    let never = Etcd::new(&dir.0);
    let endpoint = never.endpoint();
    let mut sidecar = Sidecar::start(
        &dir.0,
        mock.grpc,
        &["--discovery", &endpoint, "--startup-deadline", "3s"],
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 3);
    assert!(
        sidecar
            .proc
            .line_index("could not be registered in discovery")
            .is_some(),
        "{}",
        sidecar.proc.log_text()
    );
}

#[test]
fn sigterm_deletes_the_key_and_revokes_the_lease_then_exits_0() {
    let dir = TempDir::new("etcd-term");
    let etcd = Etcd::started(&dir.0);
    let (_mock, mut sidecar, key) = serving_on_etcd(&dir, &etcd, &["--router-grace", "1s"]);
    let lease = etcd.get(&key).expect("key").lease;
    sidecar.proc.signal("TERM");
    wait_until(HANG, "the key to be deleted", || etcd.get(&key).is_none());
    wait_until(HANG, "the lease to be revoked", || {
        etcd.lease_ttl(lease).0 == -1
    });
    assert!(
        sidecar.proc.running(),
        "key and lease go first, during the router grace"
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
}

#[test]
fn a_key_deleted_by_someone_else_is_put_again() {
    let dir = TempDir::new("etcd-deleted");
    let etcd = Etcd::started(&dir.0);
    let (_mock, mut sidecar, key) = serving_on_etcd(&dir, &etcd, &["--lease-ttl", "3s"]);
    let lease = etcd.get(&key).expect("the key").lease;
    etcd.delete(&key);
    let warn = sidecar
        .proc
        .wait_for_line("(its key was deleted); registering again", HANG);
    assert!(warn.contains("WARN"), "{warn}");
    wait_until(HANG, "the key to be put again", || etcd.get(&key).is_some());
    assert_ne!(
        etcd.get(&key).map(|e| e.lease),
        Some(lease),
        "under a fresh lease"
    );
    sidecar.proc.stop_cleanly();
    assert!(etcd.get(&key).is_none());
}
