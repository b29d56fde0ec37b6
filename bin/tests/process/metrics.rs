//! `/metrics` as a scraper reads it: after a fault run (calls, an engine
//! loss, its withdrawal and drain), the page parses with the Prometheus
//! project's own parsers, in both formats it is served in, and its
//! histograms count what happened.

use std::process::Command;

use crate::support::*;

/// Both scrapes, parsed (`clients/scrape_metrics.py`).
fn scrape(admin: std::net::SocketAddr) -> serde_json::Value {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/process/clients/scrape_metrics.py"
    );
    let out = Command::new("python3")
        .args([script, &admin.to_string()])
        .output()
        .expect("run python3 (scripts/test.sh installs prometheus-client)");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "the parsers refused /metrics or did not run: {e}: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn metrics_after_a_fault_run_parse_in_both_formats_and_count_calls_withdrawal_and_drain() {
    let dir = TempDir::new("metrics");
    let grpc = free_addr();
    let engine = Mock::start(&dir.0, grpc, &["--token-delay", "2ms"]);
    let mut sidecar = Sidecar::start(&dir.0, grpc, &["--on-engine-loss", "rejoin"]);
    sidecar.wait_serving();
    let report = bench_report(bench_spawn(
        sidecar.listen,
        &["-c", "4", "--calls", "40", "--tokens", "8"],
    ));
    let calls_ok = report["calls_ok"].as_u64().unwrap_or_default();
    assert_eq!(calls_ok, 40, "every call went through: {report}");

    engine.control("/liveness?status=2");
    sidecar
        .proc
        .wait_for_line("after the engine loss; waiting for the engine again", HANG);
    let scraped = scrape(sidecar.admin);

    for (format, content_type) in [
        ("prometheus", "text/plain; version=0.0.4"),
        ("openmetrics", "application/openmetrics-text; version=1.0.0"),
    ] {
        let page = &scraped[format];
        assert!(
            page["content_type"]
                .as_str()
                .is_some_and(|t| t.starts_with(content_type)),
            "{format}: {}",
            page["content_type"]
        );
        let families = &page["families"];
        for histogram in [
            "llm_sidecar_call_duration_seconds",
            "llm_sidecar_call_first_message_seconds",
            "llm_sidecar_loss_to_withdraw_duration_seconds",
            "llm_sidecar_drain_duration_seconds",
        ] {
            assert_eq!(families[histogram], "histogram", "{format}: {families}");
        }
        assert_eq!(families["llm_sidecar_in_flight"], "gauge", "{format}");
        let sample = |name: &str| page["samples"][name].as_f64();
        let ok = sample("llm_sidecar_calls_total{outcome=ok}").unwrap_or_default();
        assert_eq!(ok, calls_ok as f64, "{format}: every ok call counted");
        assert_eq!(
            sample("llm_sidecar_call_duration_seconds_count{outcome=ok}"),
            Some(ok),
            "{format}: one duration per ok call"
        );
        assert_eq!(
            sample("llm_sidecar_call_first_message_seconds_count{outcome=ok}"),
            Some(ok),
            "{format}: one first message per ok call (each streamed tokens)"
        );
        assert_eq!(
            sample("llm_sidecar_loss_to_withdraw_duration_seconds_count{reason=liveness_status}"),
            Some(1.0),
            "{format}: the one loss, by its reason"
        );
        assert_eq!(
            sample("llm_sidecar_engine_losses_total{reason=liveness_status}"),
            Some(1.0),
            "{format}"
        );
        assert_eq!(
            sample("llm_sidecar_drain_duration_seconds_count{}"),
            Some(1.0),
            "{format}: the loss's drain"
        );
        assert_eq!(sample("llm_sidecar_state{state=Starting}"), Some(1.0));
    }
    println!(
        "metrics after a fault run: {} ok calls; {}",
        calls_ok,
        scraped["prometheus"]["samples"]["llm_sidecar_loss_to_withdraw_duration_seconds_sum{reason=liveness_status}"]
    );
    sidecar.proc.stop_cleanly();
}
