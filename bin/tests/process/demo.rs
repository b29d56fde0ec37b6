//! `llm-sidecar demo`, exactly as the README runs it.

use std::process::Command;

#[test]
fn the_demo_shows_the_whole_lifecycle_and_cleans_up() {
    let out = Command::new(crate::support::binary())
        .arg("demo")
        .output()
        .expect("run the demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for expected in [
        "serving: the worker is registered in discovery",
        "3 Generate calls answered through the sidecar",
        "record withdrawn",
        "Unavailable \"draining\"",
        "the in-flight call drained: all 200 tokens delivered",
        "the sidecar exited with code 1",
        "TensorRT-LLM engine lost: liveness reported NOT_SERVING",
    ] {
        assert!(
            text.contains(expected),
            "the timeline shows {expected:?}:\n{text}"
        );
    }
    let dir = text
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_suffix(".json")
                .and_then(|p| p.split("/discovery/").next())
        })
        .expect("the record path is printed");
    assert!(
        !std::path::Path::new(dir).exists(),
        "the demo removed {dir}"
    );
}
