//! What the admin server shows: the lifecycle's state and the sidecar's
//! counters. The driver writes it after every step ([`Shared::publish`]) and
//! for every event ([`Shared::note_event`]); the admin routes read it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use llm_sidecar_core::{
    DiscoveryEvent, EngineEvent, Event, Lifecycle, LivenessObservation, LossReason, Phase, Time,
};
use prometheus_client::metrics::histogram::Histogram;
use serde::Serialize;

/// Shared, cheap-to-lock status.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shared(Arc<Mutex<Status>>);

impl Shared {
    pub(crate) fn update(&self, f: impl FnOnce(&mut Status)) {
        let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard);
    }

    pub(crate) fn read<T>(&self, f: impl FnOnce(&Status) -> T) -> T {
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&guard)
    }

    /// Copies the lifecycle's state into the admin view after a step.
    /// `wall_origin` is the wall-clock instant of the core's time zero: one
    /// anchor, so a deadline that has not moved always shows the same instant.
    pub(crate) fn publish(
        &self,
        lifecycle: &Lifecycle,
        deadline: Option<(Time, &'static str)>,
        wall_origin: SystemTime,
        in_flight: u64,
    ) {
        let phase = lifecycle.phase();
        self.update(|s| {
            let name = phase.name();
            if s.state != name {
                s.since = Some(SystemTime::now());
                if let Some(loss) = lifecycle.loss() {
                    s.lost_at = Some((Instant::now(), loss.label()));
                    *s.losses.entry(loss.label()).or_default() += 1;
                }
                if phase == Phase::Serving && s.last_fresh_probe.is_none() {
                    s.last_fresh_probe = Some(Instant::now());
                }
            }
            s.state = name;
            s.reason = lifecycle.reason();
            s.in_flight = in_flight;
            s.deadline = deadline.map(|(at, why)| (wall_origin + at.since_origin(), why));
        });
    }

    /// Counts what an event tells before the core sees it.
    pub(crate) fn note_event(&self, event: &Event) {
        match event {
            Event::Engine(EngineEvent::Liveness(LivenessObservation::Status(raw))) => {
                self.update(|s| s.liveness_status = Some(*raw));
            }
            Event::Engine(EngineEvent::ProbeSucceeded) => {
                self.update(|s| s.last_fresh_probe = Some(Instant::now()))
            }
            Event::Engine(EngineEvent::LoadUnsupported { .. }) => {
                self.update(|s| s.load_unsupported = true)
            }
            Event::Discovery(DiscoveryEvent::Withdrawn) => self.update(|s| {
                if let Some((at, reason)) = s.lost_at.take() {
                    let took = at.elapsed();
                    s.loss_to_withdraw = Some(took);
                    s.times.withdrawal(reason).observe(took.as_secs_f64());
                }
            }),
            Event::Discovery(DiscoveryEvent::RegistrationFailed { .. })
            | Event::Discovery(DiscoveryEvent::WithdrawFailed { .. }) => {
                self.update(|s| s.discovery_write_failures += 1);
            }
            Event::Engine(EngineEvent::Ready { .. })
            | Event::Discovery(DiscoveryEvent::Registered)
            | Event::Discovery(DiscoveryEvent::RegistrationLost { .. })
            | Event::Engine(EngineEvent::Liveness(_))
            | Event::Engine(EngineEvent::ProbeFailed { .. })
            | Event::Engine(EngineEvent::IdentityObserved { .. })
            | Event::Engine(EngineEvent::ConnectionLost { .. })
            | Event::ShutdownSignal
            | Event::InFlightChanged { .. } => {}
        }
    }
}

/// The state and counters.
#[derive(Debug, Default)]
pub(crate) struct Status {
    pub(crate) live: bool,
    pub(crate) state: &'static str,
    pub(crate) since: Option<SystemTime>,
    pub(crate) reason: Option<String>,
    pub(crate) instance_id: String,
    pub(crate) engine_identity: Option<String>,
    pub(crate) record_location: Option<String>,
    pub(crate) in_flight: u64,
    pub(crate) liveness_status: Option<i32>,
    pub(crate) last_fresh_probe: Option<Instant>,
    /// The engine does not serve its load RPC: no stale-load rule, no probe age.
    pub(crate) load_unsupported: bool,
    pub(crate) losses: BTreeMap<&'static str, u64>,
    pub(crate) discovery_write_failures: u64,
    /// When the lifecycle accepted the last loss, and its reason label,
    /// until the withdrawal is confirmed.
    pub(crate) lost_at: Option<(Instant, &'static str)>,
    pub(crate) loss_to_withdraw: Option<Duration>,
    pub(crate) times: LifecycleTimes,
    /// The core's next deadline on the wall clock, and why: what the sidecar
    /// waits for ("router grace", "drain deadline", "startup deadline", …).
    pub(crate) deadline: Option<(SystemTime, &'static str)>,
}

/// Bucket bounds of `llm_sidecar_loss_to_withdraw_duration_seconds`: a file
/// record goes in a millisecond, an etcd key within a few, a slow or failing
/// discovery takes seconds.
const WITHDRAWAL_SECONDS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Bucket bounds of `llm_sidecar_drain_duration_seconds`: nothing in flight,
/// short calls, long generations up to the drain timeout.
const DRAIN_SECONDS: [f64; 12] = [
    0.001, 0.01, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The lifecycle's histograms: how long withdrawals and drains took.
#[derive(Debug)]
pub(crate) struct LifecycleTimes {
    /// Loss accepted → withdrawal confirmed, one histogram per loss reason,
    /// indexed like [`LossReason::LABELS`].
    pub(crate) withdrawal: [Histogram; LossReason::LABELS.len()],
    /// Admission closed → the last call gone (ended, or cut at the deadline).
    pub(crate) drain: Histogram,
}

impl Default for LifecycleTimes {
    fn default() -> Self {
        LifecycleTimes {
            withdrawal: std::array::from_fn(|_| Histogram::new(WITHDRAWAL_SECONDS)),
            drain: Histogram::new(DRAIN_SECONDS),
        }
    }
}

impl LifecycleTimes {
    /// The withdrawal histogram of a loss reason's label. Every label comes
    /// from `LossReason::label`, which takes it from `LABELS`: the lookup
    /// always finds it.
    fn withdrawal(&self, reason: &str) -> &Histogram {
        let index = LossReason::LABELS
            .iter()
            .position(|label| *label == reason)
            .unwrap_or_default();
        &self.withdrawal[index]
    }
}

#[derive(Serialize)]
struct StateJson<'a> {
    state: &'a str,
    since: Option<String>,
    reason: Option<&'a str>,
    instance_id: &'a str,
    engine_identity: Option<&'a str>,
    record: Option<&'a str>,
    in_flight: u64,
    deadline: Option<DeadlineJson<'a>>,
}

#[derive(Serialize)]
struct DeadlineJson<'a> {
    at: String,
    reason: &'a str,
}

impl Status {
    pub(crate) fn state_json(&self) -> String {
        let json = StateJson {
            state: self.state,
            since: self
                .since
                .map(|t| humantime::format_rfc3339_millis(t).to_string()),
            reason: self.reason.as_deref(),
            instance_id: &self.instance_id,
            engine_identity: self.engine_identity.as_deref(),
            record: self.record_location.as_deref(),
            in_flight: self.in_flight,
            deadline: self.deadline.map(|(at, reason)| DeadlineJson {
                at: humantime::format_rfc3339_millis(at).to_string(),
                reason,
            }),
        };
        serde_json::to_string_pretty(&json).unwrap_or_default() + "\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_shows_the_next_deadline_and_why() {
        let mut status = Status {
            state: "Draining",
            ..Status::default()
        };
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_055_170_123);
        status.deadline = Some((at, "router grace"));
        let json: serde_json::Value =
            serde_json::from_str(&status.state_json()).expect("state is JSON");
        assert_eq!(json["deadline"]["at"], "2026-11-30T16:12:50.123Z");
        assert_eq!(json["deadline"]["reason"], "router grace");
        status.deadline = None;
        let json: serde_json::Value =
            serde_json::from_str(&status.state_json()).expect("state is JSON");
        assert!(json["deadline"].is_null());
    }
}
