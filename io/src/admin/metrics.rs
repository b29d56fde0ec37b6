//! `/metrics`: one family per quantity an operator alerts on, rendered by
//! `prometheus-client` in the Prometheus text format (0.0.4) or, for a
//! scraper that asks for it, in OpenMetrics.
//!
//! Each scrape takes a [`Snapshot`] of the values (under the status lock, so
//! they agree with each other) and hands it to a fresh registry as its one
//! collector: the families come out in the order written here, every time,
//! which a person reading the page and the tests both rely on.

use std::sync::atomic::Ordering::Relaxed;

use llm_sidecar_core::LossReason;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::status::Status;
use crate::request_plane::{CallCounters, CallOutcome};

/// How `/metrics` is written, chosen by the scraper's `Accept` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// The Prometheus text format 0.0.4: what every scraper reads.
    Prometheus,
    /// OpenMetrics 1.0 text, for a scraper that asks for it.
    OpenMetrics,
}

impl Format {
    /// OpenMetrics when the `Accept` header names it, else Prometheus text.
    pub(crate) fn from_accept(accept: &str) -> Format {
        if accept.contains("application/openmetrics-text") {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// The values of one scrape.
#[derive(Debug)]
pub(crate) struct Snapshot {
    state: &'static str,
    losses: Vec<(&'static str, u64)>,
    liveness_status: i64,
    probe_age: f64,
    stale_load_rule: i64,
    own_health: (u64, u64),
    answer_bytes_held: u64,
    /// Engine streams waiting for the engine's answer before their reset, and
    /// those reset after the wait without one.
    unanswered: (u64, u64),
    discovery_write_failures: u64,
    loss_to_withdraw: f64,
    in_flight: u64,
    admitted: u64,
    ended: [u64; CallOutcome::ALL.len()],
    connections_open: u64,
    connections_refused: u64,
    bytes: [u64; 2],
    /// The histograms share their counts with the live ones (a clone of a
    /// `Histogram` is a handle on the same buckets).
    withdrawal: [Histogram; LossReason::LABELS.len()],
    drain: Histogram,
    duration: [Histogram; CallOutcome::ALL.len()],
    first_message: [Histogram; CallOutcome::ALL.len()],
    /// The host's own counters (name, help, value).
    host: Vec<(&'static str, &'static str, u64)>,
}

impl Snapshot {
    /// The lifecycle's view from `status`, the request plane's counters from
    /// `calls`, its calls in flight and its caller connections (open, refused).
    pub(crate) fn take(
        status: &Status,
        calls: &CallCounters,
        in_flight: u64,
        connections: (usize, u64),
    ) -> Snapshot {
        Snapshot {
            state: status.state,
            losses: status.losses.iter().map(|(k, n)| (*k, *n)).collect(),
            liveness_status: status.liveness_status.map_or(-1, i64::from),
            probe_age: status
                .last_fresh_probe
                .filter(|_| !status.load_unsupported)
                .map_or(-1.0, |t| t.elapsed().as_secs_f64()),
            stale_load_rule: i64::from(!status.load_unsupported),
            own_health: (
                calls.own_health_open.load(Relaxed),
                calls.own_health_refused.load(Relaxed),
            ),
            answer_bytes_held: calls.answer_bytes_held.load(Relaxed),
            unanswered: (
                calls.unanswered.waiting.load(Relaxed),
                calls.unanswered.reset_after_wait.load(Relaxed),
            ),
            discovery_write_failures: status.discovery_write_failures,
            loss_to_withdraw: status.loss_to_withdraw.map_or(-1.0, |d| d.as_secs_f64()),
            in_flight,
            admitted: calls.admitted.load(Relaxed),
            ended: CallOutcome::ALL.map(|o| calls.ended(o)),
            connections_open: connections.0 as u64,
            connections_refused: connections.1,
            bytes: [
                calls.bytes_to_engine.load(Relaxed),
                calls.bytes_to_caller.load(Relaxed),
            ],
            withdrawal: status.times.withdrawal.clone(),
            drain: status.times.drain.clone(),
            duration: calls.duration.clone(),
            first_message: calls.first_message.clone(),
            host: calls.host.read(),
        }
    }

    /// The page, in `format`.
    pub(crate) fn render(self, format: Format) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self));
        let mut text = String::new();
        // Writing to a String fails only if an encoder refuses a value, and
        // none of ours is one it refuses (no native-only histogram).
        let _ = match format {
            Format::Prometheus => {
                prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
            }
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut text, &registry),
        };
        text
    }
}

/// A label set of one label.
type Label = [(&'static str, &'static str); 1];

impl Collector for Snapshot {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.encode_lifecycle(&mut e)?;
        self.encode_request_plane(&mut e)?;
        for (name, help, value) in &self.host {
            one(&mut e, name, help, ConstCounter::new(*value))?;
        }
        Ok(())
    }
}

impl Snapshot {
    /// The lifecycle's families: state, losses, liveness, probe, discovery,
    /// withdrawal.
    fn encode_lifecycle(&self, e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let states = ["Starting", "Serving", "Draining", "Lost", "Exited"]
            .map(|s| (s, ConstGauge::new(i64::from(self.state == s))));
        labelled(
            e,
            ("llm_sidecar_state", "state"),
            "1 for the lifecycle state the sidecar is in.",
            states,
        )?;
        labelled(
            e,
            ("llm_sidecar_engine_losses", "reason"),
            "Engine losses accepted while serving, by reason.",
            self.losses.iter().map(|(k, n)| (*k, ConstCounter::new(*n))),
        )?;
        one(
            e,
            "llm_sidecar_liveness_watch_status",
            "Last raw grpc.health.v1 status on the liveness Watch (-1: none yet).",
            ConstGauge::new(self.liveness_status),
        )?;
        one(
            e,
            "llm_sidecar_probe_age_seconds",
            "Seconds since the last fresh probe answer (-1: none yet, or the engine has no \
             load RPC).",
            ConstGauge::new(self.probe_age),
        )?;
        one(
            e,
            "llm_sidecar_stale_load_rule",
            "1 while the stale-load rule applies; 0 once the engine said it does not serve \
             its load RPC (its connection is followed instead).",
            ConstGauge::new(self.stale_load_rule),
        )?;
        one(
            e,
            "llm_sidecar_discovery_write_failures",
            "Discovery writes (register or withdraw) that failed.",
            ConstCounter::new(self.discovery_write_failures),
        )?;
        one(
            e,
            "llm_sidecar_loss_to_withdraw_seconds",
            "Time from the engine loss to the confirmed withdrawal (-1: no loss).",
            ConstGauge::new(self.loss_to_withdraw),
        )?;
        labelled(
            e,
            ("llm_sidecar_loss_to_withdraw_duration_seconds", "reason"),
            "Time from an engine loss the lifecycle accepted to the confirmed withdrawal, by \
             loss reason.",
            LossReason::LABELS
                .into_iter()
                .zip(self.withdrawal.iter().cloned()),
        )
    }

    /// The request plane's families: calls, their times, the drain,
    /// connections, bytes.
    fn encode_request_plane(&self, e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        one(
            e,
            "llm_sidecar_in_flight",
            "Forwarded calls in flight.",
            ConstGauge::new(self.in_flight),
        )?;
        one(
            e,
            "llm_sidecar_calls_admitted",
            "Calls let through admission and forwarded.",
            ConstCounter::new(self.admitted),
        )?;
        one(
            e,
            "llm_sidecar_own_health_streams",
            "Streams of the sidecar's own grpc.health.v1 open now (at most 16 per caller \
             connection, 1024 in all).",
            ConstGauge::new(self.own_health.0),
        )?;
        one(
            e,
            "llm_sidecar_own_health_streams_refused",
            "Own grpc.health.v1 streams refused RESOURCE_EXHAUSTED: their connection or the \
             sidecar held its most.",
            ConstCounter::new(self.own_health.1),
        )?;
        one(
            e,
            "llm_sidecar_answer_bytes_held",
            "Bytes of engine answers the sidecar holds for callers whose window is closed \
             (at most 64 KiB per call): high and flat means callers that do not read.",
            ConstGauge::new(self.answer_bytes_held),
        )?;
        one(
            e,
            "llm_sidecar_engine_streams_awaiting_reset",
            "Engine streams of calls that ended before the engine answered, kept until it \
             does (1 s at most) so that it never gets a reset for a stream it has not taken.",
            ConstGauge::new(self.unanswered.0),
        )?;
        one(
            e,
            "llm_sidecar_engine_streams_reset_unanswered",
            "Engine streams reset after waiting 1 s for an answer that never began: a \
             caller's cancel reached the engine that late.",
            ConstCounter::new(self.unanswered.1),
        )?;
        let outcomes = CallOutcome::ALL.map(CallOutcome::label);
        labelled(
            e,
            ("llm_sidecar_calls", "outcome"),
            "Calls on the request plane that ended, by outcome.",
            outcomes.into_iter().zip(self.ended.map(ConstCounter::new)),
        )?;
        labelled(
            e,
            ("llm_sidecar_call_duration_seconds", "outcome"),
            "Admitted calls' time from admission to their end, by outcome.",
            outcomes.into_iter().zip(self.duration.iter().cloned()),
        )?;
        labelled(
            e,
            ("llm_sidecar_call_first_message_seconds", "outcome"),
            "Admitted calls' time from admission to the first response bytes passed to the \
             caller, by outcome (calls that passed none are not counted).",
            outcomes.into_iter().zip(self.first_message.iter().cloned()),
        )?;
        one(
            e,
            "llm_sidecar_drain_duration_seconds",
            "Time from admission closing to the last call gone (ended or cut at the deadline).",
            self.drain.clone(),
        )?;
        one(
            e,
            "llm_sidecar_caller_connections",
            "Caller connections open on the request plane.",
            ConstGauge::new(self.connections_open),
        )?;
        one(
            e,
            "llm_sidecar_caller_connections_refused",
            "Caller connections closed at once because --max-connections were open.",
            ConstCounter::new(self.connections_refused),
        )?;
        labelled(
            e,
            ("llm_sidecar_forwarded_bytes", "direction"),
            "Message bytes forwarded, by direction.",
            [
                ("to_engine", ConstCounter::new(self.bytes[0])),
                ("to_caller", ConstCounter::new(self.bytes[1])),
            ],
        )
    }
}

/// A family of one sample. Counters are named without `_total`: the encoder
/// adds it.
fn one(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    let family = e.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(family)
}

/// A family with one sample per value of one label: `(name, label)`.
fn labelled<M: EncodeMetric>(
    e: &mut DescriptorEncoder,
    (name, label): (&str, &'static str),
    help: &str,
    samples: impl IntoIterator<Item = (&'static str, M)>,
) -> Result<(), std::fmt::Error> {
    let mut samples = samples.into_iter().peekable();
    let kind = samples
        .peek()
        .map_or(MetricType::Counter, |(_, m)| m.metric_type());
    let mut family = e.encode_descriptor(name, help, None, kind)?;
    for (value, metric) in samples {
        let labels: Label = [(label, value)];
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn snapshot() -> Snapshot {
        let mut status = Status {
            state: "Serving",
            liveness_status: Some(1),
            ..Status::default()
        };
        status.losses.insert("stale_load", 2);
        let calls = CallCounters::default();
        calls.record(CallOutcome::Ok);
        calls.record_times(
            CallOutcome::Ok,
            Duration::from_millis(300),
            Some(Duration::from_millis(20)),
        );
        status.times.drain.observe(0.5);
        Snapshot::take(&status, &calls, 3, (2, 1))
    }

    /// Every family the page had before the histograms, sample for sample,
    /// in the Prometheus text format.
    #[test]
    fn the_counters_and_gauges_keep_their_names_and_samples() {
        let text = snapshot().render(Format::Prometheus);
        let expected = [
            "# HELP llm_sidecar_state 1 for the lifecycle state the sidecar is in.",
            "# TYPE llm_sidecar_state gauge",
            "llm_sidecar_state{state=\"Starting\"} 0",
            "llm_sidecar_state{state=\"Serving\"} 1",
            "llm_sidecar_state{state=\"Exited\"} 0",
            "# TYPE llm_sidecar_engine_losses_total counter",
            "llm_sidecar_engine_losses_total{reason=\"stale_load\"} 2",
            "llm_sidecar_liveness_watch_status 1",
            "llm_sidecar_probe_age_seconds -1",
            "# TYPE llm_sidecar_discovery_write_failures_total counter",
            "llm_sidecar_discovery_write_failures_total 0",
            "llm_sidecar_loss_to_withdraw_seconds -1",
            "llm_sidecar_in_flight 3",
            "llm_sidecar_calls_admitted_total 0",
            "llm_sidecar_calls_total{outcome=\"ok\"} 1",
            "llm_sidecar_calls_total{outcome=\"engine_failed\"} 0",
            "llm_sidecar_caller_connections 2",
            "llm_sidecar_caller_connections_refused_total 1",
            "llm_sidecar_forwarded_bytes_total{direction=\"to_engine\"} 0",
            "llm_sidecar_forwarded_bytes_total{direction=\"to_caller\"} 0",
        ];
        for line in expected {
            assert!(
                text.lines()
                    .any(|l| l == line || l.starts_with(&format!("{line}."))),
                "missing {line:?} in:\n{text}"
            );
        }
    }

    #[test]
    fn the_histograms_count_what_was_observed() {
        let text = snapshot().render(Format::Prometheus);
        for line in [
            "# TYPE llm_sidecar_call_duration_seconds histogram",
            "llm_sidecar_call_duration_seconds_bucket{outcome=\"ok\",le=\"0.25\"} 0",
            "llm_sidecar_call_duration_seconds_bucket{outcome=\"ok\",le=\"0.5\"} 1",
            "llm_sidecar_call_duration_seconds_count{outcome=\"ok\"} 1",
            "llm_sidecar_call_duration_seconds_count{outcome=\"refused\"} 0",
            "llm_sidecar_call_first_message_seconds_bucket{outcome=\"ok\",le=\"0.025\"} 1",
            "llm_sidecar_drain_duration_seconds_count 1",
            "llm_sidecar_loss_to_withdraw_duration_seconds_count{reason=\"stale_load\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
    }

    #[test]
    fn a_hosts_counters_follow_the_request_planes_once_each_with_their_values() {
        let calls = CallCounters::default();
        let events = calls.host.counter("host_events_dropped", "Dropped.", None);
        let kept = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(7));
        calls
            .host
            .counter("host_accept_failures", "Failed.", Some(kept.clone()));
        let again = calls
            .host
            .counter("host_events_dropped", "Other help.", None);
        events.fetch_add(2, Relaxed);
        again.fetch_add(1, Relaxed);
        kept.fetch_add(1, Relaxed);
        let text = Snapshot::take(&Status::default(), &calls, 0, (0, 0)).render(Format::Prometheus);
        let forwarded = text
            .find("llm_sidecar_forwarded_bytes")
            .expect("the plane's last");
        let dropped = text.find("host_events_dropped_total 3").expect(&text);
        assert!(forwarded < dropped, "after the request plane's families");
        assert!(
            text.contains("# HELP host_events_dropped_total Dropped."),
            "{text}"
        );
        assert!(text.contains("host_accept_failures_total 8"), "{text}");
        assert_eq!(text.matches("# TYPE host_events_dropped_total").count(), 1);
    }

    #[test]
    fn openmetrics_when_asked_for() {
        let format = Format::from_accept(
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        );
        assert_eq!(format, Format::OpenMetrics);
        assert_eq!(Format::from_accept("*/*"), Format::Prometheus);
        let text = snapshot().render(format);
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(
            text.contains("# TYPE llm_sidecar_calls counter\n"),
            "{text}"
        );
        assert!(
            text.contains("llm_sidecar_calls_total{outcome=\"ok\"} 1\n"),
            "{text}"
        );
    }
}
