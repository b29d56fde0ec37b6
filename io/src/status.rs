//! What the admin server shows: the lifecycle's state and the sidecar's metrics.
//! The driver writes it after every step; the admin handlers read it.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

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

/// The kind of a loss reason, for the metric label.
pub(crate) fn loss_kind(reason: &str) -> &'static str {
    const KINDS: [(&str, &str); 7] = [
        ("liveness reported", "liveness_status"),
        ("liveness service deregistered", "liveness_deregistered"),
        ("liveness stream ended", "liveness_stream_ended"),
        ("liveness stream failed", "liveness_stream_failed"),
        ("liveness watch did not open", "liveness_not_opened"),
        ("routing load stale", "stale_load"),
        ("new engine identity", "identity_changed"),
    ];
    KINDS
        .iter()
        .find(|(p, _)| reason.starts_with(p))
        .map_or("other", |(_, k)| k)
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

    pub(crate) fn metrics(&self, proxy: &crate::proxy::ProxyMetrics, in_flight: u64) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let mut m = String::new();
        family(
            &mut m,
            "llm_sidecar_state",
            "gauge",
            "1 for the lifecycle state the sidecar is in.",
        );
        for s in ["Starting", "Serving", "Draining", "Lost", "Exited"] {
            let on = u8::from(self.state == s);
            let _ = writeln!(m, "llm_sidecar_state{{state=\"{s}\"}} {on}");
        }
        family(
            &mut m,
            "llm_sidecar_engine_losses_total",
            "counter",
            "Engine losses accepted while serving, by reason.",
        );
        for (kind, n) in &self.losses {
            let _ = writeln!(
                m,
                "llm_sidecar_engine_losses_total{{reason=\"{kind}\"}} {n}"
            );
        }
        family(
            &mut m,
            "llm_sidecar_liveness_watch_status",
            "gauge",
            "Last raw grpc.health.v1 status on the liveness Watch (-1: none yet).",
        );
        let status = self.liveness_status.unwrap_or(-1);
        let _ = writeln!(m, "llm_sidecar_liveness_watch_status {status}");
        family(
            &mut m,
            "llm_sidecar_probe_age_seconds",
            "gauge",
            "Seconds since the last fresh probe answer (-1: none yet).",
        );
        let age = self
            .last_fresh_probe
            .map_or(-1.0, |t| t.elapsed().as_secs_f64());
        let _ = writeln!(m, "llm_sidecar_probe_age_seconds {age:.3}");
        family(
            &mut m,
            "llm_sidecar_discovery_write_failures_total",
            "counter",
            "Discovery writes (register or withdraw) that failed.",
        );
        let failures = self.discovery_write_failures;
        let _ = writeln!(m, "llm_sidecar_discovery_write_failures_total {failures}");
        family(
            &mut m,
            "llm_sidecar_loss_to_withdraw_seconds",
            "gauge",
            "Time from the engine loss to the confirmed withdrawal (-1: no loss).",
        );
        let ltw = self.loss_to_withdraw.map_or(-1.0, |d| d.as_secs_f64());
        let _ = writeln!(m, "llm_sidecar_loss_to_withdraw_seconds {ltw:.6}");
        family(
            &mut m,
            "llm_sidecar_in_flight",
            "gauge",
            "Forwarded calls in flight.",
        );
        let _ = writeln!(m, "llm_sidecar_in_flight {in_flight}");
        family(
            &mut m,
            "llm_sidecar_calls_admitted_total",
            "counter",
            "Calls let through admission and forwarded.",
        );
        let admitted = proxy.admitted.load(Relaxed);
        let _ = writeln!(m, "llm_sidecar_calls_admitted_total {admitted}");
        family(
            &mut m,
            "llm_sidecar_calls_total",
            "counter",
            "Calls on the request plane that ended, by outcome.",
        );
        for outcome in crate::proxy::Outcome::ALL {
            let (label, n) = (outcome.label(), proxy.ended(outcome));
            let _ = writeln!(m, "llm_sidecar_calls_total{{outcome=\"{label}\"}} {n}");
        }
        family(
            &mut m,
            "llm_sidecar_forwarded_bytes_total",
            "counter",
            "Message bytes forwarded, by direction.",
        );
        for (direction, bytes) in [
            ("to_engine", &proxy.bytes_to_engine),
            ("to_caller", &proxy.bytes_to_caller),
        ] {
            let n = bytes.load(Relaxed);
            let _ = writeln!(
                m,
                "llm_sidecar_forwarded_bytes_total{{direction=\"{direction}\"}} {n}"
            );
        }
        m
    }
}

/// The `# HELP` and `# TYPE` lines that open one metric family.
fn family(m: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(m, "# HELP {name} {help}");
    let _ = writeln!(m, "# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_reasons_have_kinds() {
        assert_eq!(
            loss_kind("liveness reported NOT_SERVING"),
            "liveness_status"
        );
        assert_eq!(loss_kind("routing load stale for 30s"), "stale_load");
        assert_eq!(loss_kind("something new"), "other");
    }

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
