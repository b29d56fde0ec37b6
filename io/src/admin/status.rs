//! What the admin server shows: the lifecycle's state and the sidecar's
//! counters. The driver writes it after every step ([`Shared::publish`]) and
//! for every event ([`Shared::note_event`]); the admin routes read it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use llm_sidecar_core::{Event, Lifecycle, LivenessObservation, Phase, Time};
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
                    s.lost_at = Some(Instant::now());
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
            Event::Liveness(LivenessObservation::Status(raw)) => {
                self.update(|s| s.liveness_status = Some(*raw));
            }
            Event::ProbeSucceeded => self.update(|s| s.last_fresh_probe = Some(Instant::now())),
            Event::Withdrawn => self.update(|s| {
                if let Some(at) = s.lost_at.take() {
                    s.loss_to_withdraw = Some(at.elapsed());
                }
            }),
            Event::RegistrationFailed { .. } | Event::WithdrawFailed { .. } => {
                self.update(|s| s.discovery_write_failures += 1);
            }
            Event::EngineReady { .. }
            | Event::Registered
            | Event::RegistrationLost { .. }
            | Event::Liveness(_)
            | Event::ProbeFailed { .. }
            | Event::IdentityObserved { .. }
            | Event::EngineConnectionLost { .. }
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
    pub(crate) losses: BTreeMap<&'static str, u64>,
    pub(crate) discovery_write_failures: u64,
    pub(crate) lost_at: Option<Instant>,
    pub(crate) loss_to_withdraw: Option<Duration>,
    /// The core's next deadline on the wall clock, and why: what the sidecar
    /// waits for ("router grace", "drain deadline", "startup deadline", …).
    pub(crate) deadline: Option<(SystemTime, &'static str)>,
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
            since: self.since.map(crate::timefmt::rfc3339),
            reason: self.reason.as_deref(),
            instance_id: &self.instance_id,
            engine_identity: self.engine_identity.as_deref(),
            record: self.record_location.as_deref(),
            in_flight: self.in_flight,
            deadline: self.deadline.map(|(at, reason)| DeadlineJson {
                at: crate::timefmt::rfc3339(at),
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
