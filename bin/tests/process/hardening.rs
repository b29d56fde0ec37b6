//! Hostile callers, hostile engines and stray signals: each attack that once
//! hurt the sidecar, now failing alone (docs/RELIABILITY.md, "Hardening").
//! Attacks whose outcome a caller and the engine see without the process
//! (oversized answer headers, half-open calls and own-health Watches, a
//! stalled message, silent and idle connections, the connection cap,
//! early-ended, reset and malformed calls; engine streams shared across
//! addresses, callers with a zero window) are tested in-process, in
//! `io/tests/in_process/{hardening,sharing}.rs`.

use std::net::SocketAddr;
use std::time::Duration;

use llm_sidecar_engine_api::trtllm::GetModelInfoRequest;
use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_testkit::trtllm::{
    generate, generate_or_give_up, generate_through, zero_window_callers,
};
use prost::Message;

use crate::support::raw_h2::{self, RawH2};
use crate::support::*;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What Python's grpcio (gRPC C-core) reports for one call: (code, details).
fn grpcio_call(target: SocketAddr, kind: &str, path: &str, request: &[u8]) -> (String, String) {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/process/clients/grpcio_call.py"
    );
    let out = std::process::Command::new("python3")
        .args([script, &target.to_string(), kind, path, &hex(request)])
        .output()
        .expect("run python3 (scripts/test.sh installs grpcio)");
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "grpcio client output: {e}: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (
        json["code"].as_str().unwrap_or_default().to_string(),
        json["details"].as_str().unwrap_or_default().to_string(),
    )
}

#[test]
fn a_grpcio_caller_sees_the_engines_trailers_only_status_unchanged() {
    let dir = TempDir::new("trailers-only");
    let (mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let cases: [(&str, &str, Vec<u8>, &str); 3] = [
        (
            "unary",
            "/trtllm.TrtllmService/NoSuchMethod",
            Vec::new(),
            "UNIMPLEMENTED",
        ),
        (
            "stream",
            "/trtllm.TrtllmService/Generate",
            generate("error:7:not for you", 3, 1).encode_to_vec(),
            "PERMISSION_DENIED",
        ),
        (
            "stream",
            "/trtllm.TrtllmService/Generate",
            generate("error:13:executor failed", 3, 1).encode_to_vec(),
            "INTERNAL",
        ),
    ];
    for (kind, path, request, code) in &cases {
        let direct = grpcio_call(mock.grpc, kind, path, request);
        let proxied = grpcio_call(sidecar.listen, kind, path, request);
        assert_eq!(direct.0, *code, "the engine itself answers {code}");
        assert_eq!(
            proxied, direct,
            "{path}: through the sidecar the caller sees exactly the engine's status"
        );
    }
    // On the wire: the status arrives in a HEADERS frame that ends the stream.
    rt().block_on(async {
        let tcp = tokio::net::TcpStream::connect(sidecar.listen)
            .await
            .expect("connect");
        let (mut client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(connection);
        let request = http::Request::builder()
            .method("POST")
            .uri(format!(
                "http://{}/trtllm.TrtllmService/NoSuchMethod",
                sidecar.listen
            ))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (response, mut body) = client.send_request(request, false).expect("send");
        body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .expect("send the empty message");
        let response = response.await.expect("response headers");
        assert_eq!(response.headers()["grpc-status"], "12");
        assert!(
            response.body().is_end_stream(),
            "HEADERS carried END_STREAM: no DATA frame follows a trailers-only answer"
        );
    });
    sidecar.proc.stop_cleanly();
}

#[test]
fn a_caller_holding_every_engine_stream_does_not_block_other_callers() {
    let dir = TempDir::new("stream-limit");
    // The engine allows 20 streams per connection; the caller holds 30.
    let (mock, mut sidecar) = serving(
        &dir.0,
        &["--max-concurrent-streams", "20", "--token-delay", "20ms"],
        &[],
    );
    // Calls of a minute each: none of them can end while the test looks.
    let mut hog = bench_spawn(
        sidecar.listen,
        &[
            "-c",
            "30",
            "--connections",
            "1",
            "-n",
            "3000",
            "--calls",
            "30",
        ],
    );
    wait_until(
        HANG,
        "the engine to run all 30 of the caller's calls",
        || mock.stats()["generate_started"] == 30,
    );
    let answered = rt().block_on(async {
        let mut client = TrtllmServiceClient::connect(format!("http://{}", sidecar.listen))
            .await
            .expect("connect");
        client.get_model_info(GetModelInfoRequest {}).await
    });
    let completed = mock.stats()["generate_completed"].clone();
    assert!(answered.is_ok(), "another caller is answered: {answered:?}");
    assert_eq!(
        completed, 0,
        "...while every one of the first caller's 30 calls is still running"
    );
    let _ = hog.kill();
    let _ = hog.wait();
    sidecar.proc.signal("TERM");
    sidecar.proc.wait_exit(HANG);
}

/// One flood of `frame` from a caller that reads what comes back: the caller
/// gets GOAWAY ENHANCE_YOUR_CALM and its connection ends, while another
/// caller's calls go on without an error.
fn a_flood_is_cut(name: &str, flood_frame: Vec<u8>) {
    let dir = TempDir::new(name);
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let calm = bench_spawn(sidecar.listen, &["-c", "4", "-n", "16", "-d", "3s"]);
    let mut flooder = RawH2::connect(sidecar.listen);
    flooder.handshake();
    let mut writer = flooder.stream.try_clone().expect("clone");
    let batch: Vec<u8> = flood_frame.repeat(500);
    let sender = std::thread::spawn(move || {
        use std::io::Write;
        for _ in 0..2_000 {
            if writer.write_all(&batch).is_err() {
                return true;
            }
        }
        false
    });
    let (frames, ended) = flooder.read_to_end();
    let cut_off = sender.join().expect("flood sender");
    let calm = bench_report(calm);
    assert!(
        ended && cut_off,
        "{name}: the flooding connection was closed"
    );
    assert!(
        frames
            .iter()
            .any(|f| f.goaway_code() == Some(raw_h2::ENHANCE_YOUR_CALM)),
        "{name}: the sidecar said GOAWAY ENHANCE_YOUR_CALM first; frames: {:?}",
        frames.iter().map(|f| f.kind).collect::<Vec<_>>()
    );
    assert_eq!(calm["errors"], serde_json::json!({}), "{name}: {calm}");
    assert!(calm["calls_ok"].as_u64().unwrap_or(0) > 0, "{calm}");
    assert!(
        sidecar
            .proc
            .line_index("more control frames than its budget")
            .is_some()
    );
    sidecar.proc.stop_cleanly();
}

#[test]
fn a_ping_flood_is_cut() {
    a_flood_is_cut("ping-flood", raw_h2::frame(raw_h2::PING, 0, 0, b"floodfld"));
}

#[test]
fn a_settings_flood_is_cut() {
    a_flood_is_cut("settings-flood", raw_h2::frame(raw_h2::SETTINGS, 0, 0, &[]));
}

#[test]
fn a_priority_flood_is_cut() {
    a_flood_is_cut(
        "priority-flood",
        raw_h2::frame(raw_h2::PRIORITY, 0, 1, &[0, 0, 0, 0, 16]),
    );
}

#[test]
fn a_window_update_flood_is_cut() {
    a_flood_is_cut(
        "window-flood",
        raw_h2::frame(raw_h2::WINDOW_UPDATE, 0, 0, &1u32.to_be_bytes()),
    );
}

/// systemd's default soft limit is 1,024 open files: silent connections used
/// to exhaust it, and then the engine connection and the admin server failed.
/// The sidecar now raises the soft limit to fit `--max-connections`.
#[test]
fn a_low_open_file_limit_is_raised_and_silent_connections_starve_nothing() {
    let dir = TempDir::new("nofile");
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let (admin, listen) = (free_addr(), free_addr());
    let mut args = vec!["--nofile=128:8192".to_string(), binary().to_string()];
    args.extend(run_args(
        mock.grpc,
        listen,
        admin,
        &dir.0.join("discovery"),
        &[],
    ));
    let mut proc = Proc::spawn_program("prlimit", &args, dir.0.join("sidecar.log"));
    proc.wait_for_line("registered; serving", HANG);
    let held: Vec<RawH2> = (0..300)
        .map(|_| {
            let mut c = RawH2::connect(listen);
            c.handshake();
            c
        })
        .collect();
    let metric = |name: &str| -> Option<f64> {
        let (_, body) = http_get(admin, "/metrics")?;
        body.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    wait_until(HANG, "300 caller connections", || {
        metric("llm_sidecar_caller_connections ") == Some(300.0)
    });
    let answered = rt().block_on(async {
        let mut client = TrtllmServiceClient::connect(format!("http://{listen}"))
            .await
            .expect("connect");
        client.get_model_info(GetModelInfoRequest {}).await
    });
    assert!(
        answered.is_ok(),
        "the engine is still reached: {answered:?}"
    );
    assert!(
        proc.line_index("Too many open files").is_none(),
        "{}",
        proc.log_text()
    );
    drop(held);
    proc.stop_cleanly();
}

#[test]
fn sighup_and_sigquit_withdraw_first_like_sigterm() {
    for sig in ["HUP", "QUIT"] {
        let dir = TempDir::new(&format!("sig-{sig}"));
        let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
        sidecar.proc.signal(sig);
        assert_eq!(sidecar.proc.wait_exit(HANG), 0, "SIG{sig} exits 0");
        assert!(sidecar.records().is_empty(), "SIG{sig}: the record is gone");
        sidecar.proc.assert_withdrawn_before_exit(0);
        assert!(
            sidecar
                .proc
                .line_index(&format!("SIG{sig} received"))
                .is_some(),
            "the signal is named in the log"
        );
    }
}

#[test]
fn signals_that_mean_nothing_are_ignored_and_said_once() {
    let dir = TempDir::new("sig-ignored");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    for sig in ["USR1", "USR1", "USR2", "ALRM", "40"] {
        sidecar.proc.signal(sig);
    }
    std::thread::sleep(Duration::from_secs(1));
    assert!(sidecar.proc.running(), "none of them ended the process");
    assert_eq!(sidecar.records().len(), 1, "still registered");
    assert_eq!(http_get(sidecar.admin, "/ready").map(|r| r.0), Some(200));
    assert_eq!(sidecar.proc.count_lines("ignoring SIGUSR1"), 1, "said once");
    for name in ["SIGUSR2", "SIGALRM", "a real-time signal (40)"] {
        assert_eq!(
            sidecar.proc.count_lines(&format!("ignoring {name}")),
            1,
            "{name}; log:\n{}",
            sidecar.proc.log_text()
        );
    }
    sidecar.proc.stop_cleanly();
}

#[test]
fn a_record_removed_while_serving_is_written_again() {
    let dir = TempDir::new("record-removed");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let record = sidecar.wait_for_record(HANG);
    std::fs::remove_file(&record).expect("remove the record");
    let warn = sidecar
        .proc
        .wait_for_line("(its record file was removed); registering again", HANG);
    assert!(warn.contains("WARN"), "{warn}");
    wait_until(HANG, "the record to be written again", || record.exists());
    assert_eq!(http_get(sidecar.admin, "/ready").map(|r| r.0), Some(200));
    sidecar.proc.stop_cleanly();
    assert!(sidecar.records().is_empty());
}

/// A record removed while serving that cannot be written again (a file
/// stands where its directory was) for `--reregister-deadline`: the worker
/// leaves as after an engine loss, with one ERROR line, and exits 1, instead
/// of serving on where no router can see it.
#[test]
fn a_record_that_cannot_be_written_again_within_the_deadline_ends_the_worker_with_exit_1() {
    let dir = TempDir::new("record-unwritable");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &["--reregister-deadline", "2s"]);
    let record = sidecar.wait_for_record(HANG);
    let parent = record
        .parent()
        .expect("the record's directory")
        .to_path_buf();
    std::fs::remove_dir_all(&parent).expect("remove the record's directory");
    std::fs::write(&parent, b"not a directory").expect("a file in its place");
    let removed = std::time::Instant::now();
    assert_eq!(
        sidecar.proc.wait_exit(HANG),
        1,
        "{}",
        sidecar.proc.log_text()
    );
    let left = removed.elapsed();
    assert_eq!(
        sidecar
            .proc
            .count_lines("is not registered in discovery: not in discovery for"),
        1,
        "{}",
        sidecar.proc.log_text()
    );
    assert!(
        sidecar.proc.line_index("registering again")
            < sidecar.proc.line_index("is not registered in discovery"),
        "it tried first"
    );
    eprintln!("record unwritable: exit 1 {left:?} after its directory became a file");
}

#[test]
fn instances_reads_only_regular_files_once_each_and_escapes_what_it_prints() {
    let dir = TempDir::new("instances");
    let root = dir.0.join("registry");
    let records = root.join("v1/instances/dynamo/backend/generate");
    std::fs::create_dir_all(&records).expect("dirs");
    let fifo = records.join("fifo.json");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    std::os::unix::fs::symlink(&root, records.join("loop")).expect("symlink loop");
    let record = serde_json::json!({
        "instance_id": "abc", "namespace": "dynamo", "component": "backend",
        "endpoint": "generate", "address": "10.0.0.1:1", "transport": "grpc",
        "engine": {"kind": "trtllm", "version": "1", "identity": "x"},
        "model": {"name": "evil\nabc        trtllm     forged-row\u{1b}[2J", "max_input_len": 1, "max_seq_len": 2},
        "pid": 1, "registered_at": "2026-12-01T00:00:00.000Z"
    });
    std::fs::write(records.join("abc.json"), record.to_string()).expect("record");
    let mut p = spawn_sidecar(
        &[
            "instances".to_string(),
            "--discovery".into(),
            format!("file:{}", root.display()),
        ],
        dir.0.join("instances.log"),
    );
    assert_eq!(p.wait_exit(HANG), 0, "a FIFO does not hang the listing");
    let out = std::process::Command::new(binary())
        .args([
            "instances",
            "--discovery",
            &format!("file:{}", root.display()),
        ])
        .output()
        .expect("instances");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "a header and one line per entry:\n{text}");
    assert!(text.contains("fifo: not a regular file"), "{text}");
    assert!(
        text.contains("evil\\nabc") && text.contains("\\u{1b}[2J"),
        "control characters are shown escaped:\n{text}"
    );
    assert!(
        !text.contains('\u{1b}'),
        "no raw escape reaches the terminal"
    );
}

#[test]
fn hostile_flag_values_exit_2_before_contacting_anything() {
    let dir = TempDir::new("hostile-flags");
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let plain = dir.0.join("plain-file");
    std::fs::write(&plain, "not a directory").expect("file");
    let fifo = dir.0.join("cert-fifo.pem");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo")
            .success()
    );
    let (plain, fifo) = (plain.display().to_string(), fifo.display().to_string());
    let file_root = format!("file:{plain}");
    let cases: Vec<Vec<&str>> = vec![
        vec!["--advertise", "10.0.0.1\n:7000"],
        vec!["--advertise", "evil\u{1b}[2J:7000"],
        vec!["--discovery", &file_root],
        vec!["--discovery", "file:/proc/self"],
        vec!["--tls-cert", "/dev/zero", "--tls-key", "/dev/zero"],
        vec!["--tls-cert", &fifo, "--tls-key", &fifo],
        vec!["--max-message-bytes", "0"],
        vec!["--max-header-list-bytes", "0"],
        vec!["--max-connections", "0"],
        vec!["--idle-timeout", "0s"],
    ];
    for (i, extra) in cases.iter().enumerate() {
        let mut args = vec![
            "run".to_string(),
            "--engine-endpoint".into(),
            mock.grpc.to_string(),
            "--admin-listen".into(),
            free_addr().to_string(),
            "--listen".into(),
            free_addr().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = spawn_sidecar(&args, dir.0.join(format!("flags-{i}.log")));
        let code = p.wait_exit(HANG);
        assert_eq!(code, 2, "{extra:?} exits 2; log:\n{}", p.log_text());
        assert!(p.log_text().contains("error:"), "{extra:?} explains itself");
    }
    assert_eq!(mock.stats()["connections"], 0, "nothing was contacted");
}

/// Someone who can write the discovery directory sees the instance id (in
/// `/state`) and the pid (in the record): the temporary file once had a name
/// built from both, and followed a symbolic link placed there. Removing the
/// record makes the sidecar write it again, through the link.
#[test]
fn the_record_is_never_written_through_a_link_placed_in_the_registry() {
    let dir = TempDir::new("tmp-link");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let record = sidecar.wait_for_record(HANG);
    let victim = dir.0.join("victim.txt");
    std::fs::write(&victim, "precious").expect("victim");
    let id = sidecar.instance_id();
    let predictable = record
        .parent()
        .expect("records dir")
        .join(format!(".{id}.json.{}.tmp", sidecar.proc.pid()));
    std::os::unix::fs::symlink(&victim, &predictable).expect("plant the link");
    std::fs::remove_file(&record).expect("remove the record");
    wait_until(HANG, "the record to be written again", || record.exists());
    assert_eq!(
        std::fs::read_to_string(&victim).expect("victim"),
        "precious",
        "the file behind the link is untouched"
    );
    assert!(
        std::fs::symlink_metadata(&record)
            .expect("record")
            .file_type()
            .is_file(),
        "the record is a file of its own"
    );
    sidecar.proc.stop_cleanly();
}

/// Attack 8 of hardening round three: idle connections, re-opened as soon as
/// they are closed, from many addresses on the pod network, against the admin
/// port the kubelet probes. Every probe of `/live` is still answered: one
/// peer holds at most 8 connections, and a full port closes its oldest
/// connection to take a new one.
#[test]
fn an_admin_port_filled_with_idle_connections_still_answers_every_probe() {
    let dir = TempDir::new("admin-fill");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let admin = sidecar.admin;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let attacker = {
        let stop = stop.clone();
        let opened = opened.clone();
        std::thread::spawn(move || {
            rt().block_on(async move {
                let mut slots = Vec::new();
                // 10 addresses × 8 connections: more than the port's 64.
                for n in 2..12u8 {
                    for _ in 0..8 {
                        let stop = stop.clone();
                        let opened = opened.clone();
                        slots.push(tokio::spawn(async move {
                            use tokio::io::AsyncReadExt;
                            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                                let socket = tokio::net::TcpSocket::new_v4().expect("socket");
                                if socket
                                    .bind(std::net::SocketAddr::from(([127, 0, 0, n], 0)))
                                    .is_err()
                                {
                                    return;
                                }
                                let Ok(mut stream) = socket.connect(admin).await else {
                                    tokio::time::sleep(Duration::from_millis(5)).await;
                                    continue;
                                };
                                opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                // Idle until the sidecar closes it, then again.
                                let mut byte = [0u8; 1];
                                let _ = tokio::time::timeout(
                                    Duration::from_secs(10),
                                    stream.read(&mut byte),
                                )
                                .await;
                            }
                        }));
                    }
                }
                for slot in slots {
                    let _ = slot.await;
                }
            });
        })
    };
    wait_until(HANG, "the attack to fill the admin port", || {
        opened.load(std::sync::atomic::Ordering::Relaxed) >= 80
    });
    let mut failed = 0;
    for _ in 0..20 {
        match http_get(admin, "/live") {
            Some((200, _)) => {}
            _ => failed += 1,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reopened = opened.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        failed, 0,
        "probes of /live that failed, of 20 ({reopened} attack connections)"
    );
    assert!(sidecar.proc.running());
    sidecar.proc.stop_cleanly();
    let _ = attacker.join();
}

/// Attack 1 of hardening round three: rapid reset through the sidecar. While a
/// victim streams a long generation, four other connections send bursts of
/// HEADERS + DATA + RST_STREAM for 2 s. The sidecar must not pass the burst
/// on to the engine's connection (whose own rapid-reset guard would GOAWAY it
/// and kill the victim's call with it): the attacker is cut, the victim's
/// call completes with every token.
#[test]
fn rapid_reset_through_the_sidecar_kills_no_other_callers_call() {
    rapid_reset_beside_a_victim(None);
}

/// Attack 1 again, with each burst's RST_STREAMs sent a moment (2 ms) after
/// its HEADERS + DATA, in a write of their own: the sidecar has read the
/// calls and opened their engine streams before the resets come, so it
/// cannot tell them from calls a caller gave up on. The engine pauses now
/// and then (SIGSTOP for 100 ms: a Python engine's GIL or a loaded node does
/// the same), so the sidecar's resets reach it beside streams it has not
/// taken yet. The engine must still never see more than a few of those: the
/// victim's call completes with every token and no engine connection is cut.
#[test]
fn delayed_rapid_reset_while_the_engine_pauses_kills_no_other_callers_call() {
    rapid_reset_beside_a_victim(Some(Duration::from_millis(20)));
}

/// Bursts of 50 calls, each HEADERS + DATA + RST_STREAM, on four connections
/// for 2 s beside a victim streaming 300 tokens; with `delay`, each burst's
/// resets follow its calls in a write of their own after that long.
fn rapid_reset_beside_a_victim(delay: Option<Duration>) {
    let dir = TempDir::new("rapid-reset");
    let (mock, mut sidecar) = serving(&dir.0, &["--token-delay", "10ms"], &[]);
    let listen = sidecar.listen;
    let block = raw_h2::grpc_headers_block(&listen.to_string(), "/trtllm.TrtllmService/Generate");
    let data = raw_h2::grpc_message(&generate("rapid", 3, 4).encode_to_vec());
    let engine_connections = || mock.stats()["connections"].as_u64().expect("connections");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let victim = std::thread::spawn(move || rt().block_on(generate_through(listen, "victim", 300)));
    std::thread::sleep(Duration::from_millis(300));
    let connections_before = engine_connections();
    // With resets of their own, bursts stay below the 20 streams reset before
    // they were taken past which the sidecar's own h2 cuts a caller connection.
    let burst = if delay.is_some() { 10 } else { 50 };
    let attackers: Vec<_> = (0..4)
        .map(|_| {
            let (block, data, stop, sent) =
                (block.clone(), data.clone(), stop.clone(), sent.clone());
            std::thread::spawn(move || {
                let mut raw = raw_h2::RawH2::connect(listen);
                raw.handshake();
                let cancel = 8u32.to_be_bytes();
                let mut stream = 1u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && stream < 2_000_000 {
                    let (mut out, mut resets) = (Vec::new(), Vec::new());
                    for _ in 0..burst {
                        out.extend(raw_h2::frame(raw_h2::HEADERS, 0x4, stream, &block));
                        out.extend(raw_h2::frame(raw_h2::DATA, 0, stream, &data));
                        let reset = raw_h2::frame(0x3, 0, stream, &cancel);
                        match delay {
                            Some(_) => resets.extend(reset),
                            None => out.extend(reset),
                        }
                        stream += 2;
                    }
                    if raw.send(&out).is_err() {
                        return;
                    }
                    if let Some(delay) = delay {
                        std::thread::sleep(delay);
                        if raw.send(&resets).is_err() {
                            return;
                        }
                    }
                    sent.fetch_add(burst, std::sync::atomic::Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        })
        .collect();
    // The most engine streams seen waiting for the engine's answer before
    // their reset, read while the engine is paused.
    let mut awaiting_reset = 0.0f64;
    if delay.is_some() {
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(400));
            mock.proc.signal("STOP");
            std::thread::sleep(Duration::from_millis(70));
            let now = sidecar.metric("llm_sidecar_engine_streams_awaiting_reset");
            awaiting_reset = awaiting_reset.max(now.unwrap_or(0.0));
            std::thread::sleep(Duration::from_millis(30));
            mock.proc.signal("CONT");
        }
    } else {
        std::thread::sleep(Duration::from_secs(2));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for a in attackers {
        let _ = a.join();
    }
    let resets = sent.load(std::sync::atomic::Ordering::Relaxed);
    let outcome = victim.join().expect("victim thread");
    assert_eq!(
        outcome.map_err(|s| (s.code(), s.message().to_string())),
        Ok(301),
        "the victim's 300 tokens and final message, beside {resets} rapid resets"
    );
    // An engine that sent GOAWAY made the sidecar open another connection,
    // even when the victim's call was on a connection it spared.
    assert_eq!(
        engine_connections() - connections_before,
        0,
        "the engine's connections were never cut (new ones opened), beside {resets} rapid resets"
    );
    if delay.is_some() {
        assert!(
            awaiting_reset > 0.0,
            "the calls reset while the engine paused waited for its answer"
        );
        // Once the engine has answered them, none is left waiting.
        wait_until(
            HANG,
            "every engine stream waiting for its reset reset",
            || sidecar.metric("llm_sidecar_engine_streams_awaiting_reset") == Some(0.0),
        );
    }
    sidecar.proc.stop_cleanly();
}

/// Attack 4 of hardening round three: a caller that opens its windows wide
/// (2 GiB), starts 512 calls of 20,000 tokens each, and never reads its
/// socket. What the sidecar buffers for it is bounded per stream: its RSS
/// grows by about a hundred megabytes, not the half gigabyte in 6 s (a
/// gigabyte later) it took before.
#[test]
fn a_caller_that_never_reads_makes_the_sidecar_buffer_little() {
    let dir = TempDir::new("never-reads");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let before = rss_kib(sidecar.proc.pid());
    let block = raw_h2::grpc_headers_block(
        &sidecar.listen.to_string(),
        "/trtllm.TrtllmService/Generate",
    );
    let mut raw = raw_h2::RawH2::connect(sidecar.listen);
    // The preface, SETTINGS INITIAL_WINDOW_SIZE 2^31-1, and the connection
    // window opened as wide.
    let mut hello = raw_h2::preface(&[(0x4, 0x7fff_ffff)]);
    hello.extend(raw_h2::frame(
        raw_h2::WINDOW_UPDATE,
        0,
        0,
        &(0x7fff_ffffu32 - 65_535).to_be_bytes(),
    ));
    raw.send(&hello).expect("preface");
    let mut out = Vec::new();
    for n in 0..512u32 {
        let stream = 1 + 2 * n;
        let message = generate(&format!("unread-{n}"), 3, 20_000).encode_to_vec();
        out.extend(raw_h2::call(stream, &block, &message));
    }
    raw.send(&out).expect("512 calls");
    // The socket is never read from now on.
    std::thread::sleep(Duration::from_secs(6));
    let grown_mib = rss_kib(sidecar.proc.pid()).saturating_sub(before) / 1024;
    println!("sidecar RSS grew by {grown_mib} MiB for a caller that never reads");
    // Release build: ~124 MiB with 16 KiB per stream, 510–554 MiB (and
    // growing) with h2's default 400 KiB.
    assert!(
        grown_mib < 256,
        "the sidecar holds {grown_mib} MiB more for a caller that never reads"
    );
    drop(raw);
    sidecar.proc.stop_cleanly();
}

/// Attack 3 of hardening round three, with the window: 4,096 calls whose
/// callers set their window to zero, each answer longer than an engine
/// stream's window. Each stalled answer keeps its stream window (64 KiB) of
/// the engine connection's window; all on one engine connection, they held
/// all of it (256 MiB), and another call got no byte. The pool now opens at
/// most 2,048 streams per engine connection, so stalled ones hold at most
/// half its window.
#[test]
fn zero_window_callers_holding_every_stream_window_starve_no_other_call() {
    let dir = TempDir::new("zero-window");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let listen = sidecar.listen;
    let before = rss_kib(sidecar.proc.pid());
    let stalled = zero_window_callers(listen, 2_048);
    // Until every stalled answer has filled its engine stream's window (the
    // engine sends no more): 4,096 × 64 KiB, the whole window of one engine
    // connection.
    let full = 4_096.0 * 65_536.0;
    let start = std::time::Instant::now();
    let mut held = 0.0;
    while held < full && start.elapsed() < Duration::from_secs(240) {
        std::thread::sleep(Duration::from_millis(500));
        held = metric_at(sidecar.admin, "llm_sidecar_answer_bytes_held").unwrap_or(0.0);
    }
    assert!(held >= full, "only {held} bytes held after 240 s");
    assert_eq!(
        rt().block_on(generate_or_give_up(listen, "late", 16)),
        Ok(17),
        "a call started beside 4,096 stalled calls gets its 16 tokens and final message"
    );
    let grown_mib = rss_kib(sidecar.proc.pid()).saturating_sub(before) / 1024;
    println!("sidecar RSS grew by {grown_mib} MiB holding {held} bytes for 4,096 stalled calls");
    // 4,096 × 64 KiB held, and h2's state for each stream.
    assert!(grown_mib < 512, "the sidecar holds {grown_mib} MiB more");
    drop(stalled);
    sidecar.proc.stop_cleanly();
}
