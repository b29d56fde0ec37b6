//! `llm-sidecar mock-engine`: the CPU-only fake engine, for tests and demos.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use crate::runtime::{runtime, shutdown_signals};
use crate::shared::{Exit, LogFormat, duration, engine_kind};

/// Flags of `llm-sidecar mock-engine`.
#[derive(Debug, Args)]
pub struct MockArgs {
    /// Which engine API to serve, with that engine's health behaviour:
    /// trtllm (trtllm.TrtllmService), openengine (openengine.v1.Inference and
    /// Control, TensorRT-LLM's OpenEngine server), vllm
    /// (vllm.grpc.engine.VllmEngine), sglang (sglang.grpc.scheduler.SglangScheduler),
    /// vllm-native (vllm.Inference and vllm.Control, vLLM's Rust frontend),
    /// sglang-native (sglang.runtime.v1.SglangService, SGLang's --grpc-port server).
    #[arg(long, default_value = "trtllm", value_parser = engine_kind)]
    pub kind: llm_sidecar_io::engine::EngineKind,
    /// The OpenEngine server's engine_name (TensorRT-LLM's is tensorrt_llm).
    #[arg(long, default_value = "tensorrt_llm")]
    pub engine_name: String,
    /// Answer NOT_SERVING for this long after the port opened, then SERVING
    /// (SGLang's and vLLM's warm-up).
    #[arg(long, default_value = "0ms", value_parser = duration)]
    pub warmup: Duration,
    /// Serve none of the engine APIs (only grpc.health.v1): a gRPC server
    /// that is not an engine llm-sidecar follows.
    #[arg(long)]
    pub no_engine_api: bool,
    /// Keep the gRPC port closed for this long after start (TensorRT-LLM and
    /// vLLM bind only once their model loaded).
    #[arg(long, default_value = "0ms", value_parser = duration)]
    pub load_delay: Duration,
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Control HTTP listen address (see the mock's control paths in the docs).
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub control_listen: SocketAddr,
    /// Model id reported by GetModelInfo.
    #[arg(long, default_value = "mock/llama-3-8b-instruct")]
    pub model_id: String,
    /// Version reported by GetServerInfo.
    #[arg(long, default_value = "1.0.0-mock")]
    pub engine_version: String,
    /// Backend reported by GetServerInfo.
    #[arg(long, default_value = "pytorch")]
    pub backend: String,
    /// Max input length reported by GetModelInfo.
    #[arg(long, default_value_t = 4096)]
    pub max_input_len: i32,
    /// Max sequence length reported by GetModelInfo.
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: i32,
    /// Delay before each generated token.
    #[arg(long, default_value = "0ms", value_parser = duration)]
    pub token_delay: Duration,
    /// How long each Generate stream stays open after its final message
    /// before it ends (a real engine's trailers follow its last output).
    #[arg(long, default_value = "0ms", value_parser = duration)]
    pub end_delay: Duration,
    /// Tokens follow from the prompt alone, not the request id (so a test
    /// can say in advance what a request through another front end gets).
    #[arg(long)]
    pub seed_by_prompt: bool,
    /// Serve no grpc.health.v1 at all (like an OpenEngine server before
    /// TensorRT-LLM #20437); with `--kind sglang-native`, no WatchEngineState
    /// (a native server older than it, with HealthCheck alone).
    #[arg(long, conflicts_with = "liveness_unregistered")]
    pub no_health: bool,
    /// Serve grpc.health.v1 without the liveness service until the control endpoint sets it.
    #[arg(long)]
    pub liveness_unregistered: bool,
    /// Hold back the first message of every health Watch until the control
    /// endpoint releases it (`/watch/hold?on=false`).
    #[arg(long)]
    pub hold_watch: bool,
    /// Answer a health Watch on an unregistered service with NOT_FOUND (as
    /// tonic-health does) instead of SERVICE_UNKNOWN (as grpcio does).
    #[arg(long)]
    pub watch_unknown_not_found: bool,
    /// Streams the gRPC server allows per connection (HTTP/2 SETTINGS); none:
    /// unlimited.
    #[arg(long)]
    pub max_concurrent_streams: Option<u32>,
    /// Append one line per Generate event (`seen`, `done`, `error`, `cancelled`,
    /// `aborted`, then the request id) to this file: the engine's side of a call
    /// account that survives the mock being killed.
    #[arg(long)]
    pub journal: Option<std::path::PathBuf>,
    /// The kind's load RPC (OpenEngine GetLoad, vLLM and SGLang GetLoads)
    /// answers UNIMPLEMENTED, as servicers older than it do (control
    /// `/getload?mode=ok` serves it again).
    #[arg(long)]
    pub load_unimplemented: bool,
    /// GetServerInfo answers UNIMPLEMENTED, as servers older than it do.
    #[arg(long)]
    pub server_info_unimplemented: bool,
    /// Where the OpenEngine kind publishes its KV-cache events (a ZMQ PUB
    /// socket, advertised by Control.GetKvEventSources; port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0", conflicts_with = "no_kv_events")]
    pub kv_events_listen: SocketAddr,
    /// How often the KV event publisher sends an empty batch (advertised in
    /// GetServerInfo's extra as kv_event_heartbeat_interval_ms).
    #[arg(long, default_value = "1s", value_parser = duration)]
    pub kv_event_heartbeat: Duration,
    /// Publish no KV events: GetKvEventSources answers UNIMPLEMENTED, as
    /// TensorRT-LLM's older OpenEngine servers do.
    #[arg(long)]
    pub no_kv_events: bool,
    /// Log format (stderr).
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// `llm-sidecar mock-engine`.
pub fn run(args: MockArgs) -> Exit {
    use llm_sidecar_mock_engine::{HealthMode, MockConfig};
    let config = MockConfig {
        listen: args.listen,
        control_listen: args.control_listen,
        model_id: args.model_id,
        version: args.engine_version,
        backend: args.backend,
        max_input_len: args.max_input_len,
        max_seq_len: args.max_seq_len,
        token_delay: args.token_delay,
        end_delay: args.end_delay,
        seed_by_prompt: args.seed_by_prompt,
        journal: args.journal,
        hold_watch: args.hold_watch,
        watch_unknown_not_found: args.watch_unknown_not_found,
        max_concurrent_streams: args.max_concurrent_streams,
        kind: args.kind,
        engine_name: args.engine_name,
        warmup: args.warmup,
        load_delay: args.load_delay,
        no_engine_api: args.no_engine_api,
        load_unimplemented: args.load_unimplemented,
        server_info_unimplemented: args.server_info_unimplemented,
        kv_events_listen: (!args.no_kv_events).then_some(args.kv_events_listen),
        kv_event_heartbeat: args.kv_event_heartbeat,
        health: if args.no_health {
            HealthMode::Absent
        } else if args.liveness_unregistered {
            HealthMode::LivenessUnregistered
        } else {
            HealthMode::Full
        },
    };
    runtime(None).block_on(async move {
        let mut signals = shutdown_signals();
        let shutdown = async move {
            signals.recv().await;
        };
        match llm_sidecar_mock_engine::run(config, shutdown).await {
            Ok(()) => Exit::SUCCESS,
            Err(e) => {
                tracing::error!("{e}");
                Exit::Usage
            }
        }
    })
}
