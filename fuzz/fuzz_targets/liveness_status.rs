//! cargo-fuzz target: see [`llm_sidecar_fuzz::liveness_status`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| llm_sidecar_fuzz::liveness_status(data));
