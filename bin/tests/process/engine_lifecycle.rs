//! The sidecar against a real (mock) engine on loopback: start-up, every kind
//! of engine loss, signals, deadlines and bad flags, as an operator sees them.

use std::time::Duration;

use crate::support::*;

/// A TensorRT-LLM loss as an operator sees it (see [`assert_engine_lost`]).
fn assert_lost(sidecar: &mut Sidecar, instance: &str, reason_prefix: &str) -> String {
    assert_engine_lost(sidecar, "TensorRT-LLM", instance, reason_prefix)
}

/// A serving sidecar in front of a mock engine, and the worker's instance id.
fn serving_with_id(
    dir: &TempDir,
    mock_args: &[&str],
    sidecar_args: &[&str],
) -> (Mock, Sidecar, String) {
    let (mock, sidecar) = serving(&dir.0, mock_args, sidecar_args);
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

/// The probes an operator points a kubelet at: `/live` is the process, 200
/// until it exits; `/ready` and `/health` (the path Dynamo's operator and many
/// charts probe) are the worker, 200 only while Serving.
#[test]
fn ready_and_health_answer_503_from_the_withdrawal_on_while_live_stays_200() {
    let dir = TempDir::new("probes");
    let (_mock, sidecar, _id) = serving_with_id(&dir, &[], &["--router-grace", "30s"]);
    for path in ["/live", "/ready", "/health"] {
        assert_eq!(
            http_get(sidecar.admin, path).map(|r| r.0),
            Some(200),
            "{path} while serving"
        );
    }
    sidecar.proc.signal("TERM");
    sidecar
        .proc
        .wait_for_line("admitting calls for the router grace", HANG);
    wait_until(HANG, "the withdrawal", || sidecar.records().is_empty());
    assert_eq!(
        http_get(sidecar.admin, "/live").map(|r| r.0),
        Some(200),
        "/live while draining"
    );
    for path in ["/ready", "/health"] {
        let (code, body) = http_get(sidecar.admin, path).expect(path);
        assert_eq!(
            (code, body.as_str()),
            (503, "not ready: Draining\n"),
            "{path} while draining"
        );
    }
    sidecar.proc.signal("KILL");
}

#[test]
fn liveness_not_serving_withdraws_then_exits_1() {
    let dir = TempDir::new("notserving");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &[]);
    mock.control("/liveness?status=2");
    let line = assert_lost(&mut sidecar, &id, "liveness reported NOT_SERVING");
    assert!(line.ends_with(&format!(
        "TensorRT-LLM engine lost: liveness reported NOT_SERVING (instance {id})"
    )));
}

#[test]
fn watch_ending_cleanly_is_a_loss() {
    let dir = TempDir::new("watchend");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &[]);
    mock.control("/watch/end");
    assert_lost(&mut sidecar, &id, "liveness stream ended");
}

#[test]
fn engine_killed_fails_the_watch_and_is_a_loss() {
    let dir = TempDir::new("killed");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &[]);
    mock.proc.signal("KILL");
    assert_lost(&mut sidecar, &id, "liveness stream failed: ");
}

#[test]
fn engine_without_health_service_warns_once_and_keeps_serving() {
    let dir = TempDir::new("nohealth");
    let (_mock, mut sidecar, _id) = serving_with_id(&dir, &["--no-health"], &[]);
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
    sidecar.proc.stop_cleanly();
    assert!(sidecar.records().is_empty());
}

#[test]
fn an_engine_without_health_killed_is_lost_by_its_connection_not_the_stale_window() {
    let dir = TempDir::new("nohealth-killed");
    let (mock, mut sidecar, id) =
        serving_with_id(&dir, &["--no-health"], &["--stale-after", "30s"]);
    sidecar
        .proc
        .wait_for_line("the engine's connection is followed instead", HANG);
    let killed = std::time::Instant::now();
    mock.proc.signal("KILL");
    wait_until(HANG, "the withdrawal", || sidecar.records().is_empty());
    let took = killed.elapsed();
    println!("an engine without health SIGKILLed: withdrawn {took:?} after the kill");
    assert!(
        took < Duration::from_secs(3),
        "withdrawn {took:?} after the kill: the 30 s stale-load window, not the connection"
    );
    assert_lost(&mut sidecar, &id, "engine connection lost");
}

#[test]
fn unregistered_liveness_warns_once_then_counts_once_it_reports() {
    let dir = TempDir::new("unregistered");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &["--liveness-unregistered"], &[]);
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
    let (mock, mut sidecar, id) = serving_with_id(
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
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &["--probe-interval", "300ms"]);
    mock.control("/identity?version=2.0.0-other");
    let line = assert_lost(&mut sidecar, &id, "new engine identity trtllm 1.0.0-mock ");
    assert!(line.contains("-> trtllm 2.0.0-other "), "{line}");
}

#[test]
fn sigterm_before_the_engine_came_up_exits_0_with_nothing_registered() {
    let dir = TempDir::new("early-term");
    let mut sidecar = Sidecar::start(&dir.0, free_addr(), &[]);
    sidecar.proc.wait_for_line("not ready yet", HANG);
    sidecar.proc.stop_cleanly();
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
        &["--worker-threads", "0"],
        &["--worker-threads", "all"],
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
        let mut p = spawn_sidecar(&args, dir.0.join(format!("flags-{i}.log")));
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
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &["--router-grace", "2s"]);
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

#[test]
fn a_liveness_watch_that_never_opens_is_a_loss() {
    let dir = TempDir::new("watch-held");
    let (_mock, mut sidecar, id) = serving_with_id(
        &dir,
        &["--hold-watch"],
        &["--connect-attempt-timeout", "1s"],
    );
    assert_lost(&mut sidecar, &id, "liveness watch did not open in 1s");
}

#[test]
fn an_error_status_sent_on_the_watch_is_a_loss() {
    let dir = TempDir::new("watch-error");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &[]);
    mock.control("/watch/fail?code=13&message=executor%20failed");
    assert_lost(
        &mut sidecar,
        &id,
        "liveness stream failed: INTERNAL: executor failed",
    );
}

#[test]
fn liveness_deregistered_after_a_status_is_a_loss() {
    let dir = TempDir::new("deregistered");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &[]);
    mock.control("/unregister?service=liveness");
    assert_lost(&mut sidecar, &id, "liveness service deregistered");
}

#[test]
fn not_found_on_the_watch_warns_once_and_keeps_serving() {
    let dir = TempDir::new("watch-not-found");
    let (_mock, mut sidecar, _id) = serving_with_id(
        &dir,
        &["--liveness-unregistered", "--watch-unknown-not-found"],
        &[],
    );
    let warn = sidecar
        .proc
        .wait_for_line("does not serve grpc.health.v1 Watch", HANG);
    assert!(
        warn.contains("WARN") && warn.contains("NOT_FOUND"),
        "{warn}"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        sidecar.proc.running(),
        "NOT_FOUND is an older engine, not a loss"
    );
    assert_eq!(sidecar.records().len(), 1, "still registered");
    assert_eq!(sidecar.proc.count_lines(" WARN "), 1, "exactly one warning");
    sidecar.proc.stop_cleanly();
}

#[test]
fn inference_going_not_serving_changes_nothing() {
    let dir = TempDir::new("inference");
    let (mock, mut sidecar, _id) = serving_with_id(&dir, &[], &[]);
    mock.control("/liveness?service=inference&status=2");
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running(), "readiness is never followed");
    assert_eq!(sidecar.records().len(), 1, "still registered");
    assert_eq!(http_get(sidecar.admin, "/ready").map(|r| r.0), Some(200));
    assert!(sidecar.proc.line_index(" WARN ").is_none());
    sidecar.proc.stop_cleanly();
}

#[test]
fn a_watch_ending_without_trailers_is_a_loss() {
    let dir = TempDir::new("no-trailers");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &[]);
    mock.control("/watch/end?trailers=false");
    assert_lost(&mut sidecar, &id, "liveness stream ended");
}

#[test]
fn the_engine_stopping_gracefully_ends_the_watch_and_is_a_loss() {
    let dir = TempDir::new("graceful-stop");
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &[]);
    mock.control("/stop?grace_ms=2000");
    assert_lost(&mut sidecar, &id, "liveness stream ended");
}

/// SIGTERM with a router grace long enough for a loss to happen inside it:
/// the loss is a WARN, the exit stays 0, and no ERROR is logged.
fn assert_loss_during_drain_keeps_exit_0(
    name: &str,
    cause: &str,
    reason_prefix: &str,
    sidecar_args: &[&str],
) {
    let dir = TempDir::new(name);
    let mut args = vec!["--router-grace", "6s"];
    args.extend_from_slice(sidecar_args);
    let (mock, mut sidecar, id) = serving_with_id(&dir, &[], &args);
    sidecar.proc.signal("TERM");
    wait_until(HANG, "the record to be withdrawn", || {
        sidecar.records().is_empty()
    });
    mock.control(cause);
    let warn = sidecar.proc.wait_for_line("engine lost during drain", HANG);
    assert!(
        warn.contains("WARN")
            && warn.contains(&format!("engine lost during drain: {reason_prefix}"))
            && warn.ends_with(&format!("(instance {id}); exit code stays 0")),
        "{warn}"
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    assert!(
        sidecar.proc.line_index("ERROR").is_none(),
        "a loss during the drain is not an error; log:\n{}",
        sidecar.proc.log_text()
    );
    sidecar.proc.assert_withdrawn_before_exit(0);
}

#[test]
fn stale_load_during_the_sigterm_drain_keeps_exit_0() {
    assert_loss_during_drain_keeps_exit_0(
        "drain-stale",
        "/healthcheck?mode=stall",
        "routing load stale for ",
        &["--probe-interval", "300ms", "--stale-after", "1500ms"],
    );
}

#[test]
fn a_new_identity_during_the_sigterm_drain_keeps_exit_0() {
    assert_loss_during_drain_keeps_exit_0(
        "drain-identity",
        "/identity?version=2.0.0-other",
        "new engine identity trtllm 1.0.0-mock ",
        &["--probe-interval", "300ms"],
    );
}

/// The OS refusing the runtime's threads (here: one process allowed for the
/// user the sidecar runs as) is exit 71, never 1 ("engine lost"). Needs root to
/// switch users, as CI has.
#[test]
fn a_runtime_that_cannot_start_exits_71_not_1() {
    let dir = TempDir::new("runtime");
    let out = std::process::Command::new("prlimit")
        .args(["--nproc=1", "setpriv", "--reuid=65534", "--regid=65534"])
        // Two threads: the request plane's second, started before anything is
        // contacted. (One is the current-thread scheduler: no thread to refuse.)
        .args([
            "--clear-groups",
            binary(),
            "run",
            "--worker-threads",
            "2",
            "--admin-listen",
        ])
        .arg(free_addr().to_string())
        .arg("--listen")
        .arg(free_addr().to_string())
        .arg("--discovery")
        .arg(format!("file:{}", dir.0.join("discovery").display()))
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("run prlimit and setpriv (util-linux; the tests run as root)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(71), "exit code; stderr:\n{stderr}");
    assert!(
        stderr.contains("cannot start a request-plane thread"),
        "says why: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic output: {stderr}");
}
