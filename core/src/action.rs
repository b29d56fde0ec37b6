//! The core's outputs: what the IO layer must do, in order.

/// Whether new calls may be forwarded to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Admission {
    /// New calls are forwarded.
    Open,
    /// New calls are refused with UNAVAILABLE "draining".
    Closed,
}

/// What the sidecar's own `grpc.health.v1` service reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Health {
    /// SERVING: routers may send calls here.
    Serving,
    /// NOT_SERVING: starting, draining or lost.
    NotServing,
}

/// Severity of a line the core wants logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Level {
    /// Normal lifecycle progress.
    Info,
    /// Something an operator should look at; the sidecar copes.
    Warn,
    /// The engine is lost or start-up failed.
    Error,
}

/// Why the process ends; [`ExitReason::as_i32`] is the process exit code.
///
/// Named apart from `std::process::ExitCode`, which the binary returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExitReason {
    /// 0: shut down after a signal.
    Clean,
    /// 1: the engine was lost; the supervisor should restart the pod.
    EngineLost,
    /// 3: start-up did not complete before the startup deadline.
    StartupFailed,
}

impl ExitReason {
    /// The process exit status for this outcome.
    pub const fn as_i32(self) -> i32 {
        match self {
            ExitReason::Clean => 0,
            ExitReason::EngineLost => 1,
            ExitReason::StartupFailed => 3,
        }
    }
}

/// Something the IO layer must do.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// Write this worker's record to discovery. Answer with `Registered` or
    /// `RegistrationFailed`. Discovery actions run one at a time, in order.
    Register,
    /// Remove this worker's record from discovery. Answer with `Withdrawn` or `WithdrawFailed`.
    Withdraw,
    /// Open or close admission of new calls.
    SetAdmission(Admission),
    /// Set the sidecar's own health status.
    SetHealth(Health),
    /// Start the liveness Watch, the stale-load probe and the identity re-read.
    StartMonitors,
    /// Stop those monitors.
    StopMonitors,
    /// Write one log line, exactly this text, at this level.
    Log {
        /// Severity.
        level: Level,
        /// The line.
        message: String,
    },
    /// Reset every call still in flight (both sides see the stream end).
    CancelInFlight,
    /// The loss is withdrawn and drained (`--on-engine-loss rejoin`): forget
    /// the engine, wait for it again as at start-up (answer with
    /// `EngineReady`), and build the next record under this instance id.
    Rejoin {
        /// The new instance id (the last segment of the discovery key).
        instance_id: u64,
    },
    /// End the process with this code. Always the last action.
    Exit(ExitReason),
}
