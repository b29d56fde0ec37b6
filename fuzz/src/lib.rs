//! Fuzz entry points, shared by the cargo-fuzz targets and the corpus replay
//! that `cargo test` runs on stable.

use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use llm_sidecar_core::Config;
use llm_sidecar_proptests::{AbstractEvent, Harness, Input};

/// Durations the fuzzer may pick for each setting, zero included.
fn duration(u: &mut Unstructured<'_>, max_ms: u64) -> arbitrary::Result<Duration> {
    Ok(Duration::from_millis(u.int_in_range(0..=max_ms)?))
}

fn config(u: &mut Unstructured<'_>) -> arbitrary::Result<Config> {
    Ok(Config {
        engine_display_name: "TensorRT-LLM".into(),
        liveness_service: "liveness".into(),
        instance_id: u64::arbitrary(u)?,
        retry_interval: duration(u, 5_000)?,
        startup_deadline: duration(u, 120_000)?,
        stale_after: duration(u, 60_000)?,
        router_grace: duration(u, 10_000)?,
        drain_timeout: duration(u, 30_000)?,
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
