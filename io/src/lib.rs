//! The IO layer of llm-sidecar: everything that touches the world.
//!
//! It owns every tokio type, turns the world (the engine's gRPC API, discovery,
//! signals, the clock) into inputs for the core's [`Lifecycle`], and performs the
//! actions the core emits. [`run`] is the production job.
//!
//! The rooms (docs/ARCHITECTURE.md has the map): [`driver`] (the loop),
//! [`engine`] (profiles, start-up, monitors), [`discovery`] (the record and its
//! backends), [`request_plane`] (the proxy), [`admin`] (the admin port), and
//! the leaves every room may use: [`parse`], [`net`], [`tls`], [`report`] and
//! the exit bounds.
//!
//! [`Lifecycle`]: llm_sidecar_core::Lifecycle

#![warn(missing_docs, unreachable_pub)]

pub mod admin;
pub mod config;
pub mod discovery;
mod driver;
pub mod engine;
mod exit_bounds;
mod h2_frames;
pub mod net;
pub mod parse;
pub mod process;
pub mod report;
pub mod request_plane;
pub mod tls;

pub use config::{RunConfig, Timings};
pub use driver::{Front, RunError, Started, run, start};
pub use parse::{ConfigError, parse_duration, parse_host_port, parse_key_segment};
pub use request_plane::auto_worker_threads;
