//! Hostile callers and engines whose attack fails that call alone, run
//! in-process. Each test here was a process test in
//! `bin/tests/process/hardening.rs` of the same name and asserts what it
//! asserted there.

use std::net::SocketAddr;
use std::time::Duration;

use llm_sidecar_engine_api::trtllm::GetModelInfoRequest;
use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_testkit::raw_h2::{self, RawH2};
use llm_sidecar_testkit::trtllm::{generate, generate_through};
use tonic::Code;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_answer_with_oversized_headers_fails_that_call_only() {
    let (_engine, worker) = serving(|e| e.token_delay = Duration::from_millis(20), |_| {}).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", worker.listen))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut long = TrtllmServiceClient::new(channel.clone());
    let long = tokio::spawn(async move {
        let mut stream = long.generate(generate("long", 3, 100)).await?.into_inner();
        let mut n = 0;
        while stream.message().await?.is_some() {
            n += 1;
        }
        Ok::<_, tonic::Status>(n)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut big = TrtllmServiceClient::new(channel);
    let failed = big
        .generate(generate("big-headers:100000", 3, 4))
        .await
        .expect_err("the oversized answer fails");
    assert_eq!(failed.code(), Code::ResourceExhausted, "{failed:?}");
    assert!(
        failed.message().contains("engine response headers larger"),
        "{failed:?}"
    );
    let done = long.await.expect("join").expect("the other call completes");
    assert_eq!(done, 101, "100 tokens and the final message");
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"too_large\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"engine_failed\"}")
            .await,
        Some(0.0)
    );
    worker.stop_cleanly().await;
}

/// Attack 6 of hardening round three: calls that send HEADERS and nothing
/// more (the request never begins) on two connections, as many as the
/// sidecar lets each take, with the engine's stream limit such that they
/// would hold every engine stream. An engine stream opens only once a
/// request has begun: another caller's call is answered at once, and the
/// half-open calls are answered DEADLINE_EXCEEDED after 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_calls_hold_no_engine_stream_and_end_after_the_start_wait() {
    let (engine, worker) = serving(|e| e.max_concurrent_streams = Some(20), |_| {}).await;
    let target = worker.listen;
    // As many as the sidecar lets one connection hold: half of the 80
    // streams the engine takes through 4 connections.
    let half = 40;
    let mut held = Vec::new();
    for _ in 0..2 {
        let client = h2_client(target).await;
        for _ in 0..half {
            let Ok(client) =
                tokio::time::timeout(Duration::from_millis(500), client.clone().ready()).await
            else {
                break;
            };
            let Ok(mut client) = client else { break };
            let request = raw_h2::generate_request_head(target);
            let (answer, body) = client.send_request(request, false).expect("send");
            held.push((answer, body));
        }
    }
    assert!(
        held.len() >= half,
        "the half-open calls were taken: {}",
        held.len()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another caller, beside them.
    let victim = tokio::time::timeout(
        Duration::from_secs(5),
        generate_through(target, "beside-half-open", 8),
    )
    .await;
    assert!(
        matches!(victim, Ok(Ok(9))),
        "the other caller's call beside {} half-open calls: {victim:?}",
        held.len()
    );
    let (first, _body) = held.swap_remove(0);
    let answer = tokio::time::timeout(Duration::from_secs(15), first)
        .await
        .expect("answered within the start wait")
        .expect("response headers");
    assert_eq!(answer.headers()["grpc-status"], "4", "DEADLINE_EXCEEDED");
    assert_eq!(
        engine.stats().await["generate_started"].as_u64(),
        Some(1),
        "the engine saw only the well-behaved call"
    );
    drop(held);
    worker.stop_cleanly().await;
}

/// Attack 6 again, one step further: calls that send HEADERS and the start of
/// a message (its prefix declares 100 bytes, 10 come), then nothing. The
/// engine stream opens with the first DATA and the engine waits for the rest
/// of the message; it must not wait for ever. The call is answered
/// DEADLINE_EXCEEDED once the message has not arrived whole within 10 s, and
/// its engine stream is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_message_stalled_half_sent_ends_after_the_arrival_wait() {
    let (engine, worker) = serving(|_| {}, |_| {}).await;
    let target = worker.listen;
    let client = h2_client(target).await;
    let mut client = client.ready().await.expect("ready");
    let request = raw_h2::generate_request_head(target);
    let (answer, mut body) = client.send_request(request, false).expect("send");
    let mut start = vec![0u8, 0, 0, 0, 100];
    start.extend([7u8; 10]);
    body.send_data(bytes::Bytes::from(start), false)
        .expect("the message's start");
    let answer = tokio::time::timeout(Duration::from_secs(30), answer)
        .await
        .expect("answered within the arrival wait")
        .expect("response headers");
    assert_eq!(answer.headers()["grpc-status"], "4", "DEADLINE_EXCEEDED");
    let message = answer.headers()["grpc-message"]
        .to_str()
        .unwrap_or_default();
    assert!(message.contains("did%20not%20arrive%20whole"), "{message}");
    // The engine took the stream (the message had begun) and lets it go.
    wait_until(HANG, "the engine's stream let go", || async {
        engine.stats().await["cancelled_ids"]
            .as_array()
            .is_some_and(|ids| !ids.is_empty())
            || worker
                .metric("llm_sidecar_engine_streams_reset_unanswered")
                .await
                == Some(1.0)
    })
    .await;
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"deadline_exceeded\"}")
            .await,
        Some(1.0)
    );
    drop(body);
    worker.stop_cleanly().await;
}

/// An HTTP/2 client connection to `target` (the h2 crate's, driven by a task
/// of its own), for calls no gRPC library makes.
async fn h2_client(target: SocketAddr) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(target)
        .await
        .expect("connect");
    let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    client
}

/// `work` with a hand-written HTTP/2 caller, off the runtime's threads (its
/// socket blocks).
async fn raw<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work)
        .await
        .expect("the raw caller ran")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_sends_the_preface_is_closed() {
    // Idle connections are left alone here: only the handshake timeout can
    // close this one.
    let (_engine, worker) = serving(
        |_| {},
        |w| {
            w.limits.handshake_timeout = Duration::from_secs(1);
            w.limits.idle_timeout = Duration::from_secs(3600);
        },
    )
    .await;
    // Connected, and never a byte: closed once the handshake timeout passed
    // (the 30 s read timeout of the test caller would say "not closed").
    let listen = worker.listen;
    let (frames, ended) = raw(move || RawH2::connect(listen).read_to_end()).await;
    assert!(ended, "the silent connection was closed");
    assert!(
        frames.iter().all(|f| f.kind == raw_h2::SETTINGS),
        "nothing but the server's own SETTINGS: {frames:?}"
    );
    worker.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_calls_is_sent_goaway_after_the_idle_timeout() {
    let (_engine, worker) =
        serving(|_| {}, |w| w.limits.idle_timeout = Duration::from_secs(2)).await;
    let listen = worker.listen;
    let (frames, ended) = raw(move || {
        let mut idle = RawH2::connect(listen);
        idle.handshake();
        idle.read_to_end()
    })
    .await;
    assert!(ended, "the idle connection was closed");
    assert!(
        frames.iter().any(|f| f.goaway_code() == Some(0)),
        "with a GOAWAY (NO_ERROR) first: {frames:?}"
    );
    worker.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_and_the_rest_still_serve() {
    let (_engine, worker) = serving(|_| {}, |w| w.limits.max_connections = 3).await;
    let listen = worker.listen;
    let mut held: Vec<RawH2> = raw(move || {
        (0..3)
            .map(|_| {
                let mut c = RawH2::connect(listen);
                c.handshake();
                c
            })
            .collect()
    })
    .await;
    wait_until(HANG, "three caller connections", || async {
        worker.metric("llm_sidecar_caller_connections ").await == Some(3.0)
    })
    .await;
    let (frames, ended) = raw(move || RawH2::connect(listen).read_to_end()).await;
    assert!(ended && frames.is_empty(), "the fourth is closed at once");
    assert_eq!(
        worker
            .metric("llm_sidecar_caller_connections_refused_total")
            .await,
        Some(1.0)
    );
    assert_eq!(worker.admin_status("/live").await, Some(200));
    held.pop();
    wait_until(HANG, "a free connection slot", || async {
        worker.metric("llm_sidecar_caller_connections ").await == Some(2.0)
    })
    .await;
    let mut client = TrtllmServiceClient::connect(format!("http://{listen}"))
        .await
        .expect("connect");
    let answered = client.get_model_info(GetModelInfoRequest {}).await;
    assert!(answered.is_ok(), "{answered:?}");
    drop(held);
    worker.stop_cleanly().await;
}

/// Opens `n` `grpc.health.v1.Health/Watch` streams on one new connection to
/// `target` and never sends their request messages (half-open): the answers'
/// futures, in order.
async fn half_open_watches(target: SocketAddr, n: usize) -> Vec<h2::client::ResponseFuture> {
    let client = h2_client(target).await;
    let mut answers = Vec::with_capacity(n);
    for _ in 0..n {
        let mut client = client.clone().ready().await.expect("ready");
        let request = http::Request::post(format!("http://{target}/grpc.health.v1.Health/Watch"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (answer, body) = client.send_request(request, false).expect("send");
        // The request's body stream is kept open, and never written.
        std::mem::forget(body);
        answers.push(answer);
    }
    answers
}

/// Attack 5 of hardening round three: half-open own-health Watch streams
/// (HEADERS, then nothing), many per connection, on several connections.
/// Each connection holds at most 16; the rest are refused RESOURCE_EXHAUSTED
/// at once and counted; the held ones are answered DEADLINE_EXCEEDED once
/// their request has not come for 5 s; a router's Check on another
/// connection is answered SERVING throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_own_health_watches_are_capped_per_connection_and_time_out() {
    let (_engine, worker) = serving(|_| {}, |_| {}).await;
    let target = worker.listen;
    let mut all = Vec::new();
    for _ in 0..4 {
        all.extend(half_open_watches(target, 40).await);
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        worker.metric("llm_sidecar_own_health_streams ").await,
        Some(64.0),
        "16 on each of the 4 connections"
    );
    // A router's Check on a connection of its own is answered at once.
    let channel = llm_sidecar_loadgen::connect(&target.to_string())
        .await
        .expect("connect to the request plane");
    let status = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("the sidecar's own health answers")
        .into_inner()
        .status;
    assert_eq!(status, 1, "SERVING");
    let mut codes = std::collections::BTreeMap::<String, usize>::new();
    for answer in all {
        let code = match tokio::time::timeout(Duration::from_secs(15), answer).await {
            Ok(Ok(response)) => response
                .headers()
                .get("grpc-status")
                .map_or("none".to_string(), |v| {
                    v.to_str().unwrap_or("?").to_string()
                }),
            Ok(Err(e)) => format!("error {e}"),
            Err(_) => "no answer in 15 s".to_string(),
        };
        *codes.entry(code).or_default() += 1;
    }
    assert_eq!(
        codes,
        [("4".to_string(), 64), ("8".to_string(), 96)].into(),
        "64 held then DEADLINE_EXCEEDED, 96 RESOURCE_EXHAUSTED"
    );
    assert_eq!(
        worker
            .metric("llm_sidecar_own_health_streams_refused_total")
            .await,
        Some(96.0)
    );
    assert_eq!(
        worker.metric("llm_sidecar_own_health_streams ").await,
        Some(0.0)
    );
    worker.stop_cleanly().await;
}

/// Attack 7 of hardening round three: on one connection, 1,200 calls each
/// starting a message whose length prefix is over the limit and sending on
/// after it. Each is answered RESOURCE_EXHAUSTED; what the caller sends after
/// the answer is read and dropped, so none of it makes h2 reset a stream on
/// its own account, and the connection is never sent GOAWAY (h2 sends
/// ENHANCE_YOUR_CALM past 1,024 such resets): a gateway multiplexing many
/// users on one connection is not cut by one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_ended_early_for_an_oversized_message_do_not_get_their_connection_cut() {
    const CALLS: u32 = 1_200;
    const WAVE: u32 = 40;
    let (_engine, worker) = serving(|_| {}, |_| {}).await;
    let listen = worker.listen;
    let (goaway, answered) = raw(move || {
        let mut raw = RawH2::connect(listen);
        raw.handshake();
        let block =
            raw_h2::grpc_headers_block(&listen.to_string(), "/trtllm.TrtllmService/Generate");
        // A length prefix of 2 GiB, then bytes of that message, then more.
        let mut start = vec![0u8, 0x7f, 0xff, 0xff, 0xff];
        start.extend_from_slice(&[7u8; 16]);
        let more = [9u8; 16];
        let mut answered = 0u32;
        let mut goaway = None;
        let mut next_stream = 1u32;
        for _ in 0..CALLS / WAVE {
            let mut out = Vec::new();
            let first = next_stream;
            for _ in 0..WAVE {
                out.extend(raw_h2::frame(raw_h2::HEADERS, 0x4, next_stream, &block));
                out.extend(raw_h2::frame(raw_h2::DATA, 0, next_stream, &start));
                out.extend(raw_h2::frame(raw_h2::DATA, 0, next_stream, &more));
                next_stream += 2;
            }
            raw.send(&out).expect("send a wave");
            // Each call's answer (HEADERS); then, on the streams still open,
            // more of the request, sent after the answer as a client that does
            // not stop at once would.
            let mut seen = 0;
            while seen < WAVE {
                let frame = raw.read_frame().expect("the sidecar answers");
                match frame.kind {
                    raw_h2::HEADERS if frame.stream >= first => seen += 1,
                    raw_h2::GOAWAY => {
                        goaway = frame.goaway_code();
                        break;
                    }
                    _ => {}
                }
            }
            if goaway.is_some() {
                break;
            }
            answered += seen;
            let mut after = Vec::new();
            for s in (first..next_stream).step_by(2) {
                after.extend(raw_h2::frame(raw_h2::DATA, 0, s, &more));
                after.extend(raw_h2::frame(raw_h2::DATA, raw_h2::END_STREAM, s, &more));
            }
            raw.send(&after).expect("send the rest");
        }
        (goaway, answered)
    })
    .await;
    assert_eq!(goaway, None, "GOAWAY after {answered} early-ended calls");
    assert_eq!(answered, CALLS);
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"too_large\"}")
            .await,
        Some(f64::from(CALLS))
    );
    worker.stop_cleanly().await;
}

/// Attack 2 of hardening round three: with no engine connection open yet,
/// thousands of calls each reset by the caller right after its HEADERS.
/// Opening an engine connection is not the reset call's: the first call
/// starts it, the calls after it wait for the same one, and a reset leaves it
/// opening. The engine accepts a handful of connections, not one per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_calls_do_not_open_an_engine_connection_each() {
    const CALLS: u32 = 3_000;
    let (engine, worker) = serving(|_| {}, |_| {}).await;
    let before = engine.stats().await["connections"]
        .as_u64()
        .expect("connections");
    let listen = worker.listen;
    let raw_caller = raw(move || {
        let mut raw = RawH2::connect(listen);
        raw.handshake();
        let block =
            raw_h2::grpc_headers_block(&listen.to_string(), "/trtllm.TrtllmService/Generate");
        let cancel = 8u32.to_be_bytes(); // RST_STREAM CANCEL
        let mut out = Vec::new();
        for n in 0..CALLS {
            let stream = 1 + 2 * n;
            out.extend(raw_h2::frame(raw_h2::HEADERS, 0x4, stream, &block));
            out.extend(raw_h2::frame(0x3, 0, stream, &cancel));
        }
        raw.send(&out).expect("send HEADERS and RST_STREAM pairs");
        raw
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = engine.stats().await["connections"]
        .as_u64()
        .expect("connections");
    assert!(
        after - before <= 4,
        "the engine accepted {} connections for {CALLS} reset calls",
        after - before
    );
    drop(raw_caller);
    worker.stop_cleanly().await;
}

/// Attack 9 of hardening round three: a request that is not a gRPC call
/// (`:method CONNECT`, which carries no `:path`; a GET; a POST to a path that
/// names no method) is answered INVALID_ARGUMENT, which no caller retries
/// elsewhere, counted as the caller's (`malformed`), never as the engine's
/// (`engine_unreachable` stays 0), and never reaches the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_without_path_is_the_callers_mistake_not_an_unreachable_engine() {
    let (engine, worker) = serving(|_| {}, |_| {}).await;
    let listen = worker.listen;
    let before = engine.stats().await["generate_started"].as_u64();
    let client = h2_client(listen).await;
    let requests = [
        http::Request::builder()
            .method("CONNECT")
            .uri(format!("{listen}"))
            .body(())
            .expect("a CONNECT"),
        http::Request::get(format!("http://{listen}/trtllm.TrtllmService/Generate"))
            .body(())
            .expect("a GET"),
        http::Request::post(format!("http://{listen}/"))
            .header("content-type", "application/grpc")
            .body(())
            .expect("a POST to /"),
    ];
    for request in requests {
        let what = format!("{} {}", request.method(), request.uri());
        let mut client = client.clone().ready().await.expect("ready");
        let (response, _body) = client.send_request(request, true).expect("send");
        let response = response.await.expect("response headers");
        assert_eq!(response.headers()["grpc-status"], "3", "{what}");
        let message = response.headers()["grpc-message"]
            .to_str()
            .expect("ascii")
            .replace("%20", " ");
        assert!(message.starts_with("not a gRPC call"), "{what}: {message}");
    }
    // The sidecar serves on.
    assert_eq!(
        generate_through(listen, "after-malformed", 4)
            .await
            .map_err(|s| s.code()),
        Ok(5),
        "4 tokens and the final message"
    );
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"malformed\"}")
            .await,
        Some(3.0)
    );
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"engine_unreachable\"}")
            .await,
        Some(0.0)
    );
    assert_eq!(
        engine.stats().await["generate_started"].as_u64(),
        before.map(|n| n + 1),
        "the engine saw only the one gRPC call"
    );
    worker.stop_cleanly().await;
}
