//! The engine: which kind it is, how to reach it, what it says about itself.
//!
//! An [`EngineProfile`] holds everything kind-specific as data: the names,
//! the API's service and health RPC, how liveness is followed (a Watch that
//! streams, a Check polled because the kind's Watch ends after one message, or
//! SGLang's own state stream),
//! whether start-up waits out a NOT_SERVING warm-up, and whether the engine's
//! connection is its identity. The calls of each kind live in their own file
//! (`trtllm.rs`, `openengine.rs`, `vllm.rs`, `sglang.rs`, `vllm_native.rs`,
//! `sglang_native.rs`); detection tries
//! them all (`detect.rs`). Adding an engine means a profile and its calls
//! here; the core is untouched.

pub mod check;
mod connector;
pub(crate) mod detect;
pub(crate) mod monitors;
mod openengine;
mod sglang;
pub(crate) mod sglang_native;
pub(crate) mod startup;
mod trtllm;
mod vllm;
mod vllm_native;

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

pub use connector::{ConnectionWatch, EngineConnector, StreamLimit};
pub(crate) use connector::{ReadsPerTurn, open as open_connection};

use crate::discovery::ModelRecord;
use crate::report::error_chain;

/// The engine APIs llm-sidecar follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EngineKind {
    /// TensorRT-LLM's `trtllm.TrtllmService`, the API the SMG gateway speaks.
    Trtllm,
    /// TensorRT-LLM's OpenEngine server (`openengine.v1.Inference`/`Control`).
    OpenEngine,
    /// vLLM's `vllm.grpc.engine.VllmEngine`.
    Vllm,
    /// SGLang's `sglang.grpc.scheduler.SglangScheduler`.
    Sglang,
    /// vLLM's native server (`vllm.Inference`, `vllm.Control`).
    VllmNative,
    /// SGLang's native server (`sglang.runtime.v1.SglangService`).
    SglangNative,
}

/// Which kind to follow: given, or found at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    /// Find out which API the engine serves (`--engine-kind auto`).
    Auto,
    /// This kind, whatever else the engine serves.
    Kind(EngineKind),
}

/// How the liveness service is followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Following {
    /// `grpc.health.v1.Health/Watch`, held open: the engine streams every change.
    Watch,
    /// `grpc.health.v1.Health/Check` every `--health-poll-interval`: the
    /// engine's Watch sends one message and ends, which is not a loss there.
    Poll,
    /// SGLang's native `WatchEngineState` stream (the server serves no
    /// grpc.health.v1), its `HealthCheck` polled where the stream is not
    /// served; `--liveness-service` turns back to a polled grpc.health.v1.
    EngineState,
}

/// Everything kind-specific the sidecar needs, as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineProfile {
    /// Which kind.
    pub kind: EngineKind,
    /// The short name in flags and records.
    pub name: &'static str,
    /// How log lines name the engine when its API does not say.
    pub display_name: &'static str,
    /// The API's main gRPC service: the sidecar's own health answers for it too.
    pub service: &'static str,
    /// The API's own health RPC, which gateways call to judge a worker; the
    /// sidecar answers it "draining" itself whenever it is not Serving.
    /// `None`: the API has none (its callers ask grpc.health.v1, which the
    /// sidecar answers itself).
    pub health_rpc: Option<&'static str>,
    /// The grpc.health.v1 service followed for liveness.
    pub liveness_service: &'static str,
    /// How it is followed.
    pub following: Following,
    /// The API carries no per-process identity, so the connection the
    /// monitors use stands for it: that connection closing is a loss.
    pub connection_is_identity: bool,
}

/// Every profile, in the order auto-detection prefers them: a server that
/// serves two APIs is followed through the one with the better identity
/// (OpenEngine's and vLLM's native instance id).
pub const PROFILES: [EngineProfile; 6] = [
    EngineProfile {
        kind: EngineKind::OpenEngine,
        name: "openengine",
        display_name: "TensorRT-LLM",
        service: "openengine.v1.Control",
        health_rpc: Some("/openengine.v1.Control/Health"),
        liveness_service: "liveness",
        following: Following::Watch,
        connection_is_identity: false,
    },
    EngineProfile {
        kind: EngineKind::Trtllm,
        name: "trtllm",
        display_name: "TensorRT-LLM",
        service: "trtllm.TrtllmService",
        health_rpc: Some("/trtllm.TrtllmService/HealthCheck"),
        liveness_service: "liveness",
        following: Following::Watch,
        connection_is_identity: false,
    },
    EngineProfile {
        kind: EngineKind::VllmNative,
        name: "vllm-native",
        display_name: "vLLM",
        service: "vllm.Inference",
        health_rpc: None,
        // tonic-health: Watch streams every change; the engine core's death
        // turns "", vllm.Inference and vllm.Control NOT_SERVING at once.
        liveness_service: "vllm.Inference",
        following: Following::Watch,
        connection_is_identity: false,
    },
    EngineProfile {
        kind: EngineKind::Vllm,
        name: "vllm",
        display_name: "vLLM",
        service: "vllm.grpc.engine.VllmEngine",
        health_rpc: Some("/vllm.grpc.engine.VllmEngine/HealthCheck"),
        liveness_service: "vllm.grpc.engine.VllmEngine",
        following: Following::Poll,
        connection_is_identity: true,
    },
    EngineProfile {
        kind: EngineKind::Sglang,
        name: "sglang",
        display_name: "SGLang",
        service: "sglang.grpc.scheduler.SglangScheduler",
        health_rpc: Some("/sglang.grpc.scheduler.SglangScheduler/HealthCheck"),
        liveness_service: "sglang.grpc.scheduler.SglangScheduler",
        following: Following::Poll,
        connection_is_identity: true,
    },
    EngineProfile {
        kind: EngineKind::SglangNative,
        name: "sglang-native",
        display_name: "SGLang",
        service: "sglang.runtime.v1.SglangService",
        health_rpc: Some("/sglang.runtime.v1.SglangService/HealthCheck"),
        // Followed through its own WatchEngineState; this name is used only
        // when --liveness-service asks for grpc.health.v1.
        liveness_service: "sglang.runtime.v1.SglangService",
        following: Following::EngineState,
        // WatchEngineState's instance_id is its identity; a server without
        // that stream has its connection followed in its place.
        connection_is_identity: false,
    },
];

impl EngineKind {
    /// This kind's profile.
    pub fn profile(self) -> &'static EngineProfile {
        // A match, so that a new kind cannot compile without its place in
        // PROFILES (whose order is detection's); the test below checks each
        // place holds its kind.
        let at = match self {
            EngineKind::OpenEngine => 0,
            EngineKind::Trtllm => 1,
            EngineKind::VllmNative => 2,
            EngineKind::Vllm => 3,
            EngineKind::Sglang => 4,
            EngineKind::SglangNative => 5,
        };
        &PROFILES[at]
    }

    /// The kind a flag or record names (`trtllm`, `openengine`, `vllm`,
    /// `sglang`, `vllm-native`, `sglang-native`).
    pub fn from_name(name: &str) -> Option<EngineKind> {
        PROFILES.iter().find(|p| p.name == name).map(|p| p.kind)
    }
}

impl EngineChoice {
    /// How lines name the engine before it answered: the kind's name, or
    /// nothing while the kind is still to be found.
    pub fn display_name(self) -> &'static str {
        match self {
            EngineChoice::Auto => "",
            EngineChoice::Kind(kind) => kind.profile().display_name,
        }
    }
}

/// What the engine said about itself at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The kind it turned out to be.
    pub kind: EngineKind,
    /// How lines name it (OpenEngine: from its `engine_name`).
    pub display_name: String,
    /// The engine's version string.
    pub version: String,
    /// What the identity monitor compares: the instance id where the API has
    /// one, else a self-description.
    pub identity: String,
    /// The engine's own instance id, where its API has one.
    pub instance_id: Option<String>,
    /// The served model.
    pub model: ModelRecord,
    /// Start-up reads the engine does not serve (an older servicer), read
    /// around: the record carries what the others said.
    pub unserved: Vec<&'static str>,
}

/// The version a record carries when the engine's API did not say.
pub const UNKNOWN_VERSION: &str = "unknown";

impl EngineInfo {
    /// This engine's profile.
    pub fn profile(&self) -> &'static EngineProfile {
        self.kind.profile()
    }
}

/// What one stale-load probe learned.
#[derive(Debug)]
pub struct Probed {
    /// `Ok`: the engine's load is fresh.
    pub fresh: Result<(), EngineError>,
    /// The identity now answering, for kinds that have one.
    pub identity: Option<String>,
}

impl Probed {
    /// A probe whose one call answered with the engine's instance id (or
    /// failed): fresh if it answered, and that id, where it is one, as who
    /// answers.
    pub(crate) fn by_instance_id(answer: Result<String, EngineError>) -> Probed {
        match answer {
            Ok(id) => Probed {
                fresh: Ok(()),
                identity: (!id.is_empty()).then_some(id),
            },
            Err(e) => Probed {
                fresh: Err(e),
                identity: None,
            },
        }
    }
}

/// Why talking to the engine failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Could not connect (the engine binds only after its model loaded).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// A call failed with a gRPC status.
    #[error("{call} failed: {code:?}: {message}")]
    Call {
        /// The RPC.
        call: &'static str,
        /// The status code.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
    /// A call did not answer in time.
    #[error("{call} did not answer within {after}")]
    Timeout {
        /// The RPC.
        call: &'static str,
        /// The bound.
        after: String,
    },
    /// The engine answered the probe with something other than fresh.
    #[error("{call} answered {answer:?}")]
    NotFresh {
        /// The RPC.
        call: &'static str,
        /// The answer.
        answer: String,
    },
}

impl EngineError {
    /// The RPC this error names, if the engine does not serve it at all
    /// (UNIMPLEMENTED, or NOT_FOUND as some servers say it): a servicer older
    /// than the RPC, not an engine in trouble.
    pub fn unserved_call(&self) -> Option<&'static str> {
        match self {
            EngineError::Call {
                call,
                code: tonic::Code::Unimplemented | tonic::Code::NotFound,
                ..
            } => Some(call),
            EngineError::Call { .. }
            | EngineError::Connect(_)
            | EngineError::Timeout { .. }
            | EngineError::NotFresh { .. } => None,
        }
    }
}

/// An optional start-up read: its answer, or `None` (noted in `unserved`)
/// when the engine does not serve the RPC; any other failure is the
/// attempt's.
pub(crate) fn optional<T>(
    answer: Result<T, EngineError>,
    unserved: &mut Vec<&'static str>,
) -> Result<Option<T>, EngineError> {
    match answer {
        Ok(value) => Ok(Some(value)),
        Err(e) => match e.unserved_call() {
            Some(call) => {
                unserved.push(call);
                Ok(None)
            }
            None => Err(e),
        },
    }
}

/// How the engine connection is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelSettings {
    /// Bound on one connect attempt.
    pub connect_timeout: Duration,
    /// HTTP/2 keepalive ping interval; above the engine's ping floor.
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered.
    pub keepalive_timeout: Duration,
}

/// The engine connection's settings: HTTP/2 keepalive above the engine's ping
/// floor (so a frozen engine is noticed), a bounded connect, no Nagle.
pub fn endpoint(address: &str, settings: ChannelSettings) -> Result<Endpoint, EngineError> {
    let endpoint = Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| EngineError::Connect(error_chain(&e)))?;
    Ok(endpoint
        .connect_timeout(settings.connect_timeout)
        .http2_keep_alive_interval(settings.keepalive_interval)
        .keep_alive_timeout(settings.keepalive_timeout)
        .keep_alive_while_idle(true)
        .http2_max_header_list_size(ENGINE_MAX_HEADER_LIST_BYTES)
        .initial_connection_window_size(ENGINE_CONNECTION_WINDOW)
        .initial_stream_window_size(ENGINE_STREAM_WINDOW)
        .tcp_nodelay(true))
}

/// The engine connection's HTTP/2 receive window, far above what the streams'
/// own windows let the engine send. h2 budgets the framing overhead of DATA
/// frames it holds unread at half this window, and answers more with GOAWAY
/// ENHANCE_YOUR_CALM, which would kill every call on the connection. A token
/// is a DATA frame of some 25 bytes, so hundreds of streams of tokens arriving
/// while the sidecar is busy reach h2's default budget (half of 5 MB) with a
/// few hundred kilobytes unread. At 256 MiB the budget holds over 500,000
/// unread tokens; what is actually held stays bounded by the stream windows.
pub const ENGINE_CONNECTION_WINDOW: u32 = 256 << 20;

/// The engine stream's receive window: what one call may have sent and the
/// caller not yet read. 64 KiB holds thousands of tokens; with the connection
/// window above it is the bound on the memory an engine can make the sidecar
/// hold (streams × 64 KiB).
pub const ENGINE_STREAM_WINDOW: u32 = 64 << 10;

/// How large a header block the engine may send before h2 drops the whole
/// connection (h2 fails just the stream up to 4× this, the connection beyond):
/// generous, so one engine answer with oversized headers never takes every
/// other call on the connection with it. The request plane then refuses to
/// pass headers above the caller's limit on (that call fails alone).
pub const ENGINE_MAX_HEADER_LIST_BYTES: u32 = 4 << 20;

/// Connects once, bounded by the connect timeout; the engine's stream limit
/// goes to `limit`, and the connection's end to `watch`.
pub async fn connect(
    endpoint: &Endpoint,
    limit: &StreamLimit,
    watch: &ConnectionWatch,
    bound: Duration,
) -> Result<Channel, EngineError> {
    let connector = EngineConnector::new(limit.clone()).watched(watch.clone());
    match tokio::time::timeout(bound, endpoint.connect_with_connector(connector)).await {
        Ok(Ok(channel)) => Ok(channel),
        Ok(Err(e)) => Err(EngineError::Connect(error_chain(&e))),
        Err(_) => Err(EngineError::Connect(format!(
            "no connection within {}",
            llm_sidecar_core::HumanDuration(bound)
        ))),
    }
}

/// Reads the engine's version, identity and model, each call bounded by `bound`.
pub async fn read_info(
    kind: EngineKind,
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    match kind {
        EngineKind::Trtllm => trtllm::read_info(channel, bound).await,
        EngineKind::OpenEngine => openengine::read_info(channel, bound).await,
        EngineKind::Vllm => vllm::read_info(channel, bound).await,
        EngineKind::Sglang => sglang::read_info(channel, bound).await,
        EngineKind::VllmNative => vllm_native::read_info(channel, bound).await,
        EngineKind::SglangNative => sglang_native::read_info(channel, bound).await,
    }
}

/// Asks the engine whether its routing load is fresh, and who answers.
pub async fn probe(kind: EngineKind, channel: &Channel, bound: Duration) -> Probed {
    match kind {
        EngineKind::Trtllm => trtllm::probe(channel, bound).await,
        EngineKind::OpenEngine => openengine::probe(channel, bound).await,
        EngineKind::Vllm => vllm::probe(channel, bound).await,
        EngineKind::Sglang => sglang::probe(channel, bound).await,
        EngineKind::VllmNative => vllm_native::probe(channel, bound).await,
        EngineKind::SglangNative => sglang_native::probe(channel, bound).await,
    }
}

pub(crate) async fn bounded<T>(
    call: &'static str,
    bound: Duration,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, EngineError> {
    match tokio::time::timeout(bound, fut).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(EngineError::Call {
            call,
            code: status.code(),
            message: status.message().to_string(),
        }),
        Err(_) => Err(EngineError::Timeout {
            call,
            after: llm_sidecar_core::HumanDuration(bound).to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_profile_and_is_found_by_its_name() {
        for profile in &PROFILES {
            assert_eq!(profile.kind.profile().kind, profile.kind);
            assert_eq!(EngineKind::from_name(profile.name), Some(profile.kind));
        }
    }
}
