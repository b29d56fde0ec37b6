//! A call let through the gate, whatever request plane it came on: it counts as
//! in flight until it is dropped, and records exactly one outcome then.
//!
//! The gRPC proxy wraps one in every forwarded call; a request plane that lives
//! outside this crate (Dynamo's, in `llm-sidecar-dynamo`) admits its calls
//! through [`HostedCalls`], so the core's drain, the drain-deadline cut and the
//! call account work the same for both.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio_util::sync::CancellationToken;

use super::Plane;
use super::outcome::CallOutcome;

/// One admitted call. Dropping it leaves the gate and records the outcome set
/// last, or [`CallOutcome::CancelledByCaller`] when none was set: a call
/// dropped half-way is one whose caller went away.
pub struct Admitted {
    plane: Arc<Plane>,
    outcome: Option<CallOutcome>,
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
        })
    }

    /// How the call ended (the last one set counts).
    pub fn set_outcome(&mut self, outcome: CallOutcome) {
        self.outcome = Some(outcome);
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
        self.plane
            .counters
            .record(self.outcome.unwrap_or(CallOutcome::CancelledByCaller));
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
}
