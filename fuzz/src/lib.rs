//! Fuzz entry points, shared by the cargo-fuzz targets and the corpus replay
//! that `cargo test` runs on stable.

use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use llm_sidecar_core::{Config, OnEngineLoss};
use llm_sidecar_proptests::{AbstractEvent, Harness, Input};

/// Durations the fuzzer may pick for each setting, zero included.
fn duration(u: &mut Unstructured<'_>, max_ms: u64) -> arbitrary::Result<Duration> {
    Ok(Duration::from_millis(u.int_in_range(0..=max_ms)?))
}

fn config(u: &mut Unstructured<'_>) -> arbitrary::Result<Config> {
    Ok(Config {
        engine_display_name: "TensorRT-LLM".into(),
        instance_id: u64::arbitrary(u)?,
        retry_interval: duration(u, 5_000)?,
        startup_deadline: duration(u, 120_000)?,
        stale_after: duration(u, 60_000)?,
        router_grace: duration(u, 10_000)?,
        drain_timeout: duration(u, 30_000)?,
        reregister_deadline: duration(u, 120_000)?,
        on_engine_loss: if bool::arbitrary(u)? {
            OnEngineLoss::Rejoin
        } else {
            OnEngineLoss::Exit
        },
    })
}

/// Decodes `data` into settings and a sequence of (time step, event), runs the
/// lifecycle in its world and panics on the first broken invariant.
pub fn lifecycle(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(config) = config(&mut u) else { return };
    let mut harness = Harness::new(config.clone());
    let mut steps = 0usize;
    let mut trail: Vec<String> = Vec::new();
    let fail = |v: llm_sidecar_proptests::Violation, trail: &[String]| -> ! {
        panic!("{v}\nconfig: {config:?}\nsteps:\n  {}", trail.join("\n  "))
    };
    while !u.is_empty() && steps < 512 {
        steps += 1;
        let Ok(step_ms) = u.int_in_range(0u16..=4_000) else {
            return;
        };
        let Ok(event) = AbstractEvent::arbitrary(&mut u) else {
            return;
        };
        if step_ms > 0 {
            let at = harness.lifecycle.now() + Duration::from_millis(u64::from(step_ms) * 10);
            trail.push(format!("time -> {at:?}"));
            if let Err(v) = harness.apply(Input::Timeout(at)) {
                fail(v, &trail);
            }
            trail.push(format!("  = {:?}", harness.lifecycle.phase()));
        }
        trail.push(format!("{event:?} at {:?}", harness.lifecycle.now()));
        match harness.step(event) {
            Err(v) => fail(v, &trail),
            Ok(delivered) => trail.push(format!(
                "  = {:?}{}",
                harness.lifecycle.phase(),
                if delivered { "" } else { " (not deliverable)" }
            )),
        }
    }
}

/// Everything a flag or an environment variable goes through on its way in:
/// durations, `host:port`, discovery key segments and discovery URIs. Nothing
/// panics; a URI that parses prints back to itself.
pub fn config_text(data: &[u8]) {
    use llm_sidecar_io::discovery::DiscoveryUri;
    use llm_sidecar_io::parse::{parse_duration, parse_host_port, parse_key_segment};
    let text = String::from_utf8_lossy(data);
    let _ = parse_duration(&text);
    let _ = parse_host_port("--engine-endpoint", &text);
    let _ = parse_key_segment("--namespace", &text);
    if let Ok(uri) = DiscoveryUri::parse(&text) {
        let again = DiscoveryUri::parse(&uri.to_string());
        assert_eq!(
            again.as_ref().ok(),
            Some(&uri),
            "{text:?} does not round-trip"
        );
    }
}

/// A discovery record as `instances` reads it (file or etcd value): parsed or
/// explained, never a panic; a record that parses survives a write and re-read.
pub fn discovery_record(data: &[u8]) {
    use llm_sidecar_io::discovery::Listed;
    if let Listed::Record(record) = Listed::parse(data) {
        let written = serde_json::to_vec(&record).expect("a parsed record serialises");
        assert_eq!(Listed::parse(&written), Listed::Record(record));
    }
}

/// An admin or control request target (`/path?query`): split and decoded
/// without panicking; a query built from encoded pairs decodes to those pairs.
pub fn admin_request(data: &[u8]) {
    use llm_sidecar_io::admin::http::Request;
    let text = String::from_utf8_lossy(data);
    let request = Request::from_target("GET", &text);
    let _ = request.param("status");
    // Round trip: every byte percent-encoded, pairs split on the first NUL.
    let (k, v) = text.split_once('\0').unwrap_or((&text, ""));
    let enc = |s: &str| s.bytes().map(|b| format!("%{b:02X}")).collect::<String>();
    let target = format!("/x?{}={}", enc(k), enc(v));
    let parsed = Request::from_target("GET", &target);
    if !k.is_empty() {
        assert_eq!(
            parsed.query,
            vec![(k.to_string(), v.to_string())],
            "{target}"
        );
    }
}

/// Any sequence of raw liveness observations: SERVING is never a loss, an
/// unsupported watch never becomes one, and a concluded watch stays concluded.
pub fn liveness_status(data: &[u8]) {
    use llm_sidecar_core::LivenessObservation;
    use llm_sidecar_core::liveness::{Verdict, WatchPhase, interpret, serving_status_name};
    let mut u = Unstructured::new(data);
    let mut phase = WatchPhase::AwaitingFirst;
    // `Unstructured` answers with defaults once the data runs out: stop there.
    while !u.is_empty() {
        let Ok(kind) = u.int_in_range(0u8..=10) else {
            break;
        };
        let observation = match kind {
            0..=6 => {
                let Ok(raw) = i32::arbitrary(&mut u) else {
                    break;
                };
                let _ = serving_status_name(raw);
                // Mostly the real range, sometimes anything.
                LivenessObservation::Status(if kind < 5 { raw.rem_euclid(5) } else { raw })
            }
            7 => LivenessObservation::StreamEnded,
            8 => LivenessObservation::StreamFailed {
                code: i32::arbitrary(&mut u).unwrap_or(14),
                message: String::new(),
            },
            9 => LivenessObservation::NotOpened {
                waited: Duration::from_millis(u64::from(u8::arbitrary(&mut u).unwrap_or(0))),
            },
            // A polled Check failing (vLLM, SGLang).
            _ => LivenessObservation::CheckFailed {
                code: i32::arbitrary(&mut u).unwrap_or(14),
                message: String::new(),
            },
        };
        let before = phase;
        let (next, verdict) = interpret(phase, &observation, "liveness");
        if matches!(observation, LivenessObservation::Status(1)) {
            assert!(
                !matches!(verdict, Verdict::Loss(_)),
                "SERVING reported as a loss"
            );
        }
        if matches!(before, WatchPhase::Unsupported | WatchPhase::Concluded) {
            assert_eq!(next, before, "{before:?} is final");
            assert!(
                !matches!(verdict, Verdict::Loss(_)),
                "a loss after {before:?}"
            );
        }
        phase = next;
    }
}
