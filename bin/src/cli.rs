//! The command line: the subcommands, the flags they share, and how flag text
//! becomes typed values. Every flag of `run` can also be set through
//! `SIDECAR_<FLAG_IN_UPPER_SNAKE>`; flags win over the environment. Each
//! subcommand's own flags and entry point live in `commands/`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use llm_sidecar_io::ConfigError;
use llm_sidecar_io::tls::EtcdTls;

use crate::commands::bench::BenchArgs;
use crate::commands::instances::InstancesArgs;
use crate::commands::mock_engine::MockArgs;
use crate::commands::run::RunArgs;

/// Exit code for bad usage or configuration (nothing was contacted).
pub const EXIT_USAGE: i32 = 2;

/// An engine sidecar for LLM serving.
///
/// Runs beside an inference engine (TensorRT-LLM), registers it in discovery,
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
    MockEngine(MockArgs),
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

/// How log lines are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line.
    Json,
}

/// The engine APIs the sidecar follows, and `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKindArg {
    /// Find out at start-up which of the APIs below the engine serves.
    Auto,
    /// TensorRT-LLM's trtllm.TrtllmService (the SMG gateway's API); Watch
    /// "liveness", HealthCheck "OK" as fresh load, its self-description as identity.
    Trtllm,
    /// TensorRT-LLM's OpenEngine server (openengine.v1.Control); Watch
    /// "liveness", Control.GetLoad as fresh load, ServerInfo.instance_id as identity.
    Openengine,
    /// vLLM (vllm.grpc.engine.VllmEngine); its health polled, GetLoads as
    /// fresh load, its connection as identity.
    Vllm,
    /// SGLang (sglang.grpc.scheduler.SglangScheduler); its health polled after
    /// its warm-up, GetLoads as fresh load, start_time as identity.
    Sglang,
}

impl EngineKindArg {
    /// The choice the IO layer takes.
    pub fn choice(self) -> llm_sidecar_io::engine::EngineChoice {
        use llm_sidecar_io::engine::{EngineChoice, EngineKind};
        match self {
            EngineKindArg::Auto => EngineChoice::Auto,
            EngineKindArg::Trtllm => EngineChoice::Kind(EngineKind::Trtllm),
            EngineKindArg::Openengine => EngineChoice::Kind(EngineKind::OpenEngine),
            EngineKindArg::Vllm => EngineChoice::Kind(EngineKind::Vllm),
            EngineKindArg::Sglang => EngineChoice::Kind(EngineKind::Sglang),
        }
    }
}

/// A concrete engine kind's name (clap's value parser, for the mock and bench).
pub fn engine_kind(s: &str) -> Result<llm_sidecar_io::engine::EngineKind, String> {
    llm_sidecar_io::engine::EngineKind::from_name(s)
        .ok_or_else(|| format!("{s:?} is not one of trtllm, openengine, vllm, sglang"))
}

/// Flag values like `300ms`, `5s`, `2m` (clap's value parser).
pub use llm_sidecar_flags::duration;

/// TLS towards etcd (for `--discovery etcd://...`).
#[derive(Debug, Args)]
pub struct EtcdTlsArgs {
    /// Talk to etcd over TLS, trusting this CA bundle (PEM) for etcd's certificate,
    /// which must name the host as written in --discovery.
    #[arg(long, env = "SIDECAR_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's --client-cert-auth. Needs --etcd-ca and --etcd-key.
    #[arg(long, env = "SIDECAR_ETCD_CERT", requires_all = ["etcd_ca", "etcd_key"])]
    pub etcd_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert.
    #[arg(long, env = "SIDECAR_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdTlsArgs {
    /// Reads and checks the files, if TLS towards etcd was asked for.
    pub fn load(&self) -> Result<Option<EtcdTls>, ConfigError> {
        self.etcd_ca
            .as_deref()
            .map(|ca| EtcdTls::load(ca, self.etcd_cert.as_deref(), self.etcd_key.as_deref()))
            .transpose()
    }
}
