//! What the subcommands share: the exit code for bad usage, the log format,
//! the engine kinds, durations and TLS towards etcd, as flags and value
//! parsers. A leaf of the binary: `cli.rs` and every `commands/*.rs` take
//! these from here, and it takes nothing from them.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use llm_sidecar_io::ConfigError;
use llm_sidecar_io::tls::EtcdTls;

pub use llm_sidecar_io::process::Exit;

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
    /// vLLM's native server (vllm.Inference, vllm.Control); Watch on
    /// vllm.Inference, GetServerInfo as fresh answer, its instance_id as identity.
    VllmNative,
    /// SGLang's native server (sglang.runtime.v1.SglangService); its health
    /// polled, GetLoad as fresh load, its connection as identity.
    SglangNative,
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
            EngineKindArg::VllmNative => EngineChoice::Kind(EngineKind::VllmNative),
            EngineKindArg::SglangNative => EngineChoice::Kind(EngineKind::SglangNative),
        }
    }
}

/// A concrete engine kind's name (clap's value parser, for the mock and bench).
pub fn engine_kind(s: &str) -> Result<llm_sidecar_io::engine::EngineKind, String> {
    llm_sidecar_io::engine::EngineKind::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = llm_sidecar_io::engine::PROFILES
            .iter()
            .map(|p| p.name)
            .collect();
        format!("{s:?} is not one of {}", names.join(", "))
    })
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
