//! Dynamo's own conformance kit for engine implementations
//! (`dynamo-backend-common` 1.6.1, `testing::run_conformance`) run against
//! this worker's engine, the [`Bridge`], over the mock OpenEngine engine.
//!
//! The kit checks what Dynamo's `Worker` relies on: `start` names a model,
//! `kv_event_sources` and `setup_metrics` answer the same twice, one
//! `generate` streams chunks ending in exactly one terminal chunk whose
//! `completion_tokens` is the number of tokens streamed, eight interleaved
//! `generate`s all complete, a cancel is observed within 2 s with a
//! `Cancelled` terminal chunk, and `cleanup` succeeds twice and on a bridge
//! never started.
//!
//! The bridge is built as the worker builds it: its calls admitted through
//! llm-sidecar's gate (a driver that registered the worker in a file
//! registry and follows the engine), its capacity read from the engine's
//! `GetServerInfo` and checked, its KV event sources discovered from the
//! engine (the mock publishes events, so `kv_event_sources` lists one).

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use dynamo_backend_common::testing::run_conformance;
use llm_sidecar_io::discovery::FileDiscovery;
use llm_sidecar_io::engine::EngineKind;
use llm_sidecar_io::{Front, engine};
use llm_sidecar_loadgen::local::free_loopback_addr;
use llm_sidecar_mock_engine::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::args::Args;
use crate::bridge::Bridge;
use crate::load;
use crate::request::Served;

/// Generous: only stops a hang.
const HANG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_passes_dynamos_conformance_kit() {
    let engine_addr = free_loopback_addr().unwrap();
    // The mock's defaults (`llm-sidecar mock-engine --kind openengine`), a
    // token every millisecond: the kit's cancelled request (10,000 tokens)
    // cannot end by itself within the kit's 2 s.
    let mock = MockConfig {
        model_id: "mock-engine-model".into(),
        token_delay: Duration::from_millis(1),
        kind: EngineKind::OpenEngine,
        ..MockConfig::at(engine_addr, free_loopback_addr().unwrap())
    };
    let engine_stop = CancellationToken::new();
    let stopped = engine_stop.clone();
    let engine_task = tokio::spawn(llm_sidecar_mock_engine::run(mock, async move {
        stopped.cancelled().await
    }));

    let registry_dir = std::env::temp_dir().join(format!(
        "llm-sidecar-dynamo-conformance-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&registry_dir);
    let args = Args::try_parse_from([
        "llm-sidecar-dynamo",
        "--model-path",
        "served-model",
        "--grpc-endpoint",
        &engine_addr.to_string(),
        "--discovery-backend",
        "file",
        "--admin-listen",
        &free_loopback_addr().unwrap().to_string(),
    ])
    .expect("the flags parse");
    let settings = args.into_settings().expect("the flags are valid");
    let run = settings.run.clone();
    let channels = vec![
        engine::endpoint(&run.engine_endpoint, run.timings.engine_channel())
            .expect("the engine endpoint")
            .connect_lazy(),
    ];
    let (_signals, shutdown) = tokio::sync::mpsc::unbounded_channel();
    let started = llm_sidecar_io::start(
        run,
        Arc::new(FileDiscovery::new(
            &registry_dir,
            Duration::from_millis(100),
        )),
        Front::Hosted { instance_id: 1 },
        shutdown,
    )
    .await
    .expect("the driver starts");
    let calls = started.calls();
    tokio::spawn(started.drive());
    // Admission opens once the engine serves and the worker is registered.
    tokio::time::timeout(HANG, async {
        while calls.admit().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("admission opened");

    let (capacity, left_out) = load::read_capacity(channels[0].clone())
        .await
        .expect("GetServerInfo")
        .check()
        .expect("a capacity that registers");
    assert!(left_out.is_empty(), "{left_out:?}");
    assert!(
        capacity.kv_block_size.is_some(),
        "the mock reports its KV cache, so the kit's KV event check has a source to list"
    );
    let served = Served {
        name: "served-model".into(),
        engine_model: "mock-engine-model".into(),
        context_length: None,
    };
    let stop = CancellationToken::new();
    let kit = run_conformance(|| {
        Bridge::new(
            channels.clone(),
            calls.clone(),
            served.clone(),
            capacity,
            stop.clone(),
        )
    });
    let verdict = tokio::time::timeout(HANG, kit).await.expect("the kit ends");
    stop.cancel();
    engine_stop.cancel();
    let _ = tokio::time::timeout(HANG, engine_task).await;
    let _ = std::fs::remove_dir_all(&registry_dir);
    if let Err(failure) = verdict {
        panic!("Dynamo's conformance kit: {failure}");
    }
}
