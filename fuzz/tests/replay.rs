//! Replays the committed fuzz corpus on stable Rust, plus a fixed stream of
//! pseudo-random inputs, so every CI run checks what the fuzzer checks.

use std::path::PathBuf;

#[test]
fn committed_corpus_keeps_the_invariants() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus/lifecycle");
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
        let outcome = std::panic::catch_unwind(|| llm_sidecar_fuzz::lifecycle(&data));
        assert!(
            outcome.is_ok(),
            "corpus input {} broke an invariant",
            file.display()
        );
    }
    println!("replayed {} corpus inputs", files.len());
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
        llm_sidecar_fuzz::lifecycle(&data);
    }
}
