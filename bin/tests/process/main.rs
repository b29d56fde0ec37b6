//! The process tests: the real `llm-sidecar` binary against real servers on
//! loopback (the mock engine, the engines' own servers from PyPI, etcd, nginx for
//! the benchmarks), checked the way
//! an operator would look: the discovery entry, the exit code, the log lines.
//!
//! One test binary with a module per suite: one link instead of ten, and the
//! suites run side by side (`cargo test -p llm-sidecar --test process`; one
//! suite: `... --test process faults::`).

mod support;

mod churn;
mod demo;
mod engine_kinds;
mod engine_lifecycle;
mod etcd_discovery;
mod faults;
mod hardening;
mod load;
mod measure;
mod metrics;
mod perf;
mod probe;
mod rejoin;
mod request_plane;
mod security;
mod shipped_servers;
mod termination;
