//! The engine: which kind it is, how to reach it, what it says about itself.
//!
//! An [`EngineProfile`] names everything engine-specific: the display name in
//! log lines, the liveness service, the probe and the identity. Adding an engine
//! means a profile and its calls here; the core is untouched.

mod connector;
pub(crate) mod monitors;
pub(crate) mod startup;
mod trtllm;

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

pub use connector::{EngineConnector, StreamLimit};

use crate::discovery::ModelRecord;
use crate::report::error_chain;

/// The engines llm-sidecar knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// NVIDIA TensorRT-LLM (`trtllm.TrtllmService`).
    Trtllm,
}

/// Everything engine-specific the sidecar needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineProfile {
    /// Which engine.
    pub kind: EngineKind,
}

impl EngineProfile {
    /// The profile of an engine kind.
    pub const fn of(kind: EngineKind) -> Self {
        EngineProfile { kind }
    }

    /// How log lines name the engine.
    pub const fn display_name(&self) -> &'static str {
        match self.kind {
            EngineKind::Trtllm => "TensorRT-LLM",
        }
    }

    /// The short name in flags and records.
    pub const fn kind_name(&self) -> &'static str {
        match self.kind {
            EngineKind::Trtllm => "trtllm",
        }
    }

    /// The grpc.health.v1 service the engine serves for liveness.
    pub const fn default_liveness_service(&self) -> &'static str {
        match self.kind {
            EngineKind::Trtllm => "liveness",
        }
    }

    /// The engine API's own health RPC, which gateways call to judge a worker.
    pub const fn health_rpc_path(&self) -> &'static str {
        match self.kind {
            EngineKind::Trtllm => "/trtllm.TrtllmService/HealthCheck",
        }
    }

    /// The engine API's gRPC service name.
    pub const fn service_name(&self) -> &'static str {
        match self.kind {
            EngineKind::Trtllm => "trtllm.TrtllmService",
        }
    }
}

/// What the engine said about itself at start-up (and in each probe).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The engine's version string.
    pub version: String,
    /// Self-description; a different value means another engine answers.
    pub identity: String,
    /// The served model.
    pub model: ModelRecord,
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
/// goes to `limit`.
pub async fn connect(
    endpoint: &Endpoint,
    limit: &StreamLimit,
    bound: Duration,
) -> Result<Channel, EngineError> {
    let connector = EngineConnector::new(limit.clone());
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
    profile: &EngineProfile,
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    match profile.kind {
        EngineKind::Trtllm => trtllm::read_info(channel, bound).await,
    }
}

/// Asks the engine whether its routing load is fresh; `Ok` means fresh.
pub async fn probe(
    profile: &EngineProfile,
    channel: &Channel,
    bound: Duration,
) -> Result<(), EngineError> {
    match profile.kind {
        EngineKind::Trtllm => trtllm::probe(channel, bound).await,
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
