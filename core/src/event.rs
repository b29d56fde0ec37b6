//! The core's inputs. Every input arrives together with the time it happened.

use std::time::Duration;

/// How the engine's connection ended, as the IO layer saw it: each its own
/// loss reason, so that a graceful stop never reads as a network fault.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ConnectionEnd {
    /// The engine said GOAWAY with this HTTP/2 error code, and the
    /// connection closed after it: NO_ERROR (0) is a server stopping
    /// gracefully (grpcio's `server.stop`, tonic's graceful shutdown).
    GoAway {
        /// The GOAWAY frame's error code.
        code: u32,
    },
    /// The engine closed the connection (end of stream) without a GOAWAY.
    Closed,
    /// The connection was reset (its host answered with RST: the process
    /// died with the socket open, or a middlebox dropped it).
    Reset,
    /// The connection failed otherwise.
    Failed {
        /// The socket's error.
        error: String,
    },
    /// The HTTP/2 layer dropped the connection with nothing from the
    /// engine: a keepalive ping went unanswered (a frozen engine or a
    /// silent network).
    KeepaliveTimeout,
}

/// Something that happened in the world, told to the core by the IO layer,
/// grouped by where it comes from: the engine, discovery, the process's
/// signals, the request plane. A state that cares for none of a source's news
/// names the source once (`Event::Engine(_)`), and the match stays
/// exhaustive.
///
/// Time passing is not an event: it reaches the core through
/// [`crate::Lifecycle::handle_timeout`] (and the time of every event).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Event {
    /// The engine: ready at start-up, then what its monitors saw.
    Engine(EngineEvent),
    /// Discovery: the answers to the core's writes, and a record the store
    /// dropped on its own.
    Discovery(DiscoveryEvent),
    /// SIGTERM or SIGINT.
    ShutdownSignal,
    /// The number of forwarded calls in flight changed.
    InFlightChanged {
        /// Calls admitted and not yet ended.
        count: u64,
    },
}

/// What the IO layer learnt of the engine.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineEvent {
    /// The engine answered its start-up calls.
    Ready {
        /// What the identity monitor compares: the engine's instance id where its
        /// API has one, else its self-description.
        identity: String,
        /// How lines name the engine from now on ("TensorRT-LLM", "vLLM", …).
        name: String,
        /// The engine's own instance id, for the loss line, where its API has
        /// one; `None`: the line names the worker's instance.
        instance: Option<String>,
        /// The grpc.health.v1 service followed for liveness, for warnings.
        liveness_service: String,
    },
    /// Something the liveness Watch reported (see [`LivenessObservation`]).
    Liveness(LivenessObservation),
    /// The stale-load probe got a fresh answer from the engine.
    ProbeSucceeded,
    /// The stale-load probe got no fresh answer (error, timeout, or a non-fresh reply).
    ProbeFailed {
        /// Why the answer was not fresh.
        error: String,
    },
    /// The engine does not serve its load RPC (UNIMPLEMENTED or NOT_FOUND: an
    /// older servicer). The stale-load rule cannot apply to it; the IO layer
    /// follows the engine's connection instead and reports its end as
    /// [`EngineEvent::ConnectionLost`].
    LoadUnsupported {
        /// The RPC the engine does not serve ("GetLoads", "GetLoad", …).
        rpc: String,
    },
    /// The probe re-read the engine's identity.
    IdentityObserved {
        /// The identity now answering on the engine's port.
        identity: String,
    },
    /// The connection the monitors use closed or failed, for an engine whose
    /// API has no identity of its own (that connection is its identity).
    ConnectionLost {
        /// How it ended.
        end: ConnectionEnd,
    },
}

/// What discovery answered, or did on its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DiscoveryEvent {
    /// The oldest outstanding `Register` action succeeded.
    Registered,
    /// The oldest outstanding `Register` action failed; nothing was written.
    RegistrationFailed {
        /// What the discovery backend said.
        error: String,
    },
    /// Discovery dropped our record on its own (an etcd lease expired, someone
    /// removed the record).
    RegistrationLost {
        /// What happened, for the log line ("its lease expired", …).
        cause: String,
    },
    /// The oldest outstanding `Withdraw` action succeeded: the record is gone.
    Withdrawn,
    /// The oldest outstanding `Withdraw` action failed; the record may still be there.
    WithdrawFailed {
        /// What the discovery backend said.
        error: String,
    },
}

/// One thing seen while following the liveness service: on its
/// `grpc.health.v1.Health/Watch` stream, or (for engines whose Watch ends after
/// one message) in a `Check` polled at an interval.
///
/// The IO layer reports what it saw, raw; the core's [`crate::liveness`] decides what it means.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LivenessObservation {
    /// A message with this raw `ServingStatus` value (read as `i32`, so values this
    /// build does not know are not folded into UNKNOWN).
    Status(i32),
    /// The stream ended with status OK, or without trailers.
    StreamEnded,
    /// The RPC or the stream failed with a gRPC status (transport errors, resets and
    /// keepalive timeouts arrive as UNKNOWN or UNAVAILABLE).
    StreamFailed {
        /// The gRPC status code as a number (0..=16).
        code: i32,
        /// The status message.
        message: String,
    },
    /// A polled `Check` failed with a gRPC status.
    CheckFailed {
        /// The gRPC status code as a number (0..=16).
        code: i32,
        /// The status message.
        message: String,
    },
    /// No first message arrived within the connect-attempt timeout.
    NotOpened {
        /// How long the IO layer waited.
        waited: Duration,
    },
}
