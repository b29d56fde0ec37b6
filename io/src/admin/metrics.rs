//! `/metrics`: Prometheus text, one family per quantity an operator alerts on.

use std::fmt::Write;

use super::status::Status;
use crate::request_plane::{CallCounters, CallOutcome};

/// The Prometheus text of `/metrics`: the lifecycle's view from `status`, the
/// request plane's counters from `calls`.
pub(crate) fn render(status: &Status, calls: &CallCounters, in_flight: u64) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let mut m = String::new();
    family(
        &mut m,
        "llm_sidecar_state",
        "gauge",
        "1 for the lifecycle state the sidecar is in.",
    );
    for s in ["Starting", "Serving", "Draining", "Lost", "Exited"] {
        let on = u8::from(status.state == s);
        let _ = writeln!(m, "llm_sidecar_state{{state=\"{s}\"}} {on}");
    }
    family(
        &mut m,
        "llm_sidecar_engine_losses_total",
        "counter",
        "Engine losses accepted while serving, by reason.",
    );
    for (kind, n) in &status.losses {
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
    let watch_status = status.liveness_status.unwrap_or(-1);
    let _ = writeln!(m, "llm_sidecar_liveness_watch_status {watch_status}");
    family(
        &mut m,
        "llm_sidecar_probe_age_seconds",
        "gauge",
        "Seconds since the last fresh probe answer (-1: none yet).",
    );
    let age = status
        .last_fresh_probe
        .map_or(-1.0, |t| t.elapsed().as_secs_f64());
    let _ = writeln!(m, "llm_sidecar_probe_age_seconds {age:.3}");
    family(
        &mut m,
        "llm_sidecar_discovery_write_failures_total",
        "counter",
        "Discovery writes (register or withdraw) that failed.",
    );
    let failures = status.discovery_write_failures;
    let _ = writeln!(m, "llm_sidecar_discovery_write_failures_total {failures}");
    family(
        &mut m,
        "llm_sidecar_loss_to_withdraw_seconds",
        "gauge",
        "Time from the engine loss to the confirmed withdrawal (-1: no loss).",
    );
    let ltw = status.loss_to_withdraw.map_or(-1.0, |d| d.as_secs_f64());
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
    let admitted = calls.admitted.load(Relaxed);
    let _ = writeln!(m, "llm_sidecar_calls_admitted_total {admitted}");
    family(
        &mut m,
        "llm_sidecar_calls_total",
        "counter",
        "Calls on the request plane that ended, by outcome.",
    );
    for outcome in CallOutcome::ALL {
        let (label, n) = (outcome.label(), calls.ended(outcome));
        let _ = writeln!(m, "llm_sidecar_calls_total{{outcome=\"{label}\"}} {n}");
    }
    family(
        &mut m,
        "llm_sidecar_forwarded_bytes_total",
        "counter",
        "Message bytes forwarded, by direction.",
    );
    for (direction, bytes) in [
        ("to_engine", &calls.bytes_to_engine),
        ("to_caller", &calls.bytes_to_caller),
    ] {
        let n = bytes.load(Relaxed);
        let _ = writeln!(
            m,
            "llm_sidecar_forwarded_bytes_total{{direction=\"{direction}\"}} {n}"
        );
    }
    m
}

/// The `# HELP` and `# TYPE` lines that open one metric family.
fn family(m: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(m, "# HELP {name} {help}");
    let _ = writeln!(m, "# TYPE {name} {kind}");
}
