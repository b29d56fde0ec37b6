//! What every subcommand runs on: the IO layer's process setup (logging, the
//! async runtime, the stop signals), shared with `llm-sidecar-dynamo`.

pub use llm_sidecar_io::process::{runtime, shutdown_signals};

use crate::shared::LogFormat;

/// Sets up tracing to stderr in the chosen format.
pub fn init_logging(format: LogFormat) {
    llm_sidecar_io::process::init_logging(format == LogFormat::Json);
}
