//! Replays the committed fuzz corpus on stable Rust, plus a fixed stream of
//! pseudo-random inputs, so every CI run checks what the fuzzer checks.

use std::path::PathBuf;

/// A fuzz entry point.
type Target = fn(&[u8]);

/// Every target, by the name of its corpus directory.
const TARGETS: [(&str, Target); 5] = [
    ("lifecycle", llm_sidecar_fuzz::lifecycle),
    ("config_text", llm_sidecar_fuzz::config_text),
    ("discovery_record", llm_sidecar_fuzz::discovery_record),
    ("admin_request", llm_sidecar_fuzz::admin_request),
    ("liveness_status", llm_sidecar_fuzz::liveness_status),
];

#[test]
fn committed_corpus_keeps_the_invariants() {
    for (target, run) in TARGETS {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("corpus")
            .join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .filter_map(Result::ok)
            .map(|e| e.path())
            .collect();
        files.sort();
        assert!(
            !files.is_empty(),
            "the corpus at {} is empty",
            dir.display()
        );
        for file in &files {
            let data = std::fs::read(file).expect("read corpus file");
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(
                outcome.is_ok(),
                "{target}: corpus input {} broke a property",
                file.display()
            );
        }
        println!("{target}: replayed {} corpus inputs", files.len());
    }
}

#[test]
fn pseudo_random_inputs_keep_the_invariants() {
    // xorshift64*: deterministic, no dependency.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    for _ in 0..3000 {
        let len = (next() % 600) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        for (_, run) in TARGETS {
            run(&data);
        }
    }
}
