//! The command line: the subcommands. Every flag of `run` can also be set
//! through `SIDECAR_<FLAG_IN_UPPER_SNAKE>`; flags win over the environment.
//! Each subcommand's own flags and entry point live in `commands/`, what they
//! share in `shared.rs`.

use clap::{Parser, Subcommand};

use crate::commands::bench::BenchArgs;
use crate::commands::instances::InstancesArgs;
use crate::commands::mock_engine::MockArgs;
use crate::commands::run::RunArgs;
use crate::shared::LogFormat;

/// An engine sidecar for LLM serving.
///
/// Runs beside an inference engine (TensorRT-LLM, vLLM, SGLang), registers it in discovery,
/// follows its health, and withdraws it the moment the engine is lost.
#[derive(Debug, Parser)]
#[command(name = "llm-sidecar", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar beside an engine (the production job).
    ///
    /// Waits for the engine, reads its model and server info, registers the
    /// worker in discovery, and follows the engine's liveness, load freshness,
    /// identity and HTTP/2 keepalive. Engine lost: withdraw, drain, exit 1.
    /// SIGTERM/SIGINT: withdraw, router grace, drain, exit 0. Start-up not done
    /// by --startup-deadline: exit 3. Bad flags: exit 2, nothing contacted.
    Run(Box<RunArgs>),
    /// Run a CPU-only fake engine of any kind (for tests and demos).
    MockEngine(Box<MockArgs>),
    /// List the workers registered in discovery.
    Instances(InstancesArgs),
    /// Look once at an engine (any kind) or a running sidecar; exit 0 only
    /// when it serves.
    ///
    /// For exec probes and scripts. Exit codes: 0 serving; 2 bad flags, or
    /// nothing accepted the connection; 3 a call failed or timed out, or the
    /// engine serves none of the APIs llm-sidecar follows; 4 it answered but
    /// not SERVING (2, 3 and 4 as grpc_health_probe's).
    Probe(crate::commands::probe::ProbeArgs),
    /// Copy this executable into a directory, for an exec probe in another
    /// container (the image has no cp).
    ///
    /// In Kubernetes: an init container runs `copy-binary /shared`, and the
    /// engine's container runs `/shared/llm-sidecar probe --engine ...` as its
    /// startup probe. Exit 0 copied; 2 the directory does not exist; 73 the
    /// copy could not be written.
    CopyBinary(crate::commands::copy_binary::CopyBinaryArgs),
    /// Load the request plane: N concurrent Generate streams of M tokens.
    ///
    /// Works against any address that speaks the engine kind's API (the
    /// engine, the sidecar, another proxy), so runs can be compared side by side.
    Bench(BenchArgs),
    /// Show the whole lifecycle on this machine: a mock engine (of any kind),
    /// the sidecar finding its kind, calls through it, an engine failure,
    /// withdrawal, drain and exit 1.
    Demo(crate::commands::demo::DemoArgs),
}

impl Cli {
    /// The log format the chosen subcommand asked for.
    pub fn log_format(&self) -> LogFormat {
        match &self.command {
            Command::Run(a) => a.log_format,
            Command::MockEngine(a) => a.log_format,
            Command::Instances(_)
            | Command::Bench(_)
            | Command::Demo(_)
            | Command::Probe(_)
            | Command::CopyBinary(_) => LogFormat::Text,
        }
    }
}

#[cfg(test)]
mod tests {
    use llm_sidecar_io::request_plane::Limits;

    use super::*;

    /// `run`'s flags default to `Limits::DEFAULT`, the durations given as
    /// text included, so the in-process tests run what `llm-sidecar run` runs.
    #[test]
    fn run_without_flags_has_the_default_limits() {
        let Command::Run(args) = Cli::try_parse_from(["llm-sidecar", "run"])
            .expect("no flag is required")
            .command
        else {
            panic!("not run");
        };
        let config = args.into_config().expect("the defaults are valid");
        assert_eq!(config.limits, Limits::DEFAULT);
    }
}
