//! The flags: Dynamo's TensorRT-LLM sidecar's, with the same names, meanings
//! and `DYN_*` variables (Dynamo's own `CommonArgs` is flattened in, so those
//! are Dynamo's code), then llm-sidecar's lifecycle flags with their usual
//! names. An operator swaps `python -m dynamo.trtllm.sidecar …` for
//! `llm-sidecar-dynamo …` and keeps the arguments.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use dynamo_backend_common::{CommonArgs, DisaggregationMode};
use llm_sidecar_core::OnEngineLoss;
use llm_sidecar_flags::LifecycleFlags;
use llm_sidecar_io::discovery::DiscoveryUri;
use llm_sidecar_io::engine::{EngineChoice, EngineKind};
use llm_sidecar_io::request_plane::Limits;
use llm_sidecar_io::{ConfigError, RunConfig, Timings, parse_host_port};

use crate::kube::PodIdentity;

/// llm-sidecar as a Dynamo worker: registers the worker and its model card in
/// Dynamo's discovery, serves Dynamo's request plane, turns each request into
/// an OpenEngine Generate, and follows the engine (liveness Watch, stale
/// GetLoad, its instance id, HTTP/2 keepalive). Engine lost: the worker leaves
/// discovery at once, drains, exits 1. SIGTERM: leaves, waits the router
/// grace, drains, exits 0.
#[derive(Debug, Parser)]
#[command(name = "llm-sidecar-dynamo", version)]
pub struct Args {
    #[command(flatten)]
    pub common: CommonArgs,

    /// Engine gRPC endpoint as `host:port` or a plaintext gRPC/HTTP URL.
    #[arg(long, env = "DYN_SIDECAR_GRPC_ENDPOINT")]
    pub grpc_endpoint: String,

    /// HTTP/2 connections to the engine for Generate calls (the monitors have
    /// their own).
    #[arg(long, env = "DYN_SIDECAR_GRPC_CONNECTIONS", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub grpc_connections: u32,

    /// Maximum duration of one connection attempt or start-up call to the engine.
    #[arg(long, env = "DYN_SIDECAR_GRPC_CONNECT_ATTEMPT_TIMEOUT_SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub grpc_connect_attempt_timeout_secs: u64,

    /// Delay between start-up attempts (engine and discovery).
    #[arg(long, env = "DYN_SIDECAR_GRPC_RETRY_INTERVAL_SECS", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub grpc_retry_interval_secs: u64,

    /// Start-up (engine ready and the worker registered) must complete within
    /// this; else exit 3.
    #[arg(long, env = "DYN_SIDECAR_GRPC_STARTUP_DEADLINE_SECS", default_value_t = 1800,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub grpc_startup_deadline_secs: u64,

    /// Hugging Face model ID or local path used for tokenization and templates
    /// (the frontend reads the files the model card names).
    #[arg(long)]
    pub model_path: String,

    /// Deployment-level default thinking mode advertised to the frontend's chat formatter.
    #[arg(long = "dyn-default-thinking-mode", env = "DYN_DEFAULT_THINKING_MODE",
          value_parser = ["enabled", "disabled"])]
    pub default_thinking_mode: Option<String>,

    /// Model maximum sequence length (input + output), registered in the model
    /// card. Takes precedence over what `Control.GetModelInfo` reports (a
    /// disagreement is logged at WARN).
    #[arg(long, env = "TRTLLM_CONTEXT_LENGTH",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub context_length: Option<u32>,

    /// llm-sidecar's admin HTTP server (/live, /ready, /health, /state,
    /// /metrics), off unless given, so that workers started with Dynamo's
    /// sidecar's arguments never collide on a port. Dynamo's own system port
    /// (DYN_SYSTEM_PORT: /live, /health, /metrics with the dynamo_component_*
    /// gauges) is served as in every Dynamo process, its /health following
    /// this worker's lifecycle.
    #[arg(long, env = "SIDECAR_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,

    #[command(flatten)]
    pub lifecycle: LifecycleFlags,

    /// Threads of the async runtime (Dynamo's runtime needs at least two).
    #[arg(long, env = "SIDECAR_WORKER_THREADS", default_value_t = 2,
          value_parser = clap::value_parser!(u16).range(2..=1024))]
    pub worker_threads: u16,

    /// Log format (stderr): text or json.
    #[arg(long, env = "SIDECAR_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}

/// What `main` runs with, every flag checked.
pub struct Settings {
    /// llm-sidecar's side: the engine, the timings, the admin port.
    pub run: RunConfig,
    /// Dynamo's side: its runtime, discovery and worker settings.
    pub common: CommonArgs,
    /// Where the tokenizer and templates are.
    pub model_path: String,
    /// The flag's context length, if given.
    pub context_length: Option<u32>,
    /// The flag's default thinking mode, if given.
    pub default_thinking_mode: Option<String>,
    /// Runtime threads.
    pub worker_threads: u16,
    /// JSON log lines.
    pub json_logs: bool,
    /// The pod, in the `kubernetes` discovery backend.
    pub kube: Option<PodIdentity>,
}

/// `host:port`, also written as `http://host:port` or `grpc://host:port` as
/// Dynamo's sidecar accepts it.
fn engine_address(value: &str) -> Result<String, ConfigError> {
    let bare = ["http://", "grpc://"]
        .iter()
        .find_map(|scheme| value.strip_prefix(scheme))
        .unwrap_or(value);
    parse_host_port("--grpc-endpoint", bare.trim_end_matches('/'))
}

fn unsupported(flag: &'static str, value: &str, message: &str) -> ConfigError {
    ConfigError::OutOfRange {
        flag,
        value: value.to_string(),
        message: message.to_string(),
    }
}

/// Where Dynamo's discovery lives, for log lines and `/state`: the file
/// store's directory (`DYN_FILE_KV`, else Dynamo's default under the temp
/// directory), etcd's endpoints (`ETCD_ENDPOINTS`, else Dynamo's default), or
/// the pod's object.
fn discovery_location(backend: &str, kube: Option<&PodIdentity>) -> DiscoveryUri {
    if let Some(pod) = kube {
        return DiscoveryUri::Kubernetes {
            namespace: pod.namespace.clone(),
            object: pod.object.clone(),
        };
    }
    match backend {
        "file" => DiscoveryUri::File(std::env::var_os("DYN_FILE_KV").map_or_else(
            || std::env::temp_dir().join("dynamo_store_kv"),
            PathBuf::from,
        )),
        _ => {
            let endpoints = std::env::var("ETCD_ENDPOINTS")
                .unwrap_or_else(|_| "http://localhost:2379".to_string());
            DiscoveryUri::Etcd(
                endpoints
                    .split(',')
                    .map(|e| {
                        let e = e.trim();
                        let e = e.strip_prefix("http://").unwrap_or(e);
                        e.strip_prefix("https://").unwrap_or(e).to_string()
                    })
                    .collect(),
            )
        }
    }
}

impl Args {
    /// Checks every flag; anything wrong is an error before anything is contacted.
    pub fn into_settings(self) -> Result<Settings, ConfigError> {
        let c = &self.common;
        // The bridge speaks OpenEngine's aggregated Generate: no KV hand-off
        // between prefill and decode workers, no encoder results.
        if c.disaggregation_mode != DisaggregationMode::Aggregated {
            return Err(unsupported(
                "--disaggregation-mode",
                &format!("{:?}", c.disaggregation_mode),
                "llm-sidecar-dynamo serves aggregated workers only (agg)",
            ));
        }
        if c.route_to_encoder || c.enable_rl {
            return Err(unsupported(
                if c.route_to_encoder {
                    "--route-to-encoder"
                } else {
                    "--enable-rl"
                },
                "true",
                "not supported by llm-sidecar-dynamo",
            ));
        }
        let backend = c.runtime.discovery_backend.as_deref().unwrap_or("etcd");
        if !matches!(backend, "file" | "etcd" | "kubernetes") {
            return Err(unsupported(
                "--discovery-backend",
                backend,
                "llm-sidecar-dynamo registers in file, etcd or kubernetes discovery",
            ));
        }
        // The pod's identity, read as Dynamo reads it when its runtime starts;
        // checked here, so a missing one exits 2 before anything is contacted.
        let kube = (backend == "kubernetes")
            .then(PodIdentity::from_env)
            .transpose()
            .map_err(|e| unsupported("--discovery-backend", "kubernetes", &e.to_string()))?;
        // Dynamo reads these itself; a value it would refuse later is refused
        // now: the flags, and its runtime's DYN_SYSTEM_* / DYN_RUNTIME_*
        // variables (DYN_SYSTEM_PORT is an i16 in Dynamo 1.6.1, so 40000 is
        // refused there, which would otherwise be retried as "discovery not
        // reachable" until the start-up deadline).
        c.runtime
            .to_distributed_config()
            .map_err(|e| unsupported("--request-plane", "", &e.to_string()))?;
        dynamo_runtime::config::RuntimeConfig::from_settings().map_err(|e| {
            unsupported(
                "DYN_SYSTEM_* / DYN_RUNTIME_* (Dynamo's runtime settings)",
                "",
                &format!("{e:#}"),
            )
        })?;
        if self.model_path.is_empty() {
            return Err(unsupported(
                "--model-path",
                "",
                "needs the model's tokenizer directory or Hugging Face id",
            ));
        }
        let timings = self.lifecycle.timings(Timings {
            connect_attempt_timeout: Duration::from_secs(self.grpc_connect_attempt_timeout_secs),
            retry_interval: Duration::from_secs(self.grpc_retry_interval_secs),
            startup_deadline: Duration::from_secs(self.grpc_startup_deadline_secs),
            ..Timings::default()
        });
        timings.check()?;
        let run = RunConfig {
            engine_endpoint: engine_address(&self.grpc_endpoint)?,
            engine: EngineChoice::Kind(EngineKind::OpenEngine),
            // Not bound: Dynamo's request plane is the front (`Front::Hosted`).
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: "dynamo request plane".into(),
            admin_listen: self.admin_listen,
            discovery: discovery_location(backend, kube.as_ref()),
            namespace: c.namespace.clone(),
            component: c.component.clone(),
            endpoint: c.endpoint.clone(),
            liveness_service: None,
            timings,
            limits: Limits {
                engine_connections: Some(self.grpc_connections),
                ..Limits::DEFAULT
            },
            tls: None,
            etcd_tls: None,
            // The worker's id is Dynamo's connection id, which a process
            // cannot change: after a loss it exits and is restarted.
            on_engine_loss: OnEngineLoss::Exit,
            // No request plane of its own: Dynamo's requests come through
            // Dynamo's transport, on the runtime of --worker-threads.
            worker_threads: 1,
        };
        Ok(Settings {
            run,
            common: self.common,
            model_path: self.model_path,
            context_length: self.context_length,
            default_thinking_mode: self.default_thinking_mode,
            worker_threads: self.worker_threads,
            json_logs: self.log_format == "json",
            kube,
        })
    }
}
