//! A CPU-only fake engine for tests and demos, of any kind llm-sidecar follows.
//!
//! `--kind trtllm` serves `trtllm.TrtllmService`; `openengine` serves
//! `openengine.v1.Inference` and `Control` as TensorRT-LLM does; `vllm` and
//! `sglang` serve their engines' services as the smg servicers do. Every kind
//! generates deterministic token ids at a set pace and serves `grpc.health.v1`
//! with a health service of its own, shaped as the kind's real one: streaming
//! Watch for TensorRT-LLM (`""`, `liveness`, `inference`), one message then
//! the end for vLLM and SGLang (`""` and the engine's service), none for
//! SGLang's native server (its `HealthCheck` and `WatchEngineState`), warm-up
//! NOT_SERVING, a port that opens only once "the model loaded". A small HTTP
//! control endpoint changes its behaviour while it runs; see [`control`].

#![warn(missing_docs, unreachable_pub)]

mod control;
mod echo;
mod generate;
mod health;
mod kinds;
mod kv_events;

pub use llm_sidecar_io::engine::EngineKind;

/// The mock's client-streaming Echo service (generated).
pub mod echo_api {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("llm_sidecar.mock");
}

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use llm_sidecar_engine_api::openengine::control_server::ControlServer;
use llm_sidecar_engine_api::openengine::inference_server::InferenceServer;
use llm_sidecar_engine_api::sglang::sglang_scheduler_server::SglangSchedulerServer;
use llm_sidecar_engine_api::trtllm::trtllm_service_server::TrtllmServiceServer;
use llm_sidecar_engine_api::vllm::vllm_engine_server::VllmEngineServer;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

/// How the mock serves grpc.health.v1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthMode {
    /// `""`, `liveness` and `inference` registered, SERVING.
    Full,
    /// No grpc.health.v1 service at all (Watch answers UNIMPLEMENTED).
    Absent,
    /// Health served, but `liveness` not registered until the control endpoint sets it.
    LivenessUnregistered,
}

/// The mock's settings.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// gRPC listen address.
    pub listen: SocketAddr,
    /// Control HTTP listen address.
    pub control_listen: SocketAddr,
    /// Model id reported by GetModelInfo.
    pub model_id: String,
    /// Version reported by GetServerInfo.
    pub version: String,
    /// Backend reported by GetServerInfo.
    pub backend: String,
    /// Max input length reported by GetModelInfo.
    pub max_input_len: i32,
    /// Max sequence length reported by GetModelInfo.
    pub max_seq_len: i32,
    /// Delay before each generated token.
    pub token_delay: Duration,
    /// How long a Generate stream stays open after its final message before
    /// it ends (its trailers): a real engine's servicer ends the stream a
    /// scheduler step after the last output, not in the same write.
    pub end_delay: Duration,
    /// Tokens follow from the prompt alone, not the request id: a test that
    /// does not know the id its front end will give a request can say in
    /// advance what the engine will answer.
    pub seed_by_prompt: bool,
    /// How health is served.
    pub health: HealthMode,
    /// Where to append the Generate journal, if anywhere.
    pub journal: Option<std::path::PathBuf>,
    /// Hold back the first message of every Watch until the control endpoint
    /// releases it (`/watch/hold?on=false`): a liveness Watch that does not open.
    pub hold_watch: bool,
    /// A Watch on an unregistered service fails NOT_FOUND at once, as
    /// tonic-health's server does, instead of sending SERVICE_UNKNOWN.
    pub watch_unknown_not_found: bool,
    /// SETTINGS_MAX_CONCURRENT_STREAMS of the gRPC server (`None`: unlimited).
    pub max_concurrent_streams: Option<u32>,
    /// Which engine API it serves.
    pub kind: EngineKind,
    /// The OpenEngine `engine_name` (TensorRT-LLM's is `tensorrt_llm`).
    pub engine_name: String,
    /// How long health answers NOT_SERVING after the port opened (SGLang's
    /// and vLLM's warm-up).
    pub warmup: Duration,
    /// How long the gRPC port stays closed after start (the model loading).
    pub load_delay: Duration,
    /// Serve no engine API at all (only grpc.health.v1 and the Echo service):
    /// a gRPC server that is none of the engines.
    pub no_engine_api: bool,
    /// The kind's load RPC (GetLoad, GetLoads) answers UNIMPLEMENTED from the
    /// start, as servicers older than it do; `/getload?mode=` changes it.
    pub load_unimplemented: bool,
    /// GetServerInfo answers UNIMPLEMENTED, as servers older than it do.
    pub server_info_unimplemented: bool,
    /// Where the OpenEngine kind publishes its KV-cache events (ZMQ PUB;
    /// port 0 picks one); `None`: no events, and `GetKvEventSources`
    /// answers UNIMPLEMENTED, as TensorRT-LLM's older servers do.
    pub kv_events_listen: Option<SocketAddr>,
    /// How often the KV event publisher sends an empty batch.
    pub kv_event_heartbeat: Duration,
}

impl MockConfig {
    /// `llm-sidecar mock-engine`'s defaults (a TensorRT-LLM `trtllm` server
    /// with full health, tokens as fast as it can, KV events on a port of its
    /// own) on these two addresses: what an in-process test starts.
    pub fn at(listen: SocketAddr, control_listen: SocketAddr) -> MockConfig {
        MockConfig {
            listen,
            control_listen,
            model_id: "mock/llama-3-8b-instruct".into(),
            version: "1.0.0-mock".into(),
            backend: "pytorch".into(),
            max_input_len: 4096,
            max_seq_len: 8192,
            token_delay: Duration::ZERO,
            end_delay: Duration::ZERO,
            seed_by_prompt: false,
            health: HealthMode::Full,
            journal: None,
            hold_watch: false,
            watch_unknown_not_found: false,
            max_concurrent_streams: None,
            kind: EngineKind::Trtllm,
            engine_name: "tensorrt_llm".into(),
            warmup: Duration::ZERO,
            load_delay: Duration::ZERO,
            no_engine_api: false,
            load_unimplemented: false,
            server_info_unimplemented: false,
            kv_events_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            kv_event_heartbeat: Duration::from_secs(1),
        }
    }
}

/// How GetLoad / GetLoads answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LoadMode {
    Ok,
    Stall,
    Unavailable,
    /// UNIMPLEMENTED, as grpcio answers a method the servicer lacks.
    Unimplemented,
}

/// How HealthCheck answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HealthCheckMode {
    Ok,
    Stall,
    Text(String),
}

/// What the control endpoint can make every open Watch stream do.
#[derive(Debug, Clone)]
pub(crate) enum WatchControl {
    End,
    Fail { code: i32, message: String },
}

/// A fault the control endpoint plants in the next Generate (`/fault`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fault {
    /// The message the fault replaces: tokens count from 0, and the number
    /// of tokens asked for is the final message.
    pub(crate) at: u32,
    pub(crate) action: FaultAction,
    /// Only a Generate whose prompt has at most this many tokens takes it
    /// (a request migrated here with the tokens it already had does not).
    pub(crate) max_prompt: Option<usize>,
}

impl Fault {
    pub(crate) fn applies_to(&self, prompt_len: usize) -> bool {
        self.max_prompt.is_none_or(|max| prompt_len <= max)
    }
}

/// What a planted fault does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FaultAction {
    /// The stream fails with this status: the engine stays up.
    Cut { code: i32, message: String },
    /// The whole engine process dies (exit 137, as after a SIGKILL), once the
    /// tokens before reached the wire.
    Exit,
    /// The message is one no client can read (OpenEngine: a response that
    /// carries no event).
    Malformed,
    /// After the final message, the last token is sent again.
    Replay,
}

/// Counters the tests read through `/stats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) generate_started: AtomicU64,
    pub(crate) generate_completed: AtomicU64,
    pub(crate) generate_cancelled: AtomicU64,
    pub(crate) aborts: AtomicU64,
    pub(crate) health_checks: AtomicU64,
    pub(crate) load_calls: AtomicU64,
    pub(crate) info_calls: AtomicU64,
    pub(crate) watch_streams: AtomicU64,
    pub(crate) connections: AtomicU64,
}

/// Shared state of the running mock.
pub(crate) struct State {
    pub(crate) config: MockConfig,
    /// Registered health services and their raw status.
    pub(crate) statuses: Mutex<BTreeMap<String, i32>>,
    /// Bumped on every status change; Watch streams wake on it.
    pub(crate) changed: watch::Sender<u64>,
    pub(crate) watch_control: broadcast::Sender<WatchControl>,
    pub(crate) health_check: Mutex<HealthCheckMode>,
    pub(crate) version: Mutex<String>,
    pub(crate) counters: Counters,
    pub(crate) seen_ids: Mutex<Vec<String>>,
    /// The open journal file (append mode), if the mock keeps one.
    pub(crate) journal: Mutex<Option<std::fs::File>>,
    pub(crate) cancelled_ids: Mutex<Vec<String>>,
    /// What each OpenEngine Generate asked for (request id, prompt token ids,
    /// stopping options, `extra`), in arrival order: what a front end that
    /// translates requests (llm-sidecar-dynamo) really sent.
    pub(crate) asked: Mutex<Vec<serde_json::Value>>,
    /// Request ids named by OpenEngine `Control.Abort`, in arrival order.
    pub(crate) aborted_ids: Mutex<Vec<String>>,
    /// Fires when every open call must end (after a graceful stop's grace).
    pub(crate) cancel_calls: CancellationToken,
    /// Fires when the control endpoint asks for a graceful stop.
    pub(crate) stop_requested: watch::Sender<Option<Duration>>,
    /// New Watch streams hold back their first message while this is true.
    pub(crate) hold_watch: watch::Sender<bool>,
    /// Watch streams that end from now on end without trailers.
    pub(crate) end_without_trailers: AtomicBool,
    /// A graceful stop began: every Watch ends cleanly at its next wake-up.
    pub(crate) stopping: AtomicBool,
    /// OpenEngine's per-process instance id, `<host>-<pid>-<ms>`.
    pub(crate) instance_id: String,
    /// SGLang's native per-process instance id: its start in Unix nanoseconds.
    pub(crate) start_unix_nanos: u64,
    /// SGLang's native `is_pause` (`/pause?on=`): generation paused.
    pub(crate) paused: AtomicBool,
    /// When the mock started (uptime).
    pub(crate) started: std::time::Instant,
    /// When the mock started, in whole Unix seconds (SGLang's `start_time`).
    pub(crate) start_unix_secs: i64,
    pub(crate) load_mode: Mutex<LoadMode>,
    /// The KV cache's load as OpenEngine's GetLoad reports it (set through
    /// the control endpoint's `/load`).
    pub(crate) kv: Mutex<KvLoad>,
    /// The fault the next Generate takes (`/fault`), if any.
    pub(crate) fault: Mutex<Option<Fault>>,
    /// The KV-cache event publisher (OpenEngine only, unless turned off).
    pub(crate) kv_events: Option<Arc<kv_events::KvEvents>>,
    /// What OpenEngine's GetServerInfo reports of the KV cache and ranks
    /// (`/server-info` sets it, to play an engine that reports nonsense).
    pub(crate) server_info: Mutex<ReportedInfo>,
}

/// The capacity and parallelism OpenEngine's GetServerInfo reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReportedInfo {
    pub(crate) kv_block_size: u32,
    pub(crate) total_kv_blocks: u64,
    pub(crate) data_parallel_size: u32,
    pub(crate) data_parallel_start_rank: u32,
}

impl Default for ReportedInfo {
    fn default() -> Self {
        ReportedInfo {
            kv_block_size: KV_BLOCK_SIZE,
            total_kv_blocks: TOTAL_KV_BLOCKS,
            data_parallel_size: 1,
            data_parallel_start_rank: 0,
        }
    }
}

/// The mock's KV cache as OpenEngine reports it: a fixed block size and
/// total (GetServerInfo's capacity, as TensorRT-LLM's newer servers fill it),
/// and a load the control endpoint sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvLoad {
    pub(crate) used_blocks: u64,
    pub(crate) running: u32,
    pub(crate) queued: u32,
}

/// Tokens per KV block (GetServerInfo `capacity.kv_block_size`); not Dynamo's
/// default of 16, so a registration visibly carries the engine's value.
pub(crate) const KV_BLOCK_SIZE: u32 = 32;

/// KV blocks of the whole cache (`capacity.total_kv_blocks`, GetLoad's
/// `total_kv_blocks`).
pub(crate) const TOTAL_KV_BLOCKS: u64 = 8192;

impl State {
    pub(crate) fn set_status(&self, service: &str, status: i32) {
        lock(&self.statuses).insert(service.to_string(), status);
        self.changed.send_modify(|v| *v += 1);
    }

    pub(crate) fn unregister(&self, service: &str) {
        lock(&self.statuses).remove(service);
        self.changed.send_modify(|v| *v += 1);
    }

    pub(crate) fn status_of(&self, service: &str) -> Option<i32> {
        lock(&self.statuses).get(service).copied()
    }

    /// The kind's own health RPC: healthy while its liveness service serves.
    pub(crate) fn engine_serving(&self) -> bool {
        self.status_of(liveness_service(self.config.kind)) == Some(SERVING)
    }

    /// Appends `<event> <request id>` to the journal. One `write` per line on an
    /// append-mode file: lines never interleave and survive a SIGKILL.
    pub(crate) fn journal(&self, event: &str, request_id: &str) {
        use std::io::Write;
        if let Some(file) = lock(&self.journal).as_mut() {
            let line = format!("{event} {request_id}\n");
            if let Err(e) = file.write_all(line.as_bytes()) {
                tracing::warn!("journal write failed: {e}");
            }
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why the mock could not start.
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    /// A listen address could not be bound.
    #[error(transparent)]
    Bind(#[from] llm_sidecar_io::net::BindError),
    /// The KV event publisher's address could not be read.
    #[error("the KV event publisher: {0}")]
    KvEvents(#[from] std::io::Error),
    /// The journal file could not be opened for appending.
    #[error("cannot open the journal {path}: {source}")]
    Journal {
        /// The journal path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

const SERVING: i32 = 1;
const NOT_SERVING: i32 = 2;

/// The grpc.health.v1 service that says whether the engine lives, per kind.
pub(crate) fn liveness_service(kind: EngineKind) -> &'static str {
    kind.profile().liveness_service
}

/// The services a kind registers in grpc.health.v1, as its real server does
/// (SGLang's native server registers none: its statuses are the mock's own
/// record of whether it is healthy, which its HealthCheck and
/// WatchEngineState read).
fn health_services(config: &MockConfig) -> Vec<&'static str> {
    match (config.kind, config.health) {
        (EngineKind::SglangNative, _) => vec![liveness_service(config.kind)],
        (_, HealthMode::Absent) => vec![],
        (EngineKind::Trtllm | EngineKind::OpenEngine, HealthMode::Full) => {
            vec!["", "liveness", "inference"]
        }
        (EngineKind::Trtllm | EngineKind::OpenEngine, HealthMode::LivenessUnregistered) => {
            vec!["", "inference"]
        }
        (EngineKind::Vllm | EngineKind::Sglang, HealthMode::Full) => {
            vec!["", liveness_service(config.kind)]
        }
        (EngineKind::Vllm | EngineKind::Sglang, HealthMode::LivenessUnregistered) => vec![""],
        // vLLM's Rust frontend registers both of its services, and "".
        (EngineKind::VllmNative, HealthMode::Full) => vec!["", "vllm.Inference", "vllm.Control"],
        (EngineKind::VllmNative, HealthMode::LivenessUnregistered) => vec!["", "vllm.Control"],
    }
}

/// `<host>-<pid>-<ms>`, as TensorRT-LLM's OpenEngine server names itself.
fn instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    format!("{host}-{}-{ms}", std::process::id())
}

/// Runs the mock until a graceful stop (control `/stop` or `shutdown`) completes.
pub async fn run(
    config: MockConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), MockError> {
    let journal = match &config.journal {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| MockError::Journal {
                    path: path.display().to_string(),
                    source,
                })?,
        ),
        None => None,
    };
    let control_listener = llm_sidecar_io::net::bind("control", config.control_listen).await?;
    let events_stop = CancellationToken::new();
    let kv_events = match config.kv_events_listen {
        Some(listen) if config.kind == EngineKind::OpenEngine && !config.no_engine_api => {
            let listener = llm_sidecar_io::net::bind("KV events", listen).await?;
            Some(kv_events::KvEvents::start(
                listener,
                config.kv_event_heartbeat,
                KV_BLOCK_SIZE,
                TOTAL_KV_BLOCKS,
                events_stop.clone(),
            )?)
        }
        _ => None,
    };
    let started = std::time::Instant::now();
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let start_unix_secs = since_epoch.as_secs() as i64;
    let start_unix_nanos = u64::try_from(since_epoch.as_nanos()).unwrap_or(u64::MAX);

    let first = if config.warmup.is_zero() {
        SERVING
    } else {
        NOT_SERVING
    };
    let statuses: BTreeMap<String, i32> = health_services(&config)
        .into_iter()
        .map(|s| (s.to_string(), first))
        .collect();
    let (stop_tx, mut stop_rx) = watch::channel(None);
    let state = Arc::new(State {
        version: Mutex::new(config.version.clone()),
        config: config.clone(),
        statuses: Mutex::new(statuses),
        changed: watch::channel(0).0,
        watch_control: broadcast::channel(16).0,
        health_check: Mutex::new(HealthCheckMode::Ok),
        counters: Counters::default(),
        seen_ids: Mutex::new(Vec::new()),
        journal: Mutex::new(journal),
        cancelled_ids: Mutex::new(Vec::new()),
        asked: Mutex::new(Vec::new()),
        aborted_ids: Mutex::new(Vec::new()),
        cancel_calls: CancellationToken::new(),
        stop_requested: stop_tx,
        hold_watch: watch::channel(config.hold_watch).0,
        end_without_trailers: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        instance_id: instance_id(),
        start_unix_nanos,
        paused: AtomicBool::new(false),
        started,
        start_unix_secs,
        load_mode: Mutex::new(if config.load_unimplemented {
            LoadMode::Unimplemented
        } else {
            LoadMode::Ok
        }),
        kv: Mutex::new(KvLoad {
            used_blocks: 0,
            running: 0,
            queued: 0,
        }),
        fault: Mutex::new(None),
        kv_events,
        server_info: Mutex::new(ReportedInfo::default()),
    });

    let control_cancel = CancellationToken::new();
    tokio::spawn(llm_sidecar_io::admin::http::serve(
        control_listener,
        control::handler(state.clone()),
        control_cancel.clone(),
    ));
    let mut shutdown = std::pin::pin!(shutdown);

    // TensorRT-LLM and vLLM bind only once the model loaded.
    if !config.load_delay.is_zero() {
        tracing::info!("mock engine loading its model for {:?}", config.load_delay);
        tokio::select! {
            () = tokio::time::sleep(config.load_delay) => {}
            () = &mut shutdown => { control_cancel.cancel(); return Ok(()); }
        }
    }
    let listener = llm_sidecar_io::net::bind("gRPC", config.listen).await?;
    if !config.warmup.is_zero() {
        let state = state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(state.config.warmup).await;
            if state.stopping.load(Ordering::Acquire) {
                return;
            }
            let services: Vec<String> = lock(&state.statuses).keys().cloned().collect();
            for service in &services {
                state.set_status(service, SERVING);
            }
            tracing::info!("mock engine warmed up: SERVING");
        });
    }

    // Stop accepting at once when a stop begins, as grpcio's server.stop() does.
    let accept_stop = CancellationToken::new();
    let incoming = {
        let state = state.clone();
        let accept_stop = accept_stop.clone();
        async_incoming(listener, state, accept_stop)
    };
    let kind = config.kind;
    let api = |k: EngineKind| kind == k && !config.no_engine_api;
    let mut router = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(config.max_concurrent_streams)
        .add_service(echo_api::echo_server::EchoServer::new(echo::Echo))
        .add_optional_service(api(EngineKind::Trtllm).then(|| {
            TrtllmServiceServer::new(kinds::trtllm::Engine {
                state: state.clone(),
            })
        }))
        .add_optional_service(api(EngineKind::OpenEngine).then(|| {
            InferenceServer::new(kinds::openengine::OpenEngine {
                state: state.clone(),
            })
        }))
        .add_optional_service(api(EngineKind::OpenEngine).then(|| {
            ControlServer::new(kinds::openengine::OpenEngine {
                state: state.clone(),
            })
        }))
        .add_optional_service(api(EngineKind::Vllm).then(|| {
            VllmEngineServer::new(kinds::vllm::Vllm {
                state: state.clone(),
            })
        }))
        .add_optional_service(api(EngineKind::Sglang).then(|| {
            SglangSchedulerServer::new(kinds::sglang::Sglang {
                state: state.clone(),
            })
        }))
        .add_optional_service(api(EngineKind::VllmNative).then(|| {
            llm_sidecar_engine_api::vllm_native::inference_server::InferenceServer::new(
                kinds::vllm_native::VllmNative {
                    state: state.clone(),
                },
            )
        }))
        .add_optional_service(api(EngineKind::VllmNative).then(|| {
            llm_sidecar_engine_api::vllm_native::control_server::ControlServer::new(
                kinds::vllm_native::VllmNative {
                    state: state.clone(),
                },
            )
        }))
        .add_optional_service(api(EngineKind::SglangNative).then(|| {
            llm_sidecar_engine_api::sglang_runtime::sglang_service_server::SglangServiceServer::new(
                kinds::sglang_native::SglangNative {
                    state: state.clone(),
                },
            )
        }));
    // SGLang's native server serves no grpc.health.v1 (its health is its own
    // HealthCheck and WatchEngineState, which read the same statuses).
    if config.health != HealthMode::Absent && kind != EngineKind::SglangNative {
        router = router.add_service(health::TrailerSwitch::new(
            tonic_health::pb::health_server::HealthServer::new(health::Health {
                state: state.clone(),
            }),
            state.clone(),
        ));
    }
    // A graceful stop says GOAWAY (NO_ERROR) on every connection, as grpcio's
    // server.stop(grace) does, and serves the calls already open.
    let goaway = CancellationToken::new();
    let server = tokio::spawn(
        router.serve_with_incoming_shutdown(incoming, goaway.clone().cancelled_owned()),
    );
    tracing::info!(
        listen = %config.listen,
        control = %config.control_listen,
        kind = kind.profile().name,
        "mock {} engine serving model {}",
        kind.profile().display_name,
        config.model_id
    );

    let grace = tokio::select! {
        () = &mut shutdown => Duration::from_secs(5),
        changed = stop_rx.wait_for(Option::is_some) => match changed {
            Ok(g) => g.unwrap_or_default(),
            Err(_) => Duration::ZERO,
        },
    };
    // TensorRT-LLM's graceful stop: refuse new connections, end the health
    // Watch streams cleanly (a Check now answers NOT_SERVING), say GOAWAY,
    // let calls run for the grace, then cancel every open call.
    accept_stop.cancel();
    state.stopping.store(true, Ordering::Release);
    let _ = state.watch_control.send(WatchControl::End);
    let services: Vec<String> = lock(&state.statuses).keys().cloned().collect();
    for service in &services {
        state.set_status(service, NOT_SERVING);
    }
    goaway.cancel();
    tracing::info!(
        "mock engine stopping: Watch streams ended, NOT_SERVING, GOAWAY sent, cancelling calls \
         in {:?}",
        grace
    );
    tokio::time::sleep(grace).await;
    let _ = state.watch_control.send(WatchControl::Fail {
        code: tonic::Code::Unavailable as i32,
        message: "Cancelling all calls".into(),
    });
    state.cancel_calls.cancel();
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.abort();
    control_cancel.cancel();
    events_stop.cancel();
    Ok(())
}

/// The accept loop as a stream that ends when `stop` fires.
fn async_incoming(
    listener: TcpListener,
    state: Arc<State>,
    stop: CancellationToken,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    state.counters.connections.fetch_add(1, Ordering::Relaxed);
                    if tx.send(Ok(stream)).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!("accept failed: {e}"),
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
