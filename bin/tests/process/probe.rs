//! `llm-sidecar probe` as a kubelet's exec probe or a script runs it: exit 0
//! only while the engine or the sidecar serves, and the code says why not.

use std::process::Command;
use std::time::Duration;

use crate::support::*;

/// Runs `llm-sidecar probe <args>`; (exit code, stdout + stderr).
fn probe(args: &[&str]) -> (i32, String) {
    let out = Command::new(binary())
        .arg("probe")
        .args(args)
        .output()
        .expect("run probe");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().expect("exit code"), text)
}

#[test]
fn an_engine_of_every_kind_is_found_and_serves() {
    let dir = TempDir::new("probe-kinds");
    for kind in ["trtllm", "openengine", "vllm", "sglang"] {
        let mock = Mock::start(&dir.0, free_addr(), &["--kind", kind]);
        let (code, text) = probe(&["--engine", &mock.grpc.to_string()]);
        assert_eq!(code, 0, "{kind}: {text}");
        assert!(text.contains(&format!("({kind})")), "{kind}: {text}");
    }
}

#[test]
fn an_engine_not_serving_is_4_unreachable_2_and_unknown_3() {
    let dir = TempDir::new("probe-codes");
    let warming = Mock::start(
        &dir.0,
        free_addr(),
        &["--kind", "sglang", "--warmup", "60s"],
    );
    let (code, text) = probe(&["--engine", &warming.grpc.to_string()]);
    assert_eq!(code, 4, "{text}");
    assert!(text.contains("NOT_SERVING"), "{text}");

    let (code, text) = probe(&["--engine", &free_addr().to_string()]);
    assert_eq!(code, 2, "nothing listens: {text}");

    let none = Mock::start(&dir.0, free_addr(), &["--no-engine-api"]);
    let (code, text) = probe(&["--engine", &none.grpc.to_string()]);
    assert_eq!(code, 3, "{text}");
    assert!(text.contains("serves none of the engine APIs"), "{text}");

    let vllm = Mock::start(&dir.0, free_addr(), &["--kind", "vllm"]);
    let (code, text) = probe(&[
        "--engine",
        &vllm.grpc.to_string(),
        "--engine-kind",
        "sglang",
    ]);
    assert_eq!(code, 3, "the wrong kind given: {text}");

    let old = Mock::start(
        &dir.0,
        free_addr(),
        &["--kind", "openengine", "--no-health"],
    );
    let (code, text) = probe(&["--engine", &old.grpc.to_string()]);
    assert_eq!(
        code, 0,
        "an OpenEngine server without health serves: {text}"
    );
    assert!(text.contains("no grpc.health.v1 service"), "{text}");
}

#[test]
fn a_stalled_engine_is_3_within_the_timeout() {
    let dir = TempDir::new("probe-stall");
    let mock = Mock::start(&dir.0, free_addr(), &["--kind", "vllm"]);
    mock.proc.signal("STOP");
    // The connection opens (the kernel accepts); with auto the detection
    // calls stall, with a given kind the health Check does: 3 either way,
    // within a few timeouts, never at the kubelet's own bound.
    for (args, want) in [(&[][..], 3), (&["--engine-kind", "vllm"][..], 3)] {
        let started = std::time::Instant::now();
        let target = mock.grpc.to_string();
        let mut all = vec!["--engine", &target, "--timeout", "500ms"];
        all.extend_from_slice(args);
        let (code, text) = probe(&all);
        assert_eq!(code, want, "{args:?}: {text}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{args:?}: bounded by its 500 ms timeout, took {:?}",
            started.elapsed()
        );
    }
    mock.proc.signal("CONT");
}

#[test]
fn a_sidecar_serves_0_drains_4_and_gone_2() {
    let dir = TempDir::new("probe-sidecar");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &["--router-grace", "3s"]);
    let target = sidecar.listen.to_string();
    assert_eq!(probe(&["--sidecar", &target]).0, 0);
    sidecar.proc.signal("TERM");
    wait_until(HANG, "the withdrawal", || sidecar.records().is_empty());
    let (code, text) = probe(&["--sidecar", &target]);
    assert_eq!(code, 4, "draining is not serving: {text}");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(probe(&["--sidecar", &target]).0, 2);
}

#[test]
fn bad_probe_flags_exit_2_before_contacting_anything() {
    for args in [
        &[][..],
        &["--engine", "no-port"][..],
        &["--engine", "127.0.0.1:1", "--sidecar", "127.0.0.1:2"][..],
        &["--sidecar", "127.0.0.1:1", "--engine-kind", "vllm"][..],
        &["--engine", "127.0.0.1:1", "--timeout", "0s"][..],
        &["--engine", "127.0.0.1:1", "--engine-kind", "tgi"][..],
    ] {
        let (code, text) = probe(args);
        assert_eq!(code, 2, "{args:?}: {text}");
        assert!(
            !text.contains("no connection"),
            "{args:?} contacted nothing: {text}"
        );
    }
}

#[test]
fn copy_binary_puts_a_runnable_probe_into_a_shared_directory() {
    let dir = TempDir::new("copy-binary");
    let shared = dir.0.join("shared");
    std::fs::create_dir_all(&shared).expect("shared dir");
    let out = Command::new(binary())
        .args(["copy-binary", &shared.display().to_string()])
        .output()
        .expect("run copy-binary");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let copy = shared.join("llm-sidecar");
    let mock = Mock::start(&dir.0, free_addr(), &["--kind", "vllm"]);
    let probed = Command::new(&copy)
        .args(["probe", "--engine", &mock.grpc.to_string(), "-q"])
        .status()
        .expect("the copy runs");
    assert_eq!(probed.code(), Some(0), "the copy probes like the original");
    let missing = Command::new(binary())
        .args(["copy-binary", &dir.0.join("nowhere").display().to_string()])
        .output()
        .expect("run copy-binary");
    assert_eq!(missing.status.code(), Some(2), "{missing:?}");
}
