//! `cargo +nightly fuzz run lifecycle`: arbitrary settings and event sequences
//! against the lifecycle invariants.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llm_sidecar_fuzz::lifecycle(data));
