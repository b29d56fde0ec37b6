//! `llm-sidecar run`: the production job.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use llm_sidecar_core::OnEngineLoss;
use llm_sidecar_flags::LifecycleFlags;
use llm_sidecar_io::discovery::DiscoveryUri;
use llm_sidecar_io::request_plane::Limits;
use llm_sidecar_io::tls::ServerTlsFiles;
use llm_sidecar_io::{ConfigError, RunConfig, Timings, parse_host_port, parse_key_segment};

use crate::runtime::{runtime, shutdown_signals};
use crate::shared::{EngineKindArg, EtcdTlsArgs, Exit, LogFormat, duration};

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
    /// Which engine API the engine beside the sidecar serves; auto finds out
    /// at start-up (and logs what it found).
    #[arg(long, env = "SIDECAR_ENGINE_KIND", value_enum, default_value = "auto")]
    pub engine_kind: EngineKindArg,
    /// Where clients (routers, gateways) call the sidecar (host:port to bind).
    #[arg(long, env = "SIDECAR_LISTEN", default_value = "127.0.0.1:50061")]
    pub listen: SocketAddr,
    /// The address written to discovery for clients to call (default: --listen).
    #[arg(long, env = "SIDECAR_ADVERTISE")]
    pub advertise: Option<String>,
    /// Admin HTTP server: /live, /ready (also /health), /state, /metrics. Keep it on loopback
    /// unless something outside the pod must scrape it.
    #[arg(long, env = "SIDECAR_ADMIN_LISTEN", default_value = "127.0.0.1:9090")]
    pub admin_listen: SocketAddr,
    /// Where the worker is registered: file:<dir> (embedded, one JSON file per
    /// worker) or etcd://host:port[,host:port...].
    // The doc comment is --help text, where `<dir>` reads as it should.
    #[allow(rustdoc::invalid_html_tags)]
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
    /// The grpc.health.v1 service followed for liveness (default: the kind's:
    /// "liveness" for TensorRT-LLM, the engine's service name for vLLM and SGLang).
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
    /// How often liveness is polled (Check) for kinds whose Watch ends after one
    /// message (vLLM, SGLang): a NOT_SERVING is noticed within this.
    #[arg(long, env = "SIDECAR_HEALTH_POLL_INTERVAL", default_value = "100ms", value_parser = duration)]
    pub health_poll_interval: Duration,
    /// After an engine loss (withdrawn, drained): `exit` 1 for the supervisor
    /// to restart the sidecar, or `rejoin`: wait for the engine again and
    /// register anew under a new instance id, in the same process, for
    /// supervisors that restart the engine themselves.
    #[arg(
        long,
        env = "SIDECAR_ON_ENGINE_LOSS",
        value_enum,
        default_value = "exit"
    )]
    pub on_engine_loss: OnEngineLossArg,
    /// TTL of the etcd lease behind the record (kept alive at TTL/3).
    #[arg(long, env = "SIDECAR_LEASE_TTL", default_value = "10s", value_parser = duration)]
    pub lease_ttl: Duration,
    /// Largest gRPC message the request plane forwards, either direction, in
    /// bytes; a larger one fails that call with RESOURCE_EXHAUSTED.
    #[arg(long, env = "SIDECAR_MAX_MESSAGE_BYTES", default_value_t = Limits::DEFAULT.max_message_bytes)]
    pub max_message_bytes: u32,
    /// Concurrent calls (HTTP/2 streams) one client connection may have open.
    /// A client address is not capped across its connections: it may take
    /// every engine stream nobody else wants, and when they run short each
    /// address gets its fair share at once and the rest wait in turn.
    #[arg(long, env = "SIDECAR_MAX_CONCURRENT_STREAMS", default_value_t = Limits::DEFAULT.max_concurrent_streams)]
    pub max_concurrent_streams: u32,
    /// Largest header list (metadata) a client may send, and an engine answer
    /// may carry back (headers, trailers), in bytes; at least 1024.
    #[arg(long, env = "SIDECAR_MAX_HEADER_LIST_BYTES", default_value_t = Limits::DEFAULT.max_header_list_bytes)]
    pub max_header_list_bytes: u32,
    /// Caller connections open at once; a new one past it is closed at once.
    /// The open-file limit is raised to fit them when the hard limit allows.
    #[arg(long, env = "SIDECAR_MAX_CONNECTIONS", default_value_t = Limits::DEFAULT.max_connections)]
    pub max_connections: u32,
    /// How long a new caller connection has (after TLS) to send the HTTP/2
    /// preface and its first frame; silent connections are closed.
    #[arg(long, env = "SIDECAR_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub handshake_timeout: Duration,
    /// A caller connection with no call open this long gets GOAWAY (callers
    /// reconnect when they next call).
    #[arg(long, env = "SIDECAR_IDLE_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub idle_timeout: Duration,
    /// Control frames (PING, SETTINGS, PRIORITY, WINDOW_UPDATE, RST_STREAM,
    /// empty DATA) a caller connection may send per second, beyond 10 per frame
    /// of real work; past it the connection gets GOAWAY ENHANCE_YOUR_CALM.
    #[arg(long, env = "SIDECAR_CONTROL_FRAME_BUDGET", default_value_t = Limits::DEFAULT.control_frame_budget)]
    pub control_frame_budget: u32,
    /// HTTP/2 connections to the engine at most: another opens only when every
    /// open one carries as many calls as the engine allows per connection.
    /// Default: as many as 32,768 engine streams need at the engine's limit
    /// per connection (16 at 2,048), of which clients may take 16,384 before
    /// they compete. Set, clients may take half of what N connections carry.
    #[arg(long, env = "SIDECAR_ENGINE_CONNECTIONS")]
    pub engine_connections: Option<u32>,
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
    pub lifecycle: LifecycleFlags,
    #[command(flatten)]
    pub etcd_tls: EtcdTlsArgs,
    /// Threads the request plane runs callers' connections on (the driver's
    /// own among them): a count, or `auto`, one per CPU the process may use
    /// (its affinity and cgroup CPU quota), at most 4. Each thread serves its
    /// connections and the engine connections their calls open alone, so a
    /// token never crosses threads and an idle thread costs nothing; one
    /// caller connection stays on one thread. One is the default: measured on
    /// two cores shared with the engine, a second thread cut the added
    /// first-token time of bursts but cost CPU per message and, at
    /// saturation, the engine's share of the cores (docs/PERFORMANCE.md).
    /// Give the sidecar CPUs of its own before raising it.
    #[arg(long, env = "SIDECAR_WORKER_THREADS", default_value = "1", value_parser = worker_threads)]
    pub worker_threads: WorkerThreads,
    /// Log format (stderr).
    #[arg(long, env = "SIDECAR_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl RunArgs {
    /// Checks every flag and builds the settings, or says what is wrong.
    pub fn into_config(self) -> Result<RunConfig, ConfigError> {
        let engine = self.engine_kind.choice();
        let timings = self.lifecycle.timings(Timings {
            connect_attempt_timeout: self.connect_attempt_timeout,
            retry_interval: self.retry_interval,
            startup_deadline: self.startup_deadline,
            health_poll_interval: self.health_poll_interval,
            lease_ttl: self.lease_ttl,
            ..Timings::default()
        });
        timings.check()?;
        let advertise = match self.advertise {
            Some(a) => parse_host_port("--advertise", &a)?,
            None => self.listen.to_string(),
        };
        let limits = Limits {
            max_message_bytes: self.max_message_bytes,
            max_concurrent_streams: self.max_concurrent_streams,
            max_header_list_bytes: self.max_header_list_bytes,
            max_connections: self.max_connections,
            handshake_timeout: self.handshake_timeout,
            idle_timeout: self.idle_timeout,
            control_frame_budget: self.control_frame_budget,
            engine_connections: self.engine_connections,
        };
        limits.check()?;
        let discovery = DiscoveryUri::parse(&self.discovery)?;
        discovery.check_local()?;
        let liveness_service = self.liveness_service;
        Ok(RunConfig {
            engine_endpoint: parse_host_port("--engine-endpoint", &self.engine_endpoint)?,
            engine,
            listen: self.listen,
            advertise,
            admin_listen: Some(self.admin_listen),
            discovery,
            namespace: parse_key_segment("--namespace", &self.namespace)?,
            component: parse_key_segment("--component", &self.component)?,
            endpoint: parse_key_segment("--endpoint", &self.endpoint)?,
            liveness_service,
            timings,
            limits,
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
            on_engine_loss: match self.on_engine_loss {
                OnEngineLossArg::Exit => OnEngineLoss::Exit,
                OnEngineLossArg::Rejoin => OnEngineLoss::Rejoin,
            },
            worker_threads: match self.worker_threads {
                WorkerThreads::Auto => llm_sidecar_io::auto_worker_threads(),
                WorkerThreads::Count(n) => usize::from(n),
            },
        })
    }
}

/// `--worker-threads`: a count, or one per CPU the process may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerThreads {
    /// One per CPU the process may use, at most 4.
    Auto,
    /// This many.
    Count(u16),
}

/// Parses `--worker-threads`: `auto`, or 1 to 1024.
fn worker_threads(value: &str) -> Result<WorkerThreads, String> {
    if value == "auto" {
        return Ok(WorkerThreads::Auto);
    }
    match value.parse::<u16>() {
        Ok(n @ 1..=1024) => Ok(WorkerThreads::Count(n)),
        _ => Err(format!("`{value}` is not `auto` or a count from 1 to 1024")),
    }
}

/// What follows an engine loss's withdrawal and drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnEngineLossArg {
    /// Exit 1; the supervisor restarts the sidecar.
    Exit,
    /// Wait for the engine again and register as a new instance.
    Rejoin,
}

/// `llm-sidecar run`.
pub fn run(args: RunArgs) -> Exit {
    let config = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::Usage;
        }
    };
    // The driver's runtime, one thread; the request plane adds its own
    // (`RunConfig::worker_threads`).
    runtime(Some(1)).block_on(async move {
        match llm_sidecar_io::run(config, shutdown_signals()).await {
            Ok(reason) => reason.into(),
            Err(e @ llm_sidecar_io::RunError::Threads(_)) => {
                tracing::error!("{e}");
                Exit::Runtime
            }
            Err(e) => {
                tracing::error!("{e}");
                Exit::Usage
            }
        }
    })
}
