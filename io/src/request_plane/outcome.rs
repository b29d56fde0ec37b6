//! How each call on the request plane ended, and the counters and
//! histograms behind `/metrics` and the account logged at exit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;

/// The status message (UNAVAILABLE) of a call cut at the drain deadline, in
/// every front: the proxy's and a hosting system's (the Dynamo worker's).
/// Callers and routers read it as "retry elsewhere".
pub const CUT_MESSAGE: &str = "drain deadline reached; retry on another worker";

/// How a call on the request plane ended. Every call that reaches the proxy ends
/// in exactly one of these, so the sidecar's account reconciles with what the
/// callers and the engine saw (docs/RELIABILITY.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Forwarded; the engine ended it with OK.
    Ok,
    /// Forwarded; the engine ended it with a status of its own, passed unchanged.
    EngineStatus,
    /// Admission was closed: UNAVAILABLE "draining", never forwarded.
    Refused,
    /// The caller went away (cancel, reset) before the call ended.
    CancelledByCaller,
    /// Still running at the drain deadline: UNAVAILABLE to the caller, reset to the engine.
    CutAtDeadline,
    /// The caller's `grpc-timeout` passed: DEADLINE_EXCEEDED.
    DeadlineExceeded,
    /// A message above `--max-message-bytes`: RESOURCE_EXHAUSTED.
    TooLarge,
    /// The engine could not be reached: UNAVAILABLE, retryable elsewhere.
    EngineUnreachable,
    /// The engine connection broke mid-call: UNAVAILABLE, retryable elsewhere.
    EngineFailed,
    /// Not a gRPC call (a method other than POST, a path that names no
    /// method): INVALID_ARGUMENT, never forwarded, the caller's doing.
    Malformed,
}

impl CallOutcome {
    /// Every outcome, in the order the metrics and the exit account list them.
    pub(crate) const ALL: [CallOutcome; 10] = [
        CallOutcome::Ok,
        CallOutcome::EngineStatus,
        CallOutcome::Refused,
        CallOutcome::CancelledByCaller,
        CallOutcome::CutAtDeadline,
        CallOutcome::DeadlineExceeded,
        CallOutcome::TooLarge,
        CallOutcome::EngineUnreachable,
        CallOutcome::EngineFailed,
        CallOutcome::Malformed,
    ];

    /// The metric label and the key in the exit account.
    pub(crate) fn label(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::EngineStatus => "engine_status",
            CallOutcome::Refused => "refused",
            CallOutcome::CancelledByCaller => "cancelled_by_caller",
            CallOutcome::CutAtDeadline => "cut_at_deadline",
            CallOutcome::DeadlineExceeded => "deadline_exceeded",
            CallOutcome::TooLarge => "too_large",
            CallOutcome::EngineUnreachable => "engine_unreachable",
            CallOutcome::EngineFailed => "engine_failed",
            CallOutcome::Malformed => "malformed",
        }
    }

    /// The outcome a `grpc-status` value from the engine means.
    pub(crate) fn of_engine_status(value: Option<&http::HeaderValue>) -> CallOutcome {
        match value.map(http::HeaderValue::as_bytes) {
            Some(b"0") => CallOutcome::Ok,
            _ => CallOutcome::EngineStatus,
        }
    }
}

/// Bucket bounds of `llm_sidecar_call_duration_seconds`: a unary call takes
/// milliseconds, a long generation minutes.
const CALL_SECONDS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Bucket bounds of `llm_sidecar_call_first_message_seconds`: from a
/// millisecond (a warm engine on loopback) to half a minute (a long prompt
/// behind a queue).
const FIRST_MESSAGE_SECONDS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Counters and histograms of the request plane, for `/metrics` and the
/// account at exit.
#[derive(Debug)]
pub(crate) struct CallCounters {
    /// Calls let through the gate (forwarded or about to be).
    pub(crate) admitted: AtomicU64,
    /// Calls ended, indexed like [`CallOutcome::ALL`].
    ended: [AtomicU64; CallOutcome::ALL.len()],
    pub(crate) bytes_to_engine: AtomicU64,
    pub(crate) bytes_to_caller: AtomicU64,
    /// Streams of the sidecar's own health service open now.
    pub(crate) own_health_open: AtomicU64,
    /// Own-health streams refused: a connection or the sidecar had its most.
    pub(crate) own_health_refused: AtomicU64,
    /// Bytes of engine answers read and waiting for their callers' window.
    pub(crate) answer_bytes_held: AtomicU64,
    /// Engine streams given up before their answer began, kept until the
    /// engine takes them.
    pub(crate) unanswered: std::sync::Arc<super::unanswered_stream::UnansweredCounts>,
    /// Admitted calls' time from admission to their end, indexed like
    /// [`CallOutcome::ALL`]: one histogram per outcome, made at start, so a
    /// call's end touches no map.
    pub(crate) duration: [Histogram; CallOutcome::ALL.len()],
    /// Admitted calls' time from admission to the first response bytes passed
    /// on, indexed like [`CallOutcome::ALL`].
    pub(crate) first_message: [Histogram; CallOutcome::ALL.len()],
    /// Counters a host of the request plane (the Dynamo worker) adds to
    /// `/metrics`, listed after the request plane's own.
    pub(crate) host: HostCounters,
}

/// One counter of a host: its family name (without `_total`), its help, its
/// value.
pub(crate) type HostCounter = (&'static str, &'static str, Arc<AtomicU64>);

/// The counters a host added, in the order it added them.
#[derive(Debug, Default)]
pub(crate) struct HostCounters(Mutex<Vec<HostCounter>>);

impl HostCounters {
    /// The counter named `name`, added on first use (with `value`, else a
    /// new one at 0).
    pub(crate) fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        value: Option<Arc<AtomicU64>>,
    ) -> Arc<AtomicU64> {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, _, value)) = all.iter().find(|(n, _, _)| *n == name) {
            return value.clone();
        }
        let value = value.unwrap_or_default();
        all.push((name, help, value.clone()));
        value
    }

    /// Every counter's name, help and value now.
    pub(crate) fn read(&self) -> Vec<(&'static str, &'static str, u64)> {
        let all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        all.iter()
            .map(|(n, h, v)| (*n, *h, v.load(Ordering::Relaxed)))
            .collect()
    }
}

impl Default for CallCounters {
    fn default() -> Self {
        CallCounters {
            admitted: AtomicU64::default(),
            ended: Default::default(),
            bytes_to_engine: AtomicU64::default(),
            bytes_to_caller: AtomicU64::default(),
            own_health_open: AtomicU64::default(),
            own_health_refused: AtomicU64::default(),
            answer_bytes_held: AtomicU64::default(),
            unanswered: Default::default(),
            duration: std::array::from_fn(|_| Histogram::new(CALL_SECONDS)),
            first_message: std::array::from_fn(|_| Histogram::new(FIRST_MESSAGE_SECONDS)),
            host: HostCounters::default(),
        }
    }
}

impl CallCounters {
    pub(crate) fn record(&self, outcome: CallOutcome) {
        self.ended[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted call's times, at its end: how long it ran, and after how
    /// long its first response bytes went to the caller (`None`: none did).
    pub(crate) fn record_times(
        &self,
        outcome: CallOutcome,
        ran: Duration,
        first_message: Option<Duration>,
    ) {
        self.duration[outcome as usize].observe(ran.as_secs_f64());
        if let Some(first) = first_message {
            self.first_message[outcome as usize].observe(first.as_secs_f64());
        }
    }

    /// Calls that ended with `outcome` so far.
    pub(crate) fn ended(&self, outcome: CallOutcome) -> u64 {
        self.ended[outcome as usize].load(Ordering::Relaxed)
    }

    /// One line with every counter, `key=value`, for the log at exit: the
    /// sidecar's side of the reconciliation once its `/metrics` is gone.
    pub(crate) fn account(&self) -> String {
        let mut line = format!("admitted={}", self.admitted.load(Ordering::Relaxed));
        for outcome in CallOutcome::ALL {
            line.push_str(&format!(" {}={}", outcome.label(), self.ended(outcome)));
        }
        line
    }
}
