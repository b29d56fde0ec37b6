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
//! The rooms: [`accept`] (listener, connection cap, TLS, HTTP/2 settings,
//! handshake and idle timeouts, GOAWAY, lingering close), [`frame_watch`]
//! (each caller's frames: handshake, open calls, flood budget), [`forward`]
//! (routing, refusal, forwarding and the bodies), [`engine_pool`] (the engine
//! connections), [`engine_streams`] (engine streams shared fairly among
//! caller addresses), [`framing`] (gRPC framing and `grpc-timeout`, pure),
//! [`outcome`] (how each call ended, the counters), [`own_health`] (the
//! sidecar's health service), [`shards`] (the threads connections run on), [`unanswered_stream`] (an engine stream given up
//! before its answer began, reset only once the engine has taken it).

mod accept;
mod admitted;
mod calls;
mod engine_pool;
mod engine_streams;
mod forward;
mod frame_watch;
mod framing;
mod outcome;
mod own_health;
mod shards;
mod unanswered_stream;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::time::Duration;

use llm_sidecar_core::gate::Gate;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic_health::pb::health_server::HealthServer;

pub(crate) use accept::serve;
pub use admitted::{Admitted, HostedCalls};
pub(crate) use engine_pool::EnginePool;
pub(crate) use outcome::CallCounters;
pub use outcome::{CUT_MESSAGE, CallOutcome};
pub(crate) use own_health::OwnHealth;
pub(crate) use shards::Shards;
pub use shards::auto_worker_threads;

/// Limits on what a caller may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest gRPC message, either direction, in bytes.
    pub max_message_bytes: u32,
    /// Concurrent streams per caller connection.
    pub max_concurrent_streams: u32,
    /// Largest header list, either direction (a caller's request, the engine's
    /// response headers and trailers), in bytes.
    pub max_header_list_bytes: u32,
    /// Caller connections open at once; past it a new one is closed at once.
    pub max_connections: u32,
    /// How long a caller has, once connected (and through TLS), to send the
    /// HTTP/2 preface and its first frame.
    pub handshake_timeout: Duration,
    /// A caller connection with no call open for this long gets GOAWAY.
    pub idle_timeout: Duration,
    /// Control frames a caller connection may send per second beyond 10 per
    /// frame of real work (docs/CONTRACT.md, "Request plane").
    pub control_frame_budget: u32,
    /// HTTP/2 connections to the engine at most; `None`: as many as the
    /// engine streams the sidecar may hold need (`EnginePool`).
    pub engine_connections: Option<u32>,
}

impl Limits {
    /// `llm-sidecar run`'s defaults, the flags' one home.
    pub const DEFAULT: Limits = Limits {
        max_message_bytes: 64 * 1024 * 1024,
        max_concurrent_streams: 2048,
        max_header_list_bytes: 16 * 1024,
        max_connections: 1024,
        handshake_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(5 * 60),
        control_frame_budget: 1000,
        engine_connections: None,
    };

    /// The smallest message and header limits that make sense: below them no
    /// real call fits, so a smaller value is a mistake, not a choice.
    pub const MIN_BYTES: u32 = 1024;

    /// Checks the limits; a value that cannot work is refused, never raised.
    pub fn check(&self) -> Result<(), crate::parse::ConfigError> {
        let refuse = |flag: &'static str, value: u32, message: &str| {
            Err(crate::parse::ConfigError::OutOfRange {
                flag,
                value: value.to_string(),
                message: message.to_string(),
            })
        };
        if self.max_message_bytes < Self::MIN_BYTES {
            return refuse(
                "--max-message-bytes",
                self.max_message_bytes,
                "must be at least 1024",
            );
        }
        if self.max_header_list_bytes < Self::MIN_BYTES {
            return refuse(
                "--max-header-list-bytes",
                self.max_header_list_bytes,
                "must be at least 1024",
            );
        }
        for (flag, value) in [
            ("--max-concurrent-streams", self.max_concurrent_streams),
            ("--max-connections", self.max_connections),
            ("--control-frame-budget", self.control_frame_budget),
            ("--engine-connections", self.engine_connections.unwrap_or(1)),
        ] {
            if value == 0 {
                return refuse(flag, 0, "must be at least 1");
            }
        }
        for (flag, value) in [
            ("--handshake-timeout", self.handshake_timeout),
            ("--idle-timeout", self.idle_timeout),
        ] {
            if value.is_zero() {
                return Err(crate::parse::ConfigError::OutOfRange {
                    flag,
                    value: "0s".into(),
                    message: "must be greater than zero".into(),
                });
            }
        }
        Ok(())
    }
}

/// Everything the request handlers share.
pub(crate) struct Plane {
    pub(crate) gate: Gate,
    /// The sidecar's own health is SERVING.
    pub(crate) serving: AtomicBool,
    /// Fires at the drain deadline: every call still in flight is cut. A
    /// rejoin puts a fresh one in its place (`renew_cut`).
    cut: std::sync::Mutex<CancellationToken>,
    /// Woken when the last call leaves a closed gate.
    pub(crate) drained: Notify,
    pub(crate) counters: CallCounters,
    pub(crate) engine: EnginePool,
    pub(crate) health: HealthServer<OwnHealth>,
    /// The engine API's own health RPC, once the engine's kind is known.
    pub(crate) health_rpc_path: std::sync::OnceLock<&'static str>,
    pub(crate) limits: Limits,
    /// Caller connections open now.
    pub(crate) connections_open: AtomicUsize,
    /// Caller connections closed at once because `max_connections` were open.
    pub(crate) connections_refused: AtomicU64,
    /// The engine streams the calls hold, shared among caller addresses.
    pub(crate) engine_streams: Arc<engine_streams::EngineStreams>,
}

impl Plane {
    /// What cuts a call admitted now: fires at this instance's drain deadline.
    pub(crate) fn cut_token(&self) -> CancellationToken {
        self.cut.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The drain deadline: cut every call in flight.
    pub(crate) fn cut_all(&self) {
        self.cut.lock().unwrap_or_else(|p| p.into_inner()).cancel();
    }

    /// A rejoin: calls admitted from now on are not cut by the last drain.
    pub(crate) fn renew_cut(&self) {
        *self.cut.lock().unwrap_or_else(|p| p.into_inner()) = CancellationToken::new();
    }

    /// A closed request plane in front of `engine` (the core opens it).
    pub(crate) fn new(engine: EnginePool, health: &OwnHealth, limits: Limits) -> Self {
        let sizing = engine.sizing();
        Plane {
            gate: Gate::new(),
            serving: AtomicBool::new(false),
            cut: std::sync::Mutex::new(CancellationToken::new()),
            drained: Notify::new(),
            counters: CallCounters::default(),
            engine,
            health: health.server(),
            health_rpc_path: std::sync::OnceLock::new(),
            limits,
            connections_open: AtomicUsize::new(0),
            connections_refused: AtomicU64::new(0),
            engine_streams: engine_streams::EngineStreams::new(move || sizing.open_streams()),
        }
    }

    /// The concurrent calls one caller connection may have: the flag, and
    /// never more than the engine streams callers may take without
    /// competing (a connection could not use more).
    pub(crate) fn stream_cap(&self) -> u32 {
        let flag = self.limits.max_concurrent_streams;
        let open = self.engine.open_streams().max(1);
        u32::try_from(open).map_or(flag, |open| flag.min(open))
    }
}
