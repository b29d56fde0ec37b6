//! The sidecar against a real (mock) engine on loopback: start-up, every kind
//! of engine loss, signals, deadlines and bad flags, as an operator sees them.

mod support;

use std::time::Duration;

use support::*;

/// Checks a loss the way an operator would: the exact ERROR line, the record
/// withdrawn before the process ended, exit code 1.
fn assert_lost(sidecar: &mut Sidecar, instance: &str, reason_prefix: &str) -> String {
    let code = sidecar.proc.wait_exit(HANG);
    let log = sidecar.proc.log_text();
    assert_eq!(code, 1, "exit code after an engine loss; log:\n{log}");
    let line = log
        .lines()
        .find(|l| l.contains("TensorRT-LLM engine lost: "))
        .unwrap_or_else(|| panic!("no loss line; log:\n{log}"))
        .to_string();
    assert!(line.contains("ERROR"), "loss is logged at ERROR: {line}");
    assert!(
        line.contains(&format!("TensorRT-LLM engine lost: {reason_prefix}")),
        "loss reason {reason_prefix:?} in {line}"
    );
    assert!(
        line.ends_with(&format!("(instance {instance})")),
        "instance id in {line}"
    );
    sidecar.proc.assert_withdrawn_before_exit(1);
    assert!(sidecar.records().is_empty(), "no record is left behind");
    line
}

fn serving(dir: &TempDir, mock_args: &[&str], sidecar_args: &[&str]) -> (Mock, Sidecar, String) {
    let mock = Mock::start(&dir.0, free_addr(), mock_args);
    let sidecar = Sidecar::start(&dir.0, mock.grpc, sidecar_args);
    sidecar.wait_for_record(HANG);
    sidecar.proc.wait_for_line("registered; serving", HANG);
    let id = sidecar.instance_id();
    (mock, sidecar, id)
}

#[test]
fn engine_up_three_seconds_late_is_waited_for_then_registered_with_its_real_values() {
    let dir = TempDir::new("late");
    let engine = free_addr();
    let mut sidecar = Sidecar::start(
        &dir.0,
        engine,
        &["--namespace", "ns1", "--advertise", "10.1.2.3:7000"],
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        sidecar.proc.running(),
        "a refused engine port means still loading, not a failure"
    );
    assert!(
        sidecar.records().is_empty(),
        "nothing is registered before the engine answers"
    );
    let mock = Mock::start(
        &dir.0,
        engine,
        &[
            "--model-id",
            "acme/model-7b",
            "--engine-version",
            "0.21.0",
            "--max-input-len",
            "2048",
            "--max-seq-len",
            "4096",
        ],
    );
    let path = sidecar.wait_for_record(HANG);
    let r = sidecar.record(&path);
    let id = r["instance_id"].as_str().expect("instance_id").to_string();
    assert!(
        !id.is_empty()
            && id
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
        "lowercase hex id: {id}"
    );
    let key = format!("v1/instances/ns1/backend/generate/{id}.json");
    assert!(
        path.ends_with(&key),
        "record at {} is under key {key}",
        path.display()
    );
    assert_eq!(r["namespace"], "ns1");
    assert_eq!(r["component"], "backend");
    assert_eq!(r["endpoint"], "generate");
    assert_eq!(r["address"], "10.1.2.3:7000");
    assert_eq!(r["transport"], "grpc");
    assert_eq!(r["engine"]["kind"], "trtllm");
    assert_eq!(r["engine"]["version"], "0.21.0");
    let identity = r["engine"]["identity"].as_str().expect("identity");
    assert!(
        identity.contains("0.21.0") && identity.contains("acme/model-7b"),
        "identity: {identity}"
    );
    assert_eq!(r["model"]["name"], "acme/model-7b");
    assert_eq!(r["model"]["max_input_len"], 2048);
    assert_eq!(r["model"]["max_seq_len"], 4096);
    assert_eq!(r["pid"], sidecar.proc.pid());
    let at = r["registered_at"].as_str().expect("registered_at");
    assert!(
        at.len() == 24 && at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "RFC 3339: {at}"
    );
    assert_eq!(http_get(sidecar.admin, "/ready").map(|r| r.0), Some(200));
    drop(mock);
    sidecar.proc.signal("TERM");
    sidecar.proc.wait_exit(HANG);
}

#[test]
fn liveness_not_serving_withdraws_then_exits_1() {
    let dir = TempDir::new("notserving");
    let (mock, mut sidecar, id) = serving(&dir, &[], &[]);
    mock.control("/liveness?status=2");
    let line = assert_lost(&mut sidecar, &id, "liveness reported NOT_SERVING");
    assert!(line.ends_with(&format!(
        "TensorRT-LLM engine lost: liveness reported NOT_SERVING (instance {id})"
    )));
}

#[test]
fn watch_ending_cleanly_is_a_loss() {
    let dir = TempDir::new("watchend");
    let (mock, mut sidecar, id) = serving(&dir, &[], &[]);
    mock.control("/watch/end");
    assert_lost(&mut sidecar, &id, "liveness stream ended");
}

#[test]
fn engine_killed_fails_the_watch_and_is_a_loss() {
    let dir = TempDir::new("killed");
    let (mock, mut sidecar, id) = serving(&dir, &[], &[]);
    mock.proc.signal("KILL");
    assert_lost(&mut sidecar, &id, "liveness stream failed: ");
}

#[test]
fn engine_without_health_service_warns_once_and_keeps_serving() {
    let dir = TempDir::new("nohealth");
    let (_mock, mut sidecar, _id) = serving(&dir, &["--no-health"], &[]);
    sidecar
        .proc
        .wait_for_line("does not serve grpc.health.v1", HANG);
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running());
    assert_eq!(sidecar.records().len(), 1, "still registered");
    assert_eq!(http_get(sidecar.admin, "/ready").map(|r| r.0), Some(200));
    assert_eq!(
        sidecar.proc.count_lines(" WARN "),
        1,
        "exactly one warning; log:\n{}",
        sidecar.proc.log_text()
    );
    sidecar.proc.signal("TERM");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    assert!(sidecar.records().is_empty());
}

#[test]
fn unregistered_liveness_warns_once_then_counts_once_it_reports() {
    let dir = TempDir::new("unregistered");
    let (mock, mut sidecar, id) = serving(&dir, &["--liveness-unregistered"], &[]);
    sidecar
        .proc
        .wait_for_line("is not registered on the engine yet", HANG);
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        sidecar.proc.running(),
        "SERVICE_UNKNOWN before any status is no loss"
    );
    mock.control("/liveness?status=1");
    std::thread::sleep(Duration::from_millis(500));
    assert!(sidecar.proc.running());
    assert_eq!(sidecar.proc.count_lines(" WARN "), 1, "exactly one warning");
    mock.control("/liveness?status=2");
    assert_lost(&mut sidecar, &id, "liveness reported NOT_SERVING");
}

#[test]
fn stalled_healthcheck_is_a_stale_load_loss() {
    let dir = TempDir::new("stale");
    let (mock, mut sidecar, id) = serving(
        &dir,
        &[],
        &["--probe-interval", "300ms", "--stale-after", "1500ms"],
    );
    mock.control("/healthcheck?mode=stall");
    let line = assert_lost(&mut sidecar, &id, "routing load stale for ");
    assert!(
        sidecar
            .proc
            .line_index("stale-load probe got no fresh answer")
            .is_some(),
        "the stall was warned about first"
    );
    let _ = line;
}

#[test]
fn a_new_engine_identity_is_a_loss() {
    let dir = TempDir::new("identity");
    let (mock, mut sidecar, id) = serving(&dir, &[], &["--probe-interval", "300ms"]);
    mock.control("/identity?version=2.0.0-other");
    let line = assert_lost(&mut sidecar, &id, "new engine identity trtllm 1.0.0-mock ");
    assert!(line.contains("-> trtllm 2.0.0-other "), "{line}");
}

#[test]
fn sigterm_before_the_engine_came_up_exits_0_with_nothing_registered() {
    let dir = TempDir::new("early-term");
    let mut sidecar = Sidecar::start(&dir.0, free_addr(), &[]);
    sidecar.proc.wait_for_line("not ready yet", HANG);
    sidecar.proc.signal("TERM");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    assert!(sidecar.records().is_empty());
    assert!(sidecar.proc.line_index("nothing was served").is_some());
}

#[test]
fn startup_deadline_passing_exits_3() {
    let dir = TempDir::new("deadline");
    let mut sidecar = Sidecar::start(&dir.0, free_addr(), &["--startup-deadline", "2s"]);
    assert_eq!(sidecar.proc.wait_exit(HANG), 3);
    let line = sidecar
        .proc
        .wait_for_line("startup deadline of 2s passed", HANG);
    assert!(line.contains("ERROR"), "{line}");
    assert!(sidecar.records().is_empty());
}

#[test]
fn malformed_flags_exit_2_before_contacting_anything() {
    let dir = TempDir::new("flags");
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let engine = mock.grpc.to_string();
    let cases: &[&[&str]] = &[
        &["--keepalive-interval", "5s"],
        &["--drain-timeout", "5"],
        &["--stale-after", "1s", "--probe-interval", "2s"],
        &["--discovery", "redis://x"],
        &["--namespace", "a/b"],
        &["--listen", "not-an-address"],
        &["--engine-kind", "tgi"],
        &["--no-such-flag"],
    ];
    for (i, extra) in cases.iter().enumerate() {
        let mut args = vec![
            "run".to_string(),
            "--engine-endpoint".into(),
            engine.clone(),
            "--admin-listen".into(),
            free_addr().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = Proc::spawn(&args, dir.0.join(format!("flags-{i}.log")));
        let code = p.wait_exit(HANG);
        assert_eq!(code, 2, "{extra:?} exits 2; log:\n{}", p.log_text());
        assert!(!p.log_text().trim().is_empty(), "{extra:?} explains itself");
    }
    let stats = mock.stats();
    assert_eq!(
        stats["connections"], 0,
        "no sidecar ever connected to the engine"
    );
    assert_eq!(stats["info_calls"], 0);
}

#[test]
fn sigterm_then_a_loss_during_the_drain_still_exits_0_after_withdrawing() {
    let dir = TempDir::new("term-then-loss");
    let (mock, mut sidecar, id) = serving(&dir, &[], &["--router-grace", "2s"]);
    sidecar.proc.signal("TERM");
    wait_until(HANG, "the record to be withdrawn", || {
        sidecar.records().is_empty()
    });
    assert!(
        sidecar.proc.running(),
        "the router grace keeps the process up after the withdrawal"
    );
    mock.control("/liveness?status=2");
    let warn = sidecar.proc.wait_for_line("engine lost during drain", HANG);
    assert!(
        warn.contains("WARN") && warn.contains(&format!("(instance {id}); exit code stays 0")),
        "{warn}"
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    assert!(
        sidecar.proc.line_index("ERROR").is_none(),
        "a loss during the drain is not an error"
    );
    sidecar.proc.assert_withdrawn_before_exit(0);
}
