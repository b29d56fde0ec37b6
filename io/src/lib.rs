//! The IO layer of llm-sidecar: everything that touches the world.
//!
//! It owns every tokio type, turns the world (the engine's gRPC API, discovery,
//! signals, the clock) into inputs for the core's [`Lifecycle`], and performs the
//! actions the core emits. [`run`] is the production job.
//!
//! [`Lifecycle`]: llm_sidecar_core::Lifecycle

pub mod admin_http;
pub mod config;
pub mod discovery;
mod driver;
pub mod engine;
mod monitors;
pub mod net;
mod own_health;
pub mod proxy;
mod status;
pub mod timefmt;
pub mod tls;

pub use config::{ConfigError, RunConfig, Timings, parse_duration, parse_host_port};
pub use driver::{RunError, run};
