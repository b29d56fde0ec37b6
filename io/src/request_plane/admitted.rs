//! A call let through the gate, whatever request plane it came on: it counts as
//! in flight until it is dropped, and records exactly one outcome then.
//!
//! The gRPC proxy wraps one in every forwarded call; a request plane that lives
//! outside this crate (Dynamo's, in `llm-sidecar-dynamo`) admits its calls
//! through [`HostedCalls`], so the core's drain, the drain-deadline cut and the
//! call account work the same for both.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Plane;
use super::outcome::CallOutcome;

/// One admitted call. Dropping it leaves the gate and records the outcome set
/// last, or [`CallOutcome::CancelledByCaller`] when none was set: a call
/// dropped half-way is one whose caller went away.
pub struct Admitted {
    plane: Arc<Plane>,
    outcome: Option<CallOutcome>,
    /// When the call was let in: the start of its duration.
    admitted_at: Instant,
    /// How long after that its first response bytes went to the caller.
    first_message: Option<Duration>,
}

impl Admitted {
    /// Lets a call in if the gate is open; a refused call is counted as such.
    pub(crate) fn try_new(plane: &Arc<Plane>) -> Option<Admitted> {
        if !plane.gate.try_enter() {
            plane.counters.record(CallOutcome::Refused);
            return None;
        }
        plane.counters.admitted.fetch_add(1, Ordering::Relaxed);
        Some(Admitted {
            plane: plane.clone(),
            outcome: None,
            admitted_at: Instant::now(),
            first_message: None,
        })
    }

    /// How the call ended (the last one set counts).
    pub fn set_outcome(&mut self, outcome: CallOutcome) {
        self.outcome = Some(outcome);
    }

    /// The first response message is on its way to the caller (the first
    /// call counts; later ones change nothing).
    pub fn first_message_sent(&mut self) {
        if self.first_message.is_none() {
            self.first_message = Some(self.admitted_at.elapsed());
        }
    }

    /// Fires at this instance's drain deadline: the call must end at once.
    pub fn cut(&self) -> CancellationToken {
        self.plane.cut_token()
    }

    pub(crate) fn plane(&self) -> &Arc<Plane> {
        &self.plane
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or(CallOutcome::CancelledByCaller);
        let counters = &self.plane.counters;
        counters.record(outcome);
        counters.record_times(outcome, self.admitted_at.elapsed(), self.first_message);
        if self.plane.gate.leave().drained {
            self.plane.drained.notify_one();
        }
    }
}

/// Admission for calls that arrive on someone else's request plane.
#[derive(Clone)]
pub struct HostedCalls {
    pub(crate) plane: Arc<Plane>,
}

impl HostedCalls {
    /// Lets one call in, or `None` while admission is closed (the caller
    /// should be told to retry on another worker).
    pub fn admit(&self) -> Option<Admitted> {
        Admitted::try_new(&self.plane)
    }

    /// A counter of the host's own on the admin port's `/metrics` (family
    /// `name`, which the page lists as `name_total`), added on first use; the
    /// same counter for the same name.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
    ) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.plane.counters.host.counter(name, help, None)
    }

    /// Lists a counter the host keeps itself (one made before the request
    /// plane, such as a log throttle's) on `/metrics` as `name`.
    pub fn expose_counter(
        &self,
        name: &'static str,
        help: &'static str,
        value: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) {
        self.plane.counters.host.counter(name, help, Some(value));
    }
}
