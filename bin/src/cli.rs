//! Command-line interface: flags, their environment variables, and the
//! subcommands' entry points. Every flag of `run` can also be set through
//! `SIDECAR_<FLAG_IN_UPPER_SNAKE>`; flags win over the environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use llm_sidecar_io::discovery::{Discovery, DiscoveryUri, EtcdDiscovery, FileDiscovery, Listed};
use llm_sidecar_io::engine::{EngineKind, EngineProfile};
use llm_sidecar_io::tls::{EtcdTls, ServerTlsFiles};
use llm_sidecar_io::{ConfigError, RunConfig, Timings, parse_duration, parse_host_port};
use tokio::sync::mpsc;

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
    /// Run a CPU-only fake TensorRT-LLM engine (for tests and demos).
    MockEngine(MockArgs),
    /// List the workers registered in discovery.
    Instances(InstancesArgs),
    /// Load the request plane: N concurrent Generate streams of M tokens.
    ///
    /// Works against any TensorRT-LLM-compatible address (the engine, the
    /// sidecar, another proxy), so runs can be compared side by side.
    Bench(BenchArgs),
    /// Show the whole lifecycle on this machine: a mock engine, the sidecar,
    /// calls through it, an engine failure, withdrawal, drain and exit 1.
    Demo,
}

impl Cli {
    /// The log format the chosen subcommand asked for.
    pub fn log_format(&self) -> LogFormat {
        match &self.command {
            Command::Run(a) => a.log_format,
            Command::MockEngine(a) => a.log_format,
            Command::Instances(_) | Command::Bench(_) | Command::Demo => LogFormat::Text,
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

/// Engines the sidecar can watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKindArg {
    /// NVIDIA TensorRT-LLM (trtllm.TrtllmService; liveness service "liveness").
    Trtllm,
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

/// Flags of `llm-sidecar run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The engine's gRPC address (host:port).
    #[arg(
        long,
        env = "SIDECAR_ENGINE_ENDPOINT",
        default_value = "127.0.0.1:50051"
    )]
    pub engine_endpoint: String,
    /// Which engine runs beside the sidecar.
    #[arg(
        long,
        env = "SIDECAR_ENGINE_KIND",
        value_enum,
        default_value = "trtllm"
    )]
    pub engine_kind: EngineKindArg,
    /// Where clients (routers, gateways) call the sidecar (host:port to bind).
    #[arg(long, env = "SIDECAR_LISTEN", default_value = "127.0.0.1:50061")]
    pub listen: SocketAddr,
    /// The address written to discovery for clients to call (default: --listen).
    #[arg(long, env = "SIDECAR_ADVERTISE")]
    pub advertise: Option<String>,
    /// Admin HTTP server: /live, /ready, /state, /metrics. Keep it on loopback
    /// unless something outside the pod must scrape it.
    #[arg(long, env = "SIDECAR_ADMIN_LISTEN", default_value = "127.0.0.1:9090")]
    pub admin_listen: SocketAddr,
    /// Where the worker is registered: file:<dir> (embedded, one JSON file per
    /// worker) or etcd://host:port[,host:port...].
    #[arg(
        long,
        env = "SIDECAR_DISCOVERY",
        default_value = "file:.llm-sidecar/discovery"
    )]
    pub discovery: String,
    /// Discovery key: namespace.
    #[arg(long, env = "SIDECAR_NAMESPACE", default_value = "dynamo")]
    pub namespace: String,
    /// Discovery key: component.
    #[arg(long, env = "SIDECAR_COMPONENT", default_value = "backend")]
    pub component: String,
    /// Discovery key: endpoint.
    #[arg(long, env = "SIDECAR_ENDPOINT", default_value = "generate")]
    pub endpoint: String,
    /// The grpc.health.v1 service watched for liveness (default: the engine's,
    /// "liveness" for TensorRT-LLM).
    #[arg(long, env = "SIDECAR_LIVENESS_SERVICE")]
    pub liveness_service: Option<String>,
    /// Bound on one connect attempt, one start-up call, one discovery write, and
    /// the wait for the liveness Watch's first message.
    #[arg(long, env = "SIDECAR_CONNECT_ATTEMPT_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub connect_attempt_timeout: Duration,
    /// Pause between start-up attempts and between retries of a failed discovery write.
    #[arg(long, env = "SIDECAR_RETRY_INTERVAL", default_value = "1s", value_parser = duration)]
    pub retry_interval: Duration,
    /// Start-up (engine ready and registered) must complete within this; else exit 3.
    #[arg(long, env = "SIDECAR_STARTUP_DEADLINE", default_value = "30m", value_parser = duration)]
    pub startup_deadline: Duration,
    /// HTTP/2 keepalive ping interval on the engine connection. Must be above
    /// 10s: engines answer more frequent pings with GOAWAY "too many pings".
    #[arg(long, env = "SIDECAR_KEEPALIVE_INTERVAL", default_value = "20s", value_parser = duration)]
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered before the connection (and
    /// the engine) counts as dead.
    #[arg(long, env = "SIDECAR_KEEPALIVE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub keepalive_timeout: Duration,
    /// How often the stale-load probe (HealthCheck) and the identity re-read run.
    #[arg(long, env = "SIDECAR_PROBE_INTERVAL", default_value = "5s", value_parser = duration)]
    pub probe_interval: Duration,
    /// No fresh probe answer for this long means the engine is lost (wedged).
    #[arg(long, env = "SIDECAR_STALE_AFTER", default_value = "30s", value_parser = duration)]
    pub stale_after: Duration,
    /// After SIGTERM, keep admitting calls this long (routers may not yet have
    /// seen the withdrawal).
    #[arg(long, env = "SIDECAR_ROUTER_GRACE", default_value = "5s", value_parser = duration)]
    pub router_grace: Duration,
    /// Once admission is closed, in-flight calls may take this long; the rest are cut.
    #[arg(long, env = "SIDECAR_DRAIN_TIMEOUT", default_value = "20s", value_parser = duration)]
    pub drain_timeout: Duration,
    /// TTL of the etcd lease behind the record (kept alive at TTL/3).
    #[arg(long, env = "SIDECAR_LEASE_TTL", default_value = "10s", value_parser = duration)]
    pub lease_ttl: Duration,
    /// Largest gRPC message the request plane forwards, either direction, in
    /// bytes; a larger one fails that call with RESOURCE_EXHAUSTED.
    #[arg(long, env = "SIDECAR_MAX_MESSAGE_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub max_message_bytes: u32,
    /// Concurrent calls (HTTP/2 streams) one client connection may have open.
    #[arg(long, env = "SIDECAR_MAX_CONCURRENT_STREAMS", default_value_t = 2048)]
    pub max_concurrent_streams: u32,
    /// Largest header list (metadata) a client may send, in bytes.
    #[arg(long, env = "SIDECAR_MAX_HEADER_LIST_BYTES", default_value_t = 16 * 1024)]
    pub max_header_list_bytes: u32,
    /// Serve the request plane over TLS with this certificate chain (PEM, leaf
    /// first). Needs --tls-key. Callers then connect with https:// and ALPN h2.
    #[arg(long, env = "SIDECAR_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "SIDECAR_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates that chain to this CA bundle (PEM): mutual
    /// TLS. A caller without one fails the handshake. Needs --tls-cert.
    #[arg(long, env = "SIDECAR_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    #[command(flatten)]
    pub etcd_tls: EtcdTlsArgs,
    /// Threads of the async runtime. One is the default: the sidecar's work is
    /// small beside the engine's, and one thread forwarded ~960k tokens/s in the
    /// benchmark with the least CPU per message (docs/PERFORMANCE.md). Raise it
    /// only for call rates far beyond what an engine produces.
    #[arg(long, env = "SIDECAR_WORKER_THREADS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: u16,
    /// Log format (stderr).
    #[arg(long, env = "SIDECAR_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl RunArgs {
    /// Checks every flag and builds the settings, or says what is wrong.
    pub fn into_config(self) -> Result<RunConfig, ConfigError> {
        let engine = EngineProfile::of(match self.engine_kind {
            EngineKindArg::Trtllm => EngineKind::Trtllm,
        });
        let timings = Timings {
            connect_attempt_timeout: self.connect_attempt_timeout,
            retry_interval: self.retry_interval,
            startup_deadline: self.startup_deadline,
            keepalive_interval: self.keepalive_interval,
            keepalive_timeout: self.keepalive_timeout,
            probe_interval: self.probe_interval,
            stale_after: self.stale_after,
            router_grace: self.router_grace,
            drain_timeout: self.drain_timeout,
            lease_ttl: self.lease_ttl,
        };
        timings.check()?;
        let advertise = match self.advertise {
            Some(a) => parse_host_port("--advertise", &a)?,
            None => self.listen.to_string(),
        };
        let liveness_service = self
            .liveness_service
            .unwrap_or_else(|| engine.default_liveness_service().to_string());
        Ok(RunConfig {
            engine_endpoint: parse_host_port("--engine-endpoint", &self.engine_endpoint)?,
            engine,
            listen: self.listen,
            advertise,
            admin_listen: self.admin_listen,
            discovery: DiscoveryUri::parse(&self.discovery)?,
            namespace: llm_sidecar_io::config::parse_key_segment("--namespace", &self.namespace)?,
            component: llm_sidecar_io::config::parse_key_segment("--component", &self.component)?,
            endpoint: llm_sidecar_io::config::parse_key_segment("--endpoint", &self.endpoint)?,
            liveness_service,
            timings,
            limits: llm_sidecar_io::proxy::Limits {
                max_message_bytes: self.max_message_bytes.max(1),
                max_concurrent_streams: self.max_concurrent_streams.max(1),
                max_header_list_bytes: self.max_header_list_bytes.max(1024),
            },
            tls: match (self.tls_cert, self.tls_key) {
                (Some(cert), Some(key)) => Some(
                    ServerTlsFiles {
                        cert,
                        key,
                        client_ca: self.tls_client_ca,
                    }
                    .load()?,
                ),
                _ => None,
            },
            etcd_tls: self.etcd_tls.load()?,
        })
    }
}

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

/// Flags of `llm-sidecar mock-engine`.
#[derive(Debug, Args)]
pub struct MockArgs {
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Control HTTP listen address (see the mock's control paths in the docs).
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub control_listen: SocketAddr,
    /// Model id reported by GetModelInfo.
    #[arg(long, default_value = "mock/llama-3-8b-instruct")]
    pub model_id: String,
    /// Version reported by GetServerInfo.
    #[arg(long, default_value = "1.0.0-mock")]
    pub engine_version: String,
    /// Backend reported by GetServerInfo.
    #[arg(long, default_value = "pytorch")]
    pub backend: String,
    /// Max input length reported by GetModelInfo.
    #[arg(long, default_value_t = 4096)]
    pub max_input_len: i32,
    /// Max sequence length reported by GetModelInfo.
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: i32,
    /// Delay before each generated token.
    #[arg(long, default_value = "0ms", value_parser = duration)]
    pub token_delay: Duration,
    /// Serve no grpc.health.v1 at all (like an older engine).
    #[arg(long, conflicts_with = "liveness_unregistered")]
    pub no_health: bool,
    /// Serve grpc.health.v1 without the liveness service until the control endpoint sets it.
    #[arg(long)]
    pub liveness_unregistered: bool,
    /// Append one line per Generate event (`seen`, `done`, `error`, `cancelled`,
    /// `aborted`, then the request id) to this file: the engine's side of a call
    /// account that survives the mock being killed.
    #[arg(long)]
    pub journal: Option<std::path::PathBuf>,
    /// Log format (stderr).
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Flags of `llm-sidecar instances`.
#[derive(Debug, Args)]
pub struct InstancesArgs {
    /// Where to look: file:<dir> or etcd://host:port[,...].
    #[arg(
        long,
        env = "SIDECAR_DISCOVERY",
        default_value = "file:.llm-sidecar/discovery"
    )]
    pub discovery: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub etcd_tls: EtcdTlsArgs,
}

/// Sets up tracing to stderr; `RUST_LOG` overrides the default `info`.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,h2=warn,hyper=warn,tower=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    runtime_with(None)
}

fn runtime_with(worker_threads: Option<u16>) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = worker_threads {
        builder.worker_threads(usize::from(n));
    }
    match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    }
}

/// One item per SIGTERM or SIGINT, for as long as the process runs.
fn shutdown_signals() -> mpsc::UnboundedReceiver<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!(
                "cannot install SIGTERM/SIGINT handlers; stop the sidecar with SIGKILL"
            );
            return;
        };
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    rx
}

/// `llm-sidecar run`.
pub fn run(args: RunArgs) -> i32 {
    let worker_threads = args.worker_threads;
    let config = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    runtime_with(Some(worker_threads)).block_on(async move {
        match llm_sidecar_io::run(config, shutdown_signals()).await {
            Ok(code) => code.as_i32(),
            Err(e) => {
                tracing::error!("{e}");
                EXIT_USAGE
            }
        }
    })
}

/// `llm-sidecar mock-engine`.
pub fn mock_engine(args: MockArgs) -> i32 {
    use llm_sidecar_mock_engine::{HealthMode, MockConfig};
    let config = MockConfig {
        listen: args.listen,
        control_listen: args.control_listen,
        model_id: args.model_id,
        version: args.engine_version,
        backend: args.backend,
        max_input_len: args.max_input_len,
        max_seq_len: args.max_seq_len,
        token_delay: args.token_delay,
        journal: args.journal,
        health: if args.no_health {
            HealthMode::Absent
        } else if args.liveness_unregistered {
            HealthMode::LivenessUnregistered
        } else {
            HealthMode::Full
        },
    };
    runtime().block_on(async move {
        let mut signals = shutdown_signals();
        let shutdown = async move {
            signals.recv().await;
        };
        match llm_sidecar_mock_engine::run(config, shutdown).await {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!("{e}");
                EXIT_USAGE
            }
        }
    })
}

/// Flags of `llm-sidecar bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Address to load (host:port): the sidecar's --listen, or the engine directly.
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub target: String,
    /// Concurrent streams.
    #[arg(long, short = 'c', default_value_t = 16)]
    pub concurrency: usize,
    /// Tokens per call (max_tokens).
    #[arg(long, short = 'n', default_value_t = 256)]
    pub tokens: u32,
    /// How long to run (ignored if --calls is reached first).
    #[arg(long, short = 'd', default_value = "10s", value_parser = duration)]
    pub duration: Duration,
    /// Stop after this many calls in total.
    #[arg(long)]
    pub calls: Option<u64>,
    /// HTTP/2 connections to spread the streams over.
    #[arg(long, default_value_t = 1)]
    pub connections: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: u32,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `llm-sidecar bench`.
pub fn bench(args: BenchArgs) -> i32 {
    if let Err(e) = parse_host_port("--target", &args.target) {
        eprintln!("error: {e}");
        return EXIT_USAGE;
    }
    let config = llm_sidecar_loadgen::BenchConfig {
        target: args.target,
        concurrency: args.concurrency.max(1),
        tokens: args.tokens,
        duration: Some(args.duration),
        calls: args.calls,
        connections: args.connections.max(1),
        prompt_tokens: args.prompt_tokens,
    };
    match runtime().block_on(llm_sidecar_loadgen::run(config)) {
        Ok(report) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).unwrap_or_default()
                );
            } else {
                print!("{report}");
            }
            i32::from(!report.errors.is_empty())
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// `llm-sidecar instances`.
pub fn instances(args: InstancesArgs) -> i32 {
    let uri = match DiscoveryUri::parse(&args.discovery) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let etcd_tls = match args.etcd_tls.load() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let listed = runtime().block_on(async {
        match &uri {
            DiscoveryUri::File(dir) => FileDiscovery::new(dir.clone()).list().await,
            DiscoveryUri::Etcd(endpoints) => {
                let bound = Duration::from_secs(5);
                EtcdDiscovery::new(
                    endpoints.clone(),
                    Duration::from_secs(10),
                    bound,
                    etcd_tls.as_ref(),
                )?
                .list()
                .await
            }
        }
    });
    let listed = match listed {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot read {uri}: {e}");
            return 1;
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&listed).unwrap_or_else(|_| "[]".into())
        );
        return 0;
    }
    if listed.is_empty() {
        println!("no instances registered in {uri}");
        return 0;
    }
    println!(
        "{:<18} {:<10} {:<22} {:<8} {:<28} {:<8} REGISTERED",
        "INSTANCE", "ENGINE", "ADDRESS", "PID", "MODEL", "VERSION"
    );
    for entry in &listed {
        match &entry.content {
            Listed::Record(r) => println!(
                "{:<18} {:<10} {:<22} {:<8} {:<28} {:<8} {}",
                r.instance_id,
                r.engine.kind,
                r.address,
                r.pid,
                r.model.name,
                r.engine.version,
                r.registered_at
            ),
            Listed::Invalid { error } => {
                println!("{:<18} invalid record at {}: {error}", "-", entry.key)
            }
        }
    }
    0
}
