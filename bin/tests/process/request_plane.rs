//! The request plane as clients see it: calls through the sidecar behave as if
//! they went to the engine, and nothing is lost when the worker drains.
//! What needs no signal, exit, log line, thread or memory of the process
//! (pass-through, deadlines, cancels, bad input, client streams) is tested
//! in-process, in `io/tests/in_process/calls.rs`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::support::*;
use llm_sidecar_engine_api::trtllm::{GenerateRequest, HealthCheckRequest};
use llm_sidecar_testkit::trtllm::{client, generate, run_generate};
use tonic::Code;

/// Waits (bounded) until the mock engine recorded that call `id` was reset.
fn wait_for_engine_reset(mock: &Mock, id: &str) {
    wait_until(
        Duration::from_secs(5),
        "the engine to see the reset",
        || {
            mock.stats()["cancelled_ids"]
                .as_array()
                .is_some_and(|ids| ids.iter().any(|i| i == id))
        },
    );
}

#[test]
fn sigterm_drains_a_short_stream_and_refuses_new_calls() {
    let dir = TempDir::new("drain");
    let (mock, mut sidecar) = serving(
        &dir.0,
        &["--token-delay", "20ms"],
        &["--router-grace", "1s", "--drain-timeout", "10s"],
    );
    let runtime = rt();
    runtime.block_on(async {
        let long = tokio::spawn(run_generate(
            client(sidecar.listen).await,
            generate("in-flight", 4, 150),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        sidecar.proc.signal("TERM");
        // The record goes first; from then on the engine's health RPC is answered "draining".
        wait_until(HANG, "the record to be withdrawn", || {
            sidecar.records().is_empty()
        });
        let mut c = client(sidecar.listen).await;
        let hc = c
            .health_check(HealthCheckRequest {})
            .await
            .expect_err("HealthCheck while draining");
        assert_eq!((hc.code(), hc.message()), (Code::Unavailable, "draining"));
        // After the router grace, a new call is refused and never reaches the engine.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let late = run_generate(client(sidecar.listen).await, generate("too-late", 4, 10)).await;
        assert_eq!(late.end, Err((Code::Unavailable, "draining".to_string())));
        let done = long.await.expect("join");
        assert_eq!(done.end, Ok(()), "the in-flight stream completes");
        assert_eq!(done.streamed.len(), 150, "with every token");
        assert_eq!(done.complete.len(), 150);
    });
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    let seen = mock.stats()["seen_ids"].clone();
    assert!(
        !seen
            .as_array()
            .expect("ids")
            .iter()
            .any(|i| i == "too-late"),
        "the engine never saw the refused call: {seen}"
    );
    sidecar.proc.assert_withdrawn_before_exit(0);
}

#[test]
fn sigterm_cuts_a_stream_longer_than_the_drain_deadline() {
    let dir = TempDir::new("cut");
    let (mock, mut sidecar) = serving(
        &dir.0,
        &["--token-delay", "50ms"],
        &["--router-grace", "0s", "--drain-timeout", "2s"],
    );
    let started = Instant::now();
    rt().block_on(async {
        let long = tokio::spawn(run_generate(
            client(sidecar.listen).await,
            generate("endless", 4, 10_000),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        sidecar.proc.signal("TERM");
        let cut = long.await.expect("join");
        let (code, message) = cut.end.clone().expect_err("cut");
        assert_eq!(code, Code::Unavailable, "{message}");
        assert!(message.contains("drain deadline"), "{message}");
        assert!(!cut.streamed.is_empty() && cut.streamed.len() < 10_000);
    });
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(10),
        "exited on time: {elapsed:?}"
    );
    wait_for_engine_reset(&mock, "endless");
    assert!(
        sidecar
            .proc
            .line_index("drain deadline reached with 1 calls in flight")
            .is_some()
    );
}

#[test]
fn engine_loss_closes_admission_at_once_and_lets_calls_end() {
    let dir = TempDir::new("loss-inflight");
    let (mock, mut sidecar) = serving(
        &dir.0,
        &["--token-delay", "20ms"],
        &["--drain-timeout", "10s"],
    );
    rt().block_on(async {
        let long = tokio::spawn(run_generate(
            client(sidecar.listen).await,
            generate("during-loss", 4, 100),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        mock.control("/liveness?status=2");
        wait_until(HANG, "the record to be withdrawn", || {
            sidecar.records().is_empty()
        });
        let refused =
            run_generate(client(sidecar.listen).await, generate("after-loss", 4, 10)).await;
        assert_eq!(
            refused.end,
            Err((Code::Unavailable, "draining".to_string()))
        );
        let done = long.await.expect("join");
        assert_eq!(done.end, Ok(()));
        assert_eq!(done.streamed.len(), 100);
    });
    assert_eq!(sidecar.proc.wait_exit(HANG), 1);
    assert!(
        !mock.stats()["seen_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .any(|i| i == "after-loss")
    );
}

/// One HTTP/2 frame header: length, type, flags, stream id.
fn h2_frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut frame = len.to_be_bytes()[1..].to_vec();
    frame.extend([kind, flags, 0, 0, 0, 0]);
    frame.extend(payload);
    frame
}

const H2_SETTINGS: u8 = 0x4;
const H2_PING: u8 = 0x6;
const H2_GOAWAY: u8 = 0x7;
const H2_ACK: u8 = 0x1;

/// A caller that is still sending when the sidecar exits (a ping here; in real
/// life a window update, or a request racing the GOAWAY) gets the GOAWAY, a
/// clean close, and no TCP reset: the sidecar reads until the caller closes.
/// A reset would fail the caller's next write, and its HTTP/2 stack would then
/// drop answers it had not read yet.
#[test]
fn exit_closes_a_busy_caller_connection_without_a_reset() {
    use std::io::ErrorKind;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let dir = TempDir::new("linger");
    let (_mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let mut reader = TcpStream::connect(sidecar.listen).expect("connect");
    reader
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let writer = Arc::new(Mutex::new(reader.try_clone().expect("clone")));
    let send = |bytes: &[u8]| writer.lock().expect("writer").write_all(bytes);
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(h2_frame(H2_SETTINGS, 0, &[]));
    send(&hello).expect("preface");

    // The busy caller: a ping every 5 ms until told to stop; the first write
    // error is kept.
    let stop = Arc::new(AtomicBool::new(false));
    let pinger = {
        let (writer, stop) = (writer.clone(), stop.clone());
        std::thread::spawn(move || {
            let ping = h2_frame(H2_PING, 0, b"busy-cli");
            while !stop.load(Ordering::Acquire) {
                if let Err(e) = writer.lock().expect("writer").write_all(&ping) {
                    return Some(e.kind());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            None
        })
    };

    // Read frames, answering the sidecar's SETTINGS and PINGs as a caller
    // must; SIGTERM once the connection is up; stop at the end of the stream.
    let (mut goaway, mut signalled) = (false, false);
    let ended = loop {
        let mut head = [0u8; 9];
        if let Err(e) = reader.read_exact(&mut head) {
            break e.kind();
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        if let Err(e) = reader.read_exact(&mut payload) {
            break e.kind();
        }
        let (kind, flags) = (head[3], head[4]);
        let answer = match kind {
            H2_SETTINGS if flags & H2_ACK == 0 => Some(h2_frame(H2_SETTINGS, H2_ACK, &[])),
            H2_PING if flags & H2_ACK == 0 => Some(h2_frame(H2_PING, H2_ACK, &payload)),
            _ => None,
        };
        if let Some(answer) = answer {
            // The sidecar may already have closed: the pinger reports that.
            let _ = send(&answer);
        }
        goaway |= kind == H2_GOAWAY;
        if kind == H2_SETTINGS && !signalled {
            sidecar.proc.signal("TERM");
            signalled = true;
        }
    };
    // A caller keeps talking for a moment after the end of the stream, as a
    // busy one does before it notices.
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Release);
    let write_error = pinger.join().expect("pinger");
    drop(reader);
    assert!(goaway, "the sidecar said GOAWAY before closing");
    assert_eq!(
        ended,
        ErrorKind::UnexpectedEof,
        "the connection ended with a clean close"
    );
    assert_eq!(write_error, None, "the caller's writes never met a reset");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
}

/// A call streaming from an engine whose connection went silent (a partition,
/// a stuck middlebox) ends within the keepalive window of the request plane's
/// own engine connection: UNAVAILABLE, retryable, while the worker serves on.
/// The engine is an OpenEngine server without a health service: liveness is
/// unwatched, its connection is not followed (its instance id is its
/// identity), and the stale-load window is 120 s, so only that keepalive can
/// end the call; without it the call would hang as long as the silence.
#[test]
fn a_call_on_a_silent_engine_connection_fails_within_the_keepalive_window() {
    use tokio_stream::StreamExt;
    let dir = TempDir::new("rp-keepalive");
    let mock = Mock::start(
        &dir.0,
        free_addr(),
        &[
            "--kind",
            "openengine",
            "--no-health",
            "--token-delay",
            "50ms",
        ],
    );
    let relay = crate::support::relay::Relay::start(mock.grpc);
    let mut sidecar = Sidecar::start(&dir.0, relay.addr, KEEPALIVE_ONLY);
    sidecar.wait_serving();
    sidecar
        .proc
        .wait_for_line("does not serve grpc.health.v1", HANG);
    let (status, silent_for) = rt().block_on(async {
        let channel = llm_sidecar_loadgen::connect(&sidecar.listen.to_string())
            .await
            .expect("connect");
        let mut stream = llm_sidecar_loadgen::generate::generate(
            llm_sidecar_io::engine::EngineKind::OpenEngine,
            channel,
            "on-silence".into(),
            4,
            100_000,
        )
        .await
        .expect("start");
        stream.next().await.expect("a chunk").expect("a chunk");
        relay.set_silent(true);
        let silenced = Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match stream.next().await {
                    Some(Ok(_)) => {}
                    None => panic!("the call ended OK on a silent engine"),
                    Some(Err(status)) => return status,
                }
            }
        })
        .await
        .expect("the call ended; it hung on the silent connection");
        (ended, silenced.elapsed())
    });
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().starts_with("engine stream failed: "),
        "{status:?}"
    );
    assert!(
        silent_for < Duration::from_secs(11 + 2 + 10),
        "within interval + timeout (+ slack), far below the 120 s stale-load window: {silent_for:?}"
    );
    relay.set_silent(false);
    assert_eq!(
        sidecar.state()["state"],
        "Serving",
        "a failed call is no loss"
    );
    assert_eq!(
        sidecar.metric("llm_sidecar_calls_total{outcome=\"engine_failed\"}"),
        Some(1.0)
    );
    sidecar.proc.stop_cleanly();
}

/// One gRPC Generate on a raw HTTP/2 client stream: the request sent, the
/// response's headers and body handle back.
async fn raw_generate(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    target: std::net::SocketAddr,
    req: GenerateRequest,
) -> h2::RecvStream {
    use prost::Message;
    let request = crate::support::raw_h2::generate_request_head(target);
    let message = req.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(&message);
    let (response, mut body) = client
        .clone()
        .ready()
        .await
        .expect("ready")
        .send_request(request, false)
        .expect("send");
    body.send_data(bytes::Bytes::from(framed), true)
        .expect("send the request message");
    response.await.expect("response headers").into_body()
}

/// A caller that stops reading one stream holds up that stream only: the
/// sidecar stops pulling its tokens from the engine once the caller's window
/// is full (so what it holds for that stream stays bounded while the engine
/// could send a million tokens), while another call on the same caller
/// connection, and a call on another connection, run to the end. (The calls
/// of a connection run in its task, and all calls share the engine
/// connection: a stalled one must block neither.) Once the caller gives the
/// stalled stream up, the engine sees its reset.
#[test]
fn a_stream_its_caller_stops_reading_holds_up_no_other_call() {
    let dir = TempDir::new("stalled-stream");
    let (mock, mut sidecar) = serving(&dir.0, &[], &[]);
    let target = sidecar.listen;
    rt().block_on(async {
        let tcp = tokio::net::TcpStream::connect(target)
            .await
            .expect("connect");
        // 1 KiB per stream: the stalled stream's window is full after a few
        // dozen tokens.
        let (mut caller, connection) = h2::client::Builder::new()
            .initial_window_size(1024)
            .handshake::<_, bytes::Bytes>(tcp)
            .await
            .expect("h2 handshake");
        tokio::spawn(connection);
        // A million tokens at the engine's full speed (some 25 MB), never read.
        let rss_before = rss_kib(sidecar.proc.pid());
        let stalled = raw_generate(&mut caller, target, generate("stalled", 4, 1_000_000)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let grew = rss_kib(sidecar.proc.pid()).saturating_sub(rss_before);
        assert!(
            grew < 8 * 1024,
            "the sidecar holds a window's worth for the stalled stream, not the engine's \
             output: RSS grew by {grew} KiB"
        );
        // Another stream on the same connection, read to its end.
        let mut neighbour =
            raw_generate(&mut caller, target, generate("neighbour", 4, 2_000)).await;
        let read_all = async {
            let mut bytes = 0;
            while let Some(data) = neighbour.data().await {
                let data = data.expect("neighbour's data");
                bytes += data.len();
                let _ = neighbour.flow_control().release_capacity(data.len());
            }
            let trailers = neighbour.trailers().await.expect("trailers");
            (bytes, trailers)
        };
        let (bytes, trailers) = tokio::time::timeout(Duration::from_secs(30), read_all)
            .await
            .expect("the neighbour ran to its end beside the stalled stream");
        assert_eq!(
            trailers.as_ref().and_then(|t| t.get("grpc-status")),
            Some(&http::HeaderValue::from_static("0")),
            "{trailers:?}"
        );
        assert!(bytes > 2_000, "2,000 tokens came: {bytes} bytes");
        // A call on another connection.
        let other = tokio::time::timeout(
            Duration::from_secs(30),
            run_generate(client(target).await, generate("other", 4, 2_000)),
        )
        .await
        .expect("a call on another connection ran to its end");
        assert_eq!(other.end, Ok(()));
        assert_eq!(other.streamed.len(), 2_000);
        drop(stalled);
    });
    wait_for_engine_reset(&mock, "stalled");
    sidecar.proc.stop_cleanly();
}

/// The names of a process's threads, from /proc.
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the sidecar's threads")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_string())
        .collect()
}

/// Two calls at once on two caller connections, through a sidecar with
/// `threads` request-plane threads: both answered whole; returns how many
/// engine connections they took and the sidecar's thread names.
fn two_connections_at_once(threads: &str) -> (u64, Vec<String>) {
    let dir = TempDir::new("threads");
    let (mock, mut sidecar) = serving(
        &dir.0,
        &["--token-delay", "50ms"],
        &["--worker-threads", threads],
    );
    let listen = sidecar.listen;
    let before = mock.stats()["connections"].as_u64().expect("connections");
    let outcomes = rt().block_on(async {
        let (a, b) = tokio::join!(client(listen), client(listen));
        tokio::join!(
            run_generate(a, generate("on-one", 4, 20)),
            run_generate(b, generate("on-another", 4, 20)),
        )
    });
    for outcome in [outcomes.0, outcomes.1] {
        assert_eq!(outcome.end, Ok(()), "answered");
        assert_eq!(outcome.streamed.len(), 20, "every token");
    }
    let engine_connections = mock.stats()["connections"].as_u64().expect("connections") - before;
    let names = thread_names(sidecar.proc.pid());
    sidecar.proc.stop_cleanly();
    (engine_connections, names)
}

/// `--worker-threads 2`: a second request-plane thread, named so in `top -H`;
/// the two callers' connections go one to each thread, and each thread opens
/// an engine connection of its own, so a token is read and passed on by one
/// thread. With one thread, both calls share one engine connection.
#[test]
fn each_request_plane_thread_serves_its_callers_on_its_own_engine_connection() {
    let (connections, names) = two_connections_at_once("2");
    assert!(
        names.iter().any(|n| n == "request-plane-1"),
        "a second thread: {names:?}"
    );
    assert_eq!(connections, 2, "an engine connection per thread");
    let (connections, names) = two_connections_at_once("1");
    assert!(
        !names.iter().any(|n| n.starts_with("request-plane")),
        "one thread: {names:?}"
    );
    assert_eq!(connections, 1, "one thread, one engine connection");
}

/// `--worker-threads auto`: one request-plane thread per CPU the process may
/// use, at most four. Pinned to one CPU (`taskset`, as a cgroup's cpuset or
/// an operator would), the sidecar runs on one thread; unpinned, on as many
/// as the CPUs this test may use; with no flag, on one.
#[test]
fn request_plane_threads_follow_the_cpus_the_process_may_use() {
    use std::os::unix::fs::PermissionsExt;
    // Starts the sidecar, counts its request-plane threads once it serves,
    // and stops it.
    let threads_of = |mut sidecar: Sidecar| {
        sidecar.wait_serving();
        let threads = thread_names(sidecar.proc.pid())
            .iter()
            .filter(|n| n.starts_with("request-plane-"))
            .count();
        sidecar.proc.stop_cleanly();
        threads
    };
    let dir = TempDir::new("threads-pinned");
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let pinned = dir.0.join("pinned.sh");
    std::fs::write(
        &pinned,
        format!("#!/bin/sh\nexec taskset -c 0 {} \"$@\"\n", binary()),
    )
    .expect("write the wrapper");
    std::fs::set_permissions(&pinned, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let pinned = Sidecar::start_program(
        pinned.to_str().expect("a UTF-8 path"),
        &dir.0,
        mock.grpc,
        &["--worker-threads", "auto"],
    );
    assert_eq!(threads_of(pinned), 0, "one CPU: the driver's thread alone");

    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let free = TempDir::new("threads-free");
    assert_eq!(
        threads_of(Sidecar::start(
            &free.0,
            mock.grpc,
            &["--worker-threads", "auto"]
        )),
        cpus.min(4) - 1,
        "{cpus} CPUs: one thread each, at most four, the driver's among them"
    );

    let default = TempDir::new("threads-default");
    assert_eq!(
        threads_of(Sidecar::start(&default.0, mock.grpc, &[])),
        0,
        "no flag: one thread"
    );
}
