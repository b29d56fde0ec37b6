//! The IO layer in-process: the sidecar's driver and request plane, the mock
//! engine and the callers in one runtime (the process suite, `bin/tests/process`,
//! keeps what only a process shows). See `harness.rs`.

mod calls;
mod hardening;
mod harness;
mod sharing;
