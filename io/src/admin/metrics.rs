//! `/metrics`: Prometheus text, one family per quantity an operator alerts on.

use std::fmt::{Display, Write};
use std::sync::atomic::Ordering::Relaxed;

use super::status::Status;
use crate::request_plane::{CallCounters, CallOutcome};

/// The Prometheus text of `/metrics`: the lifecycle's view from `status`, the
/// request plane's counters from `calls`, and its caller connections (open,
/// refused).
pub(crate) fn render(
    status: &Status,
    calls: &CallCounters,
    in_flight: u64,
    connections: (usize, u64),
) -> String {
    let mut m = String::new();
    let states = ["Starting", "Serving", "Draining", "Lost", "Exited"]
        .map(|s| (s, u8::from(status.state == s)));
    labelled(
        &mut m,
        ("llm_sidecar_state", "gauge", "state"),
        "1 for the lifecycle state the sidecar is in.",
        states,
    );
    labelled(
        &mut m,
        ("llm_sidecar_engine_losses_total", "counter", "reason"),
        "Engine losses accepted while serving, by reason.",
        status.losses.iter().map(|(kind, n)| (*kind, *n)),
    );
    scalar(
        &mut m,
        ("llm_sidecar_liveness_watch_status", "gauge"),
        "Last raw grpc.health.v1 status on the liveness Watch (-1: none yet).",
        status.liveness_status.unwrap_or(-1),
    );
    let age = status
        .last_fresh_probe
        .map_or(-1.0, |t| t.elapsed().as_secs_f64());
    scalar(
        &mut m,
        ("llm_sidecar_probe_age_seconds", "gauge"),
        "Seconds since the last fresh probe answer (-1: none yet).",
        format!("{age:.3}"),
    );
    scalar(
        &mut m,
        ("llm_sidecar_discovery_write_failures_total", "counter"),
        "Discovery writes (register or withdraw) that failed.",
        status.discovery_write_failures,
    );
    let to_withdraw = status.loss_to_withdraw.map_or(-1.0, |d| d.as_secs_f64());
    scalar(
        &mut m,
        ("llm_sidecar_loss_to_withdraw_seconds", "gauge"),
        "Time from the engine loss to the confirmed withdrawal (-1: no loss).",
        format!("{to_withdraw:.6}"),
    );
    scalar(
        &mut m,
        ("llm_sidecar_in_flight", "gauge"),
        "Forwarded calls in flight.",
        in_flight,
    );
    scalar(
        &mut m,
        ("llm_sidecar_calls_admitted_total", "counter"),
        "Calls let through admission and forwarded.",
        calls.admitted.load(Relaxed),
    );
    labelled(
        &mut m,
        ("llm_sidecar_calls_total", "counter", "outcome"),
        "Calls on the request plane that ended, by outcome.",
        CallOutcome::ALL.map(|o| (o.label(), calls.ended(o))),
    );
    scalar(
        &mut m,
        ("llm_sidecar_caller_connections", "gauge"),
        "Caller connections open on the request plane.",
        connections.0,
    );
    scalar(
        &mut m,
        ("llm_sidecar_caller_connections_refused_total", "counter"),
        "Caller connections closed at once because --max-connections were open.",
        connections.1,
    );
    labelled(
        &mut m,
        ("llm_sidecar_forwarded_bytes_total", "counter", "direction"),
        "Message bytes forwarded, by direction.",
        [
            ("to_engine", calls.bytes_to_engine.load(Relaxed)),
            ("to_caller", calls.bytes_to_caller.load(Relaxed)),
        ],
    );
    m
}

/// A family of one sample: `(name, type)`, its help line, its value.
fn scalar(m: &mut String, (name, kind): (&str, &str), help: &str, value: impl Display) {
    family(m, name, kind, help);
    let _ = writeln!(m, "{name} {value}");
}

/// A family with one sample per value of one label: `(name, type, label)`.
fn labelled<V: Display>(
    m: &mut String,
    (name, kind, label): (&str, &str, &str),
    help: &str,
    samples: impl IntoIterator<Item = (&'static str, V)>,
) {
    family(m, name, kind, help);
    for (value, n) in samples {
        let _ = writeln!(m, "{name}{{{label}=\"{value}\"}} {n}");
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

    /// The whole text, family by family.
    #[test]
    fn the_text_is_exactly_the_documented_families() {
        let mut status = Status {
            state: "Serving",
            liveness_status: Some(1),
            ..Status::default()
        };
        status.losses.insert("stale_load", 2);
        let calls = CallCounters::default();
        calls.record(CallOutcome::Ok);
        let text = render(&status, &calls, 3, (2, 1));
        let expected = "\
# HELP llm_sidecar_state 1 for the lifecycle state the sidecar is in.
# TYPE llm_sidecar_state gauge
llm_sidecar_state{state=\"Starting\"} 0
llm_sidecar_state{state=\"Serving\"} 1
llm_sidecar_state{state=\"Draining\"} 0
llm_sidecar_state{state=\"Lost\"} 0
llm_sidecar_state{state=\"Exited\"} 0
# HELP llm_sidecar_engine_losses_total Engine losses accepted while serving, by reason.
# TYPE llm_sidecar_engine_losses_total counter
llm_sidecar_engine_losses_total{reason=\"stale_load\"} 2
# HELP llm_sidecar_liveness_watch_status Last raw grpc.health.v1 status on the liveness Watch (-1: none yet).
# TYPE llm_sidecar_liveness_watch_status gauge
llm_sidecar_liveness_watch_status 1
# HELP llm_sidecar_probe_age_seconds Seconds since the last fresh probe answer (-1: none yet).
# TYPE llm_sidecar_probe_age_seconds gauge
llm_sidecar_probe_age_seconds -1.000
# HELP llm_sidecar_discovery_write_failures_total Discovery writes (register or withdraw) that failed.
# TYPE llm_sidecar_discovery_write_failures_total counter
llm_sidecar_discovery_write_failures_total 0
# HELP llm_sidecar_loss_to_withdraw_seconds Time from the engine loss to the confirmed withdrawal (-1: no loss).
# TYPE llm_sidecar_loss_to_withdraw_seconds gauge
llm_sidecar_loss_to_withdraw_seconds -1.000000
# HELP llm_sidecar_in_flight Forwarded calls in flight.
# TYPE llm_sidecar_in_flight gauge
llm_sidecar_in_flight 3
# HELP llm_sidecar_calls_admitted_total Calls let through admission and forwarded.
# TYPE llm_sidecar_calls_admitted_total counter
llm_sidecar_calls_admitted_total 0
# HELP llm_sidecar_calls_total Calls on the request plane that ended, by outcome.
# TYPE llm_sidecar_calls_total counter
llm_sidecar_calls_total{outcome=\"ok\"} 1
llm_sidecar_calls_total{outcome=\"engine_status\"} 0
llm_sidecar_calls_total{outcome=\"refused\"} 0
llm_sidecar_calls_total{outcome=\"cancelled_by_caller\"} 0
llm_sidecar_calls_total{outcome=\"cut_at_deadline\"} 0
llm_sidecar_calls_total{outcome=\"deadline_exceeded\"} 0
llm_sidecar_calls_total{outcome=\"too_large\"} 0
llm_sidecar_calls_total{outcome=\"engine_unreachable\"} 0
llm_sidecar_calls_total{outcome=\"engine_failed\"} 0
# HELP llm_sidecar_caller_connections Caller connections open on the request plane.
# TYPE llm_sidecar_caller_connections gauge
llm_sidecar_caller_connections 2
# HELP llm_sidecar_caller_connections_refused_total Caller connections closed at once because --max-connections were open.
# TYPE llm_sidecar_caller_connections_refused_total counter
llm_sidecar_caller_connections_refused_total 1
# HELP llm_sidecar_forwarded_bytes_total Message bytes forwarded, by direction.
# TYPE llm_sidecar_forwarded_bytes_total counter
llm_sidecar_forwarded_bytes_total{direction=\"to_engine\"} 0
llm_sidecar_forwarded_bytes_total{direction=\"to_caller\"} 0
";
        assert_eq!(text, expected);
    }
}
