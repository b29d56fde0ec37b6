//! The request plane: a byte-level gRPC proxy in front of the engine.
//!
//! Every call on `--listen` is forwarded to the engine as it came: headers and
//! metadata, the message stream and the trailers pass through frame by frame,
//! never decoded. The proxy adds only what the lifecycle needs:
//!
//! - admission through the core's [`Gate`]: a refused call gets UNAVAILABLE
//!   "draining" and never reaches the engine;
//! - in-flight accounting: an admitted call counts until its response ends or is
//!   dropped (a caller's cancel drops the engine stream, which resets it);
//! - the cut at the drain deadline (UNAVAILABLE trailers to the caller, a reset
//!   to the engine), and `grpc-timeout` enforced on the sidecar side as well;
//! - message size limits, read from the 5-byte gRPC message prefix;
//! - the sidecar's own `grpc.health.v1`, and the engine's health RPC answered
//!   locally whenever the worker is not Serving.
//!
//! The rooms: [`accept`] (listener, TLS, HTTP/2 settings, GOAWAY, lingering
//! close), [`forward`] (routing, refusal, forwarding and the bodies),
//! [`framing`] (gRPC framing and `grpc-timeout`, pure), [`outcome`] (how each
//! call ended, the counters), [`own_health`] (the sidecar's health service).

mod accept;
mod forward;
mod framing;
mod outcome;
mod own_health;

use std::sync::atomic::AtomicBool;

use llm_sidecar_core::gate::Gate;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic_health::pb::health_server::HealthServer;

pub(crate) use accept::serve;
pub(crate) use outcome::{CallCounters, CallOutcome};
pub(crate) use own_health::OwnHealth;

/// Limits on what a caller may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest gRPC message, either direction, in bytes.
    pub max_message_bytes: u32,
    /// Concurrent streams per caller connection.
    pub max_concurrent_streams: u32,
    /// Largest header list a caller may send, in bytes.
    pub max_header_list_bytes: u32,
}

/// Everything the request handlers share.
pub(crate) struct Plane {
    pub(crate) gate: Gate,
    /// The sidecar's own health is SERVING.
    pub(crate) serving: AtomicBool,
    /// Fires at the drain deadline: every call still in flight is cut.
    pub(crate) cut: CancellationToken,
    /// Woken when the last call leaves a closed gate.
    pub(crate) drained: Notify,
    pub(crate) counters: CallCounters,
    pub(crate) engine: Channel,
    pub(crate) health: HealthServer<OwnHealth>,
    pub(crate) health_rpc_path: &'static str,
    pub(crate) limits: Limits,
}

impl Plane {
    /// A closed request plane in front of `engine` (the core opens it).
    pub(crate) fn new(
        engine: Channel,
        health: &OwnHealth,
        health_rpc_path: &'static str,
        limits: Limits,
    ) -> Self {
        Plane {
            gate: Gate::new(),
            serving: AtomicBool::new(false),
            cut: CancellationToken::new(),
            drained: Notify::new(),
            counters: CallCounters::default(),
            engine,
            health: health.server(),
            health_rpc_path,
            limits,
        }
    }
}
