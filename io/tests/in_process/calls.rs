//! Calls through the request plane as callers see them, run in-process.
//! Each test here was a process test in `bin/tests/process/request_plane.rs`
//! of the same name and asserts what it asserted there.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use llm_sidecar_engine_api::trtllm::{GetModelInfoRequest, HealthCheckRequest};
use llm_sidecar_testkit::trtllm::{client, generate, run_generate};
use tonic::Code;
use tonic::transport::Channel;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_through_the_sidecar_are_what_the_engine_sends() {
    let (engine, worker) = serving(|_| {}, |_| {}).await;
    let direct = run_generate(client(engine.grpc).await, generate("same-1", 8, 64)).await;
    let proxied = run_generate(client(worker.listen).await, generate("same-1", 8, 64)).await;
    assert_eq!(direct.streamed.len(), 64);
    assert_eq!(proxied, direct, "the same tokens and the same end");
    assert_eq!(proxied.complete, proxied.streamed);

    let d = client(engine.grpc)
        .await
        .get_model_info(GetModelInfoRequest {})
        .await
        .expect("direct unary")
        .into_inner();
    let p = client(worker.listen)
        .await
        .get_model_info(GetModelInfoRequest {})
        .await
        .expect("proxied unary")
        .into_inner();
    assert_eq!(p, d);

    // An engine error passes unchanged: code, message and trailing metadata.
    let err_id = "error:9:model is busy";
    let d = client(engine.grpc)
        .await
        .generate(generate(err_id, 1, 1))
        .await
        .expect_err("direct error");
    let p = client(worker.listen)
        .await
        .generate(generate(err_id, 1, 1))
        .await
        .expect_err("proxied error");
    assert_eq!(
        (p.code(), p.message()),
        (Code::FailedPrecondition, "model is busy")
    );
    assert_eq!((p.code(), p.message()), (d.code(), d.message()));
    assert_eq!(
        p.metadata().get("x-engine-error"),
        d.metadata().get("x-engine-error")
    );
    assert!(p.metadata().get("x-engine-error").is_some());
    worker.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_timeout_is_enforced_by_the_sidecar_and_resets_the_engine_stream() {
    let (engine, worker) = serving(|e| e.token_delay = Duration::from_millis(50), |_| {}).await;
    let mut c = client(worker.listen).await;
    let mut request = tonic::Request::new(generate("slow", 4, 1000));
    request.set_timeout(Duration::from_millis(400));
    let started = Instant::now();
    let outcome = async {
        let mut stream = c.generate(request).await?.into_inner();
        while stream.message().await?.is_some() {}
        Ok::<(), tonic::Status>(())
    }
    .await;
    let status = outcome.expect_err("the call outlives its grpc-timeout");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // The mock engine enforces no deadline itself: the reset it saw came from the sidecar.
    engine.wait_for_reset("slow").await;
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"deadline_exceeded\"}")
            .await,
        Some(1.0)
    );
    worker.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_cancel_resets_the_engine_stream_at_once() {
    let (engine, worker) = serving(|e| e.token_delay = Duration::from_millis(50), |_| {}).await;
    let mut c = client(worker.listen).await;
    let mut stream = c
        .generate(generate("cancel-me", 4, 1000))
        .await
        .expect("start")
        .into_inner();
    for _ in 0..3 {
        stream.message().await.expect("chunk").expect("a chunk");
    }
    assert_eq!(worker.metric("llm_sidecar_in_flight").await, Some(1.0));
    drop(stream);
    // Unreset, the engine would stream for 50 s more: the bounded wait
    // tells the two apart without timing the reset itself.
    engine.wait_for_reset("cancel-me").await;
    wait_until(HANG, "in flight back to 0", || async {
        worker.metric("llm_sidecar_in_flight").await == Some(0.0)
    })
    .await;
    assert_eq!(
        worker
            .metric("llm_sidecar_calls_total{outcome=\"cancelled_by_caller\"}")
            .await,
        Some(1.0)
    );
    worker.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_fails_only_its_own_connection_or_call() {
    let (engine, worker) = serving(
        |e| e.token_delay = Duration::from_millis(10),
        |w| w.limits.max_message_bytes = 1024,
    )
    .await;
    let good = tokio::spawn(run_generate(
        client(worker.listen).await,
        generate("good", 4, 200),
    ));
    // Garbage bytes and an HTTP/1 request: the connection is closed.
    for junk in [
        &b"\x00\x01garbage that is not HTTP/2\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        let addr = worker.listen;
        let junk = junk.to_vec();
        let closed = tokio::task::spawn_blocking(move || {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            s.write_all(&junk).expect("write");
            let mut buf = Vec::new();
            // A clean close or a reset both end the connection; only a timeout does not.
            match s.read_to_end(&mut buf) {
                Ok(_) => true,
                Err(e) => !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
            }
        })
        .await
        .expect("join");
        assert!(
            closed,
            "the sidecar closes a connection that does not speak HTTP/2"
        );
    }
    // An unknown method passes through and fails as the engine says.
    let channel = Channel::from_shared(format!("http://{}", worker.listen))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let path = http::uri::PathAndQuery::from_static("/trtllm.TrtllmService/NoSuchMethod");
    let codec: tonic_prost::ProstCodec<HealthCheckRequest, HealthCheckRequest> =
        tonic_prost::ProstCodec::default();
    let err = grpc
        .unary(tonic::Request::new(HealthCheckRequest {}), path, codec)
        .await
        .expect_err("unknown method");
    assert_eq!(err.code(), Code::Unimplemented);
    // A message over the limit fails that call only.
    let big = run_generate(client(worker.listen).await, generate("too-big", 2000, 1)).await;
    assert_eq!(
        big.end.as_ref().map_err(|e| e.0),
        Err(Code::ResourceExhausted),
        "{:?}",
        big.end
    );
    let good = good.await.expect("join");
    assert_eq!(good.end, Ok(()), "the concurrent good call completes");
    assert_eq!(good.streamed.len(), 200);
    assert!(
        !engine.stats().await["seen_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .any(|i| i == "too-big")
    );
    assert!(worker.running(), "bad input never takes the sidecar down");
    worker.stop_cleanly().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_stream_reaches_the_engine_whole_and_its_answer_comes_back() {
    use llm_sidecar_mock_engine::echo_api::EchoChunk;
    use llm_sidecar_mock_engine::echo_api::echo_client::EchoClient;
    let (_engine, worker) = serving(|_| {}, |_| {}).await;
    // 200 chunks of different sizes (up to 64 KiB), as the engine would checksum them.
    let chunks: Vec<Vec<u8>> = (0..200u32)
        .map(|i| (0..(i * 331) % 65_536).map(|b| (b * 7 + i) as u8).collect())
        .collect();
    let (bytes, checksum) = chunks.iter().flatten().fold((0u64, 0u64), |(n, c), b| {
        (n + 1, c.wrapping_mul(31).wrapping_add(u64::from(*b)))
    });
    let channel = llm_sidecar_loadgen::connect(&worker.listen.to_string())
        .await
        .expect("connect");
    let outbound = tokio_stream::iter(chunks.into_iter().map(|data| EchoChunk { data }));
    let summary = EchoClient::new(channel)
        .collect(outbound)
        .await
        .expect("the client-streaming call")
        .into_inner();
    assert_eq!(summary.chunks, 200);
    assert_eq!(summary.bytes, bytes);
    assert_eq!(summary.checksum, checksum, "every byte, in order");
    worker.stop_cleanly().await;
}
