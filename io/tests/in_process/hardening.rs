//! Hostile callers and engines whose attack fails that call alone, run
//! in-process. Each test here was a process test in
//! `bin/tests/process/hardening.rs` of the same name and asserts what it
//! asserted there.

use std::net::SocketAddr;
use std::time::Duration;

use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_engine_api::trtllm::{GenerateRequest, TokenizedInput};
use tonic::Code;

use crate::harness::*;

fn generate(id: &str, tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_string(),
        tokenized: Some(TokenizedInput {
            original_text: String::new(),
            input_token_ids: vec![1, 2, 3],
        }),
        max_tokens: tokens,
        streaming: true,
    }
}

/// The HEADERS of a trtllm `Generate` call to `target`, for a test driving
/// the h2 crate's client by hand (its body is the test's to send).
fn generate_request_head(target: SocketAddr) -> http::Request<()> {
    http::Request::post(format!("http://{target}/trtllm.TrtllmService/Generate"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request")
}

/// One trtllm Generate of `tokens` tokens through `target`, on a connection
/// of its own, as the load generator sends it: the messages streamed (the
/// tokens and the final one).
async fn generate_through(
    target: SocketAddr,
    id: &str,
    tokens: u32,
) -> Result<usize, tonic::Status> {
    use tokio_stream::StreamExt;
    let channel = llm_sidecar_loadgen::connect(&target.to_string())
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut pieces = llm_sidecar_loadgen::generate::generate(
        llm_sidecar_io::engine::EngineKind::Trtllm,
        channel,
        id.to_string(),
        8,
        tokens,
    )
    .await?;
    let mut n = 0;
    while let Some(piece) = pieces.next().await {
        piece?;
        n += 1;
    }
    Ok(n)
}

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
        let mut stream = long.generate(generate("long", 100)).await?.into_inner();
        let mut n = 0;
        while stream.message().await?.is_some() {
            n += 1;
        }
        Ok::<_, tonic::Status>(n)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut big = TrtllmServiceClient::new(channel);
    let failed = big
        .generate(generate("big-headers:100000", 4))
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
        let tcp = tokio::net::TcpStream::connect(target)
            .await
            .expect("connect");
        let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(connection);
        for _ in 0..half {
            let Ok(client) =
                tokio::time::timeout(Duration::from_millis(500), client.clone().ready()).await
            else {
                break;
            };
            let Ok(mut client) = client else { break };
            let request = generate_request_head(target);
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
    let tcp = tokio::net::TcpStream::connect(target)
        .await
        .expect("connect");
    let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    let mut client = client.ready().await.expect("ready");
    let request = generate_request_head(target);
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
