//! The driver: one loop that feeds the core and carries out what it decides.
//!
//! Shape (quinn's `ConnectionDriver`): perform the core's actions in order,
//! wait for the next input or the next deadline, feed it to the [`Lifecycle`],
//! repeat, until the core says exit; then shut down with a bound.
//!
//! ```text
//! loop {
//!     if let Some(code) = driver.perform_actions() { return driver.shutdown(code) }
//!     let input = driver.next_input().await;
//!     driver.step(input);
//! }
//! ```
//!
//! The tasks it starts (the admin server, the request plane, the engine's
//! start-up wait, the discovery worker, the monitors) report to it through
//! channels and decide nothing about the lifecycle.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use llm_sidecar_core::{
    Action, Admission, Config as CoreConfig, DiscoveryEvent, EngineEvent, Event, ExitReason,
    Health, Level, Lifecycle, Time,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;

use crate::admin::{self, status::Shared};
use crate::config::RunConfig;
use crate::discovery::worker::DiscoveryOp;
use crate::discovery::{
    Discovery, DiscoveryUri, EngineRecord, EtcdDiscovery, FileDiscovery, Record,
};
use crate::engine::startup::EngineReady;
use crate::engine::{self, EngineInfo, EngineProfile, Following};
use crate::exit_bounds::CONNECTIONS_CLOSE;
use crate::request_plane::{self, HostedCalls, OwnHealth, Plane};

/// Why `run` could not start. The process exits 2: nothing was contacted.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A listen address could not be bound.
    #[error(transparent)]
    Bind(#[from] crate::net::BindError),
    /// The engine address cannot be used for a connection.
    #[error("--engine-endpoint {address}: {message}")]
    Engine {
        /// The address.
        address: String,
        /// What is wrong.
        message: String,
    },
    /// A request-plane thread could not be started.
    #[error("cannot start a request-plane thread: {0}")]
    Threads(std::io::Error),
    /// The discovery backend is not available.
    #[error("discovery {uri}: {message}")]
    Discovery {
        /// The URI.
        uri: String,
        /// What is wrong.
        message: String,
    },
}

/// Runs the sidecar until the core decides to exit; returns the exit reason.
///
/// `shutdown` delivers one item per SIGTERM/SIGINT (tests send their own).
pub async fn run(
    config: RunConfig,
    shutdown: mpsc::UnboundedReceiver<()>,
) -> Result<ExitReason, RunError> {
    match config.discovery.clone() {
        DiscoveryUri::File(dir) => {
            let discovery = Arc::new(FileDiscovery::new(dir, config.timings.retry_interval));
            Ok(start(config, discovery, Front::Proxy, shutdown)
                .await?
                .drive()
                .await)
        }
        DiscoveryUri::Etcd(endpoints) => {
            let etcd = EtcdDiscovery::new(
                endpoints,
                config.timings.lease_ttl,
                config.timings.connect_attempt_timeout,
                config.etcd_tls.as_ref(),
            )
            .map_err(|e| RunError::Discovery {
                uri: config.discovery.to_string(),
                message: crate::report::error_chain(&e),
            })?;
            Ok(start(config, Arc::new(etcd), Front::Proxy, shutdown)
                .await?
                .drive()
                .await)
        }
        DiscoveryUri::Kubernetes { .. } => Err(RunError::Discovery {
            uri: config.discovery.to_string(),
            message: "Kubernetes discovery is Dynamo's; llm-sidecar-dynamo registers there".into(),
        }),
    }
}

/// Where the worker's calls arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// The gRPC proxy on `--listen` (`llm-sidecar run`).
    Proxy,
    /// Another system's request plane (Dynamo's, in `llm-sidecar-dynamo`):
    /// nothing is bound for calls here, and the caller admits its calls
    /// through [`Started::calls`]. The instance id is that system's (Dynamo's
    /// connection id), so the sidecar's log lines and the other system's
    /// records name the worker alike. Such a worker cannot take a new id, so
    /// `--on-engine-loss rejoin` is for [`Front::Proxy`] only.
    Hosted {
        /// The worker's instance id in the other system.
        instance_id: u64,
    },
}

/// A sidecar whose listeners are bound and tasks started, before its loop runs.
pub struct Started {
    driver: Driver,
}

impl Started {
    /// Admission for calls arriving on a [`Front::Hosted`] request plane: the
    /// same gate, drain-deadline cut and call account as the proxy's.
    pub fn calls(&self) -> HostedCalls {
        HostedCalls {
            plane: self.driver.plane.clone(),
        }
    }

    /// Runs the loop until the core decides to exit; returns the exit reason.
    pub async fn drive(self) -> ExitReason {
        self.driver.drive().await
    }
}

/// Binds the listeners (the admin port; the request plane for
/// [`Front::Proxy`]) and starts every task with `discovery` as the registry;
/// nothing is decided until [`Started::drive`].
pub async fn start<D: Discovery>(
    config: RunConfig,
    discovery: Arc<D>,
    front: Front,
    shutdown: mpsc::UnboundedReceiver<()>,
) -> Result<Started, RunError> {
    Ok(Started {
        driver: Driver::start(config, discovery, front, shutdown).await?,
    })
}

/// One input for the core, as the driver received it.
enum Input {
    /// The engine answered its start-up calls.
    EngineReady(EngineReady),
    /// A monitor or the discovery worker reported something.
    Event(Event),
    /// Discovery dropped the record on its own (an etcd lease expired, the
    /// record was removed), and why.
    RegistrationLost(String),
    /// SIGTERM or SIGINT.
    Signal,
    /// The signal source is gone; no more signals will come.
    SignalsClosed,
    /// The last call left a closed gate.
    Drained,
    /// The core's deadline passed.
    Timeout,
}

/// Where the driver's inputs come from.
struct Inputs {
    ready: mpsc::Receiver<EngineReady>,
    events: mpsc::Receiver<Event>,
    lost: mpsc::UnboundedReceiver<String>,
    /// `None` once the signal source has closed.
    shutdown: Option<mpsc::UnboundedReceiver<()>>,
}

/// The core's clock: `Time` is the monotonic time since the driver started,
/// and the same origin on the wall clock places deadlines for `/state`.
struct Clock {
    origin: tokio::time::Instant,
    wall_origin: SystemTime,
}

impl Clock {
    fn now(&self) -> Time {
        Time::from(self.origin.elapsed())
    }
}

/// Everything the loop owns between two inputs.
struct Driver {
    config: RunConfig,
    lifecycle: Lifecycle,
    clock: Clock,
    instance_hex: String,
    plane: Arc<Plane>,
    own_health: OwnHealth,
    status: Shared,
    /// The engine's self-description and connection, once it answered.
    engine: Option<EngineReady>,
    /// Cancels the running monitors.
    monitors: Option<CancellationToken>,
    /// Cancels every task the driver started.
    root: CancellationToken,
    /// The request plane's connection tasks, waited for at exit.
    connections: TaskTracker,
    inputs: Inputs,
    /// Monitors report here (the other end is `inputs.events`).
    events: mpsc::Sender<Event>,
    discovery_ops: mpsc::UnboundedSender<DiscoveryOp>,
    /// How to wait for the engine, kept for a rejoin's second start-up.
    startup: engine::startup::StartupWait,
    /// Where a start-up wait reports the engine ready (`inputs.ready`).
    ready_tx: mpsc::Sender<EngineReady>,
    /// When admission last closed, until the gate says drained: the start of
    /// the drain's duration.
    drain_started: Option<std::time::Instant>,
}

impl Driver {
    /// Binds the listeners and starts every task; nothing is decided yet.
    async fn start<D: Discovery>(
        mut config: RunConfig,
        discovery: Arc<D>,
        front: Front,
        shutdown: mpsc::UnboundedReceiver<()>,
    ) -> Result<Driver, RunError> {
        config.limits.max_connections =
            crate::net::room_for_connections(config.limits.max_connections);
        let admin_listener = match config.admin_listen {
            Some(address) => Some(crate::net::bind("admin", address).await?),
            None => None,
        };
        let listener = match front {
            Front::Proxy => Some(crate::net::bind("request plane", config.listen).await?),
            Front::Hosted { .. } => None,
        };
        let (engine_endpoint, stream_limit, pool) = engine_side(&config)?;
        let own_health = OwnHealth::new();
        let plane = Arc::new(Plane::new(pool, &own_health, config.limits));
        let instance_id = match front {
            Front::Proxy => new_instance_id(),
            Front::Hosted { instance_id } => instance_id,
        };
        let instance_hex = format!("{instance_id:x}");
        let clock = Clock {
            origin: tokio::time::Instant::now(),
            wall_origin: SystemTime::now(),
        };
        let lifecycle = Lifecycle::new(core_config(&config, instance_id), clock.now());

        let root = CancellationToken::new();
        let status = Shared::default();
        status.update(|s| {
            s.live = true;
            s.instance_id = instance_hex.clone();
        });
        let connections = TaskTracker::new();
        let shards = listener
            .as_ref()
            .map(|_| request_plane::Shards::start(config.worker_threads))
            .transpose()
            .map_err(RunError::Threads)?;
        spawn_servers(
            (admin_listener, listener.zip(shards)),
            &config,
            &plane,
            &status,
            (&root, &connections),
        );
        let (ready_tx, ready) = mpsc::channel(1);
        let wait = engine::startup::StartupWait {
            choice: config.engine,
            liveness_service: config.liveness_service.clone(),
            address: config.engine_endpoint.clone(),
            endpoint: engine_endpoint,
            limit: stream_limit,
            attempt_bound: config.timings.connect_attempt_timeout,
            retry_interval: config.timings.retry_interval,
            rejoin: false,
        };
        tokio::spawn(engine::startup::wait_for_engine(
            wait.clone(),
            ready_tx.clone(),
            root.child_token(),
        ));
        let (events_tx, events) = mpsc::channel(256);
        let (discovery_ops, lost) = spawn_discovery_worker(
            discovery,
            events_tx.clone(),
            config.timings.connect_attempt_timeout,
            status.clone(),
        );
        log_start(&config, front, &instance_hex);
        Ok(Driver {
            config,
            lifecycle,
            clock,
            instance_hex,
            plane,
            own_health,
            status,
            engine: None,
            monitors: None,
            root,
            connections,
            inputs: Inputs {
                ready,
                events,
                lost,
                shutdown: Some(shutdown),
            },
            events: events_tx,
            discovery_ops,
            startup: wait,
            ready_tx,
            drain_started: None,
        })
    }

    /// The loop: perform, wait, feed; until the core says exit.
    async fn drive(mut self) -> ExitReason {
        loop {
            if let Some(code) = self.perform_actions() {
                return self.shutdown(code).await;
            }
            let input = self.next_input().await;
            self.step(input);
        }
    }

    /// Performs every pending action, in order. Returns the exit reason when
    /// the core decided to exit (always its last action).
    fn perform_actions(&mut self) -> Option<ExitReason> {
        while let Some(action) = self.lifecycle.poll_action() {
            match action {
                Action::Register => self.register(),
                Action::Withdraw => {
                    let _ = self.discovery_ops.send(DiscoveryOp::Withdraw);
                }
                Action::SetAdmission(Admission::Open) => {
                    self.drain_started = None;
                    self.plane.gate.open();
                }
                Action::SetAdmission(Admission::Closed) => {
                    self.drain_started = Some(std::time::Instant::now());
                    if self.plane.gate.close().drained {
                        self.plane.drained.notify_one();
                    }
                }
                Action::SetHealth(health) => {
                    let serving = health == Health::Serving;
                    self.plane.serving.store(serving, Ordering::Release);
                    self.own_health.set(serving);
                }
                Action::StartMonitors => self.start_monitors(),
                Action::StopMonitors => {
                    if let Some(token) = self.monitors.take() {
                        token.cancel();
                    }
                }
                Action::Log { level, message } => match level {
                    Level::Info => tracing::info!("{message}"),
                    Level::Warn => tracing::warn!("{message}"),
                    Level::Error => tracing::error!("{message}"),
                },
                Action::CancelInFlight => self.plane.cut_all(),
                Action::Rejoin { instance_id } => self.rejoin(instance_id),
                Action::Exit(code) => return Some(code),
            }
        }
        None
    }

    /// Publishes the state for the admin port, then waits for whichever comes
    /// first: an input from a task, a signal, the drain, or the core's deadline.
    async fn next_input(&mut self) -> Input {
        let deadline = self.lifecycle.poll_timeout();
        self.status.publish(
            &self.lifecycle,
            deadline,
            self.clock.wall_origin,
            self.plane.gate.in_flight(),
        );
        let sleep = async {
            match deadline {
                Some((at, _)) => {
                    tokio::time::sleep_until(self.clock.origin + at.since_origin()).await;
                }
                None => std::future::pending().await,
            }
        };
        let inputs = &mut self.inputs;
        let signal = async {
            match inputs.shutdown.as_mut() {
                Some(signals) => signals.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(ready) = inputs.ready.recv() => Input::EngineReady(ready),
            Some(event) = inputs.events.recv() => Input::Event(event),
            Some(cause) = inputs.lost.recv() => Input::RegistrationLost(cause),
            signal = signal => match signal {
                Some(()) => Input::Signal,
                None => Input::SignalsClosed,
            },
            () = self.plane.drained.notified() => Input::Drained,
            () = sleep => Input::Timeout,
        }
    }

    /// Feeds one input to the core. The gate counts calls; the core first
    /// hears the count (when it changed), so no decision or log line rests on
    /// a stale count.
    fn step(&mut self, input: Input) {
        let now = self.clock.now();
        let in_flight = self.plane.gate.in_flight();
        if in_flight != self.lifecycle.in_flight() {
            self.lifecycle
                .handle_event(now, Event::InFlightChanged { count: in_flight });
        }
        let event = match input {
            Input::EngineReady(ready) => {
                let info = &ready.info;
                let profile = info.profile();
                // From now on the request plane knows the API's own names.
                if let Some(rpc) = profile.health_rpc {
                    let _ = self.plane.health_rpc_path.set(rpc);
                }
                self.own_health.name_engine_service(profile.service);
                let event = Event::Engine(EngineEvent::Ready {
                    identity: info.identity.clone(),
                    name: info.display_name.clone(),
                    instance: info.instance_id.clone(),
                    liveness_service: self.liveness_service(profile),
                });
                let identity = info.identity.clone();
                self.status.update(|s| s.engine_identity = Some(identity));
                self.engine = Some(ready);
                event
            }
            Input::Event(event) => {
                self.status.note_event(&event);
                event
            }
            Input::RegistrationLost(cause) => {
                Event::Discovery(DiscoveryEvent::RegistrationLost { cause })
            }
            Input::Signal => {
                tracing::info!("received a shutdown signal");
                Event::ShutdownSignal
            }
            Input::SignalsClosed => {
                self.inputs.shutdown = None;
                return;
            }
            Input::Drained => {
                if let Some(started) = self.drain_started.take() {
                    let took = started.elapsed().as_secs_f64();
                    self.status.update(|s| s.times.drain.observe(took));
                }
                return;
            }
            Input::Timeout => return self.lifecycle.handle_timeout(now),
        };
        self.lifecycle.handle_event(now, event);
    }

    /// The grpc.health.v1 service followed for liveness: the flag's, or the kind's.
    fn liveness_service(&self, profile: &EngineProfile) -> String {
        self.config
            .liveness_service
            .clone()
            .unwrap_or_else(|| profile.liveness_service.to_string())
    }

    /// The core withdrew and drained a loss and waits for the engine again
    /// (`--on-engine-loss rejoin`): forget the engine, take the new instance
    /// id, run the start-up wait once more. The request plane's engine
    /// connections reconnect by themselves; admission stays closed until the
    /// core serves again.
    fn rejoin(&mut self, instance_id: u64) {
        self.instance_hex = format!("{instance_id:x}");
        self.engine = None;
        // A call cut at the drain deadline must not cut the next instance's.
        self.plane.renew_cut();
        let hex = self.instance_hex.clone();
        self.status.update(|s| {
            s.instance_id = hex;
            s.engine_identity = None;
            s.record_location = None;
            s.liveness_status = None;
            s.last_fresh_probe = None;
            s.load_unsupported = false;
        });
        let wait = engine::startup::StartupWait {
            rejoin: true,
            ..self.startup.clone()
        };
        tokio::spawn(engine::startup::wait_for_engine(
            wait,
            self.ready_tx.clone(),
            self.root.child_token(),
        ));
    }

    /// Hands the worker's record to the discovery worker.
    fn register(&mut self) {
        let Some(ready) = &self.engine else {
            return;
        };
        let record = record(&self.config, &self.instance_hex, &ready.info);
        let _ = self
            .discovery_ops
            .send(DiscoveryOp::Register(Box::new(record)));
    }

    /// Starts the monitors on the engine's connection, as its kind has them:
    /// the liveness Watch or poll, the stale-load probe, and for kinds without
    /// an identity the watch on the connection itself.
    fn start_monitors(&mut self) {
        let Some(ready) = &self.engine else {
            return;
        };
        let profile = ready.info.profile();
        let service = self.liveness_service(profile);
        let channel: Channel = ready.channel.clone();
        let token = self.root.child_token();
        let t = &self.config.timings;
        match profile.following {
            Following::Watch => {
                // Without a liveness service, an engine with no identity of
                // its own process (an older TensorRT-LLM image on the trtllm
                // API) is followed by its connection; one with an instance
                // id (OpenEngine) is told apart by that id on restart, and
                // its connection may be cut and made again.
                let fallback = ready
                    .info
                    .instance_id
                    .is_none()
                    .then(|| ready.connection.clone());
                tokio::spawn(engine::monitors::watch_liveness(
                    channel.clone(),
                    service,
                    t.connect_attempt_timeout,
                    fallback,
                    self.events.clone(),
                    token.clone(),
                ));
            }
            Following::EngineState if self.config.liveness_service.is_none() => {
                tokio::spawn(engine::sglang_native::follow_state(
                    channel.clone(),
                    t.health_poll_interval,
                    t.connect_attempt_timeout,
                    ready.connection.clone(),
                    self.events.clone(),
                    token.clone(),
                ));
            }
            Following::Poll | Following::EngineState => {
                tokio::spawn(engine::monitors::poll_health(
                    channel.clone(),
                    service,
                    t.health_poll_interval,
                    t.connect_attempt_timeout,
                    self.events.clone(),
                    token.clone(),
                ));
            }
        }
        if profile.connection_is_identity {
            tokio::spawn(engine::monitors::watch_connection(
                ready.connection.clone(),
                self.events.clone(),
                token.clone(),
            ));
        }
        // An engine without a load RPC is followed by its connection instead
        // of the stale-load rule; kinds that follow it already need no second watch.
        let unfollowed = (!profile.connection_is_identity).then(|| ready.connection.clone());
        tokio::spawn(engine::monitors::probe(
            profile.kind,
            channel,
            t.probe_interval,
            unfollowed,
            self.events.clone(),
            token.clone(),
        ));
        self.monitors = Some(token);
    }

    /// Decide (done), tell, wait with a bound: cut calls end with their
    /// trailers, connections send GOAWAY and flush, then the process goes.
    async fn shutdown(self, code: ExitReason) -> ExitReason {
        self.status.update(|s| {
            s.state = "Exited";
            s.live = false;
        });
        self.root.cancel();
        self.connections.close();
        if tokio::time::timeout(CONNECTIONS_CLOSE, self.connections.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                "request-plane connections did not close within {}; exiting anyway",
                llm_sidecar_core::HumanDuration(CONNECTIONS_CLOSE)
            );
        }
        // The sidecar's side of the call account, once /metrics is gone.
        tracing::info!(
            "request plane account at exit: {} in_flight={}",
            self.plane.counters.account(),
            self.plane.gate.in_flight()
        );
        code
    }
}

/// The engine's side, before anything is contacted: the endpoint start-up
/// and monitors call, the stream limit they learn, and the request plane's
/// pool of engine connections.
fn engine_side(
    config: &RunConfig,
) -> Result<
    (
        tonic::transport::Endpoint,
        engine::StreamLimit,
        request_plane::EnginePool,
    ),
    RunError,
> {
    let bad_address = |message: String| RunError::Engine {
        address: config.engine_endpoint.clone(),
        message,
    };
    let channel = config.timings.engine_channel();
    let endpoint = engine::endpoint(&config.engine_endpoint, channel)
        .map_err(|e| bad_address(e.to_string()))?;
    let stream_limit = engine::StreamLimit::default();
    let pool = request_plane::EnginePool::new(
        &config.engine_endpoint,
        channel,
        stream_limit.clone(),
        config.limits.engine_connections.map(|n| n as usize),
    )
    .map_err(|e| bad_address(e.to_string()))?;
    Ok((endpoint, stream_limit, pool))
}

/// Serves the admin port and (for the proxy) the request plane on its
/// shards, each until `root` is cancelled; the request plane's connections
/// are tracked by `connections`.
fn spawn_servers(
    (admin_listener, listener): (
        Option<TcpListener>,
        Option<(TcpListener, Arc<request_plane::Shards>)>,
    ),
    config: &RunConfig,
    plane: &Arc<Plane>,
    status: &Shared,
    (root, connections): (&CancellationToken, &TaskTracker),
) {
    if let Some(admin_listener) = admin_listener {
        tokio::spawn(admin::http::serve(
            admin_listener,
            admin::routes::handler(status.clone(), plane.clone()),
            root.child_token(),
        ));
    }
    if let Some((listener, shards)) = listener {
        tokio::spawn(request_plane::serve(
            listener,
            config.tls.clone(),
            plane.clone(),
            root.child_token(),
            connections.clone(),
            shards,
        ));
    }
}

/// Starts the discovery worker; returns where to send it writes, and where it
/// reports that the store dropped the record.
fn spawn_discovery_worker<D: Discovery>(
    discovery: Arc<D>,
    events: mpsc::Sender<Event>,
    bound: std::time::Duration,
    status: Shared,
) -> (
    mpsc::UnboundedSender<DiscoveryOp>,
    mpsc::UnboundedReceiver<String>,
) {
    let (ops_tx, ops_rx) = mpsc::unbounded_channel();
    let (lost_tx, lost) = mpsc::unbounded_channel();
    let written = move |location| status.update(|s| s.record_location = Some(location));
    tokio::spawn(crate::discovery::worker::run(
        discovery, ops_rx, events, lost_tx, bound, written,
    ));
    (ops_tx, lost)
}

/// The first line: who this is, what it waits for, where everything is.
fn log_start(config: &RunConfig, front: Front, instance_hex: &str) {
    tracing::info!(
        engine = %config.engine_endpoint,
        discovery = %config.discovery,
        admin = %config.admin_listen.map_or("off".to_string(), |a| a.to_string()),
        request_plane = match (front, &config.tls) {
            (Front::Hosted { .. }, _) => "hosted (another system's request plane)",
            (Front::Proxy, None) => "h2 plaintext",
            (Front::Proxy, Some(t)) if t.mutual => "h2 over TLS, client certificates required",
            (Front::Proxy, Some(_)) => "h2 over TLS",
        },
        "llm-sidecar starting: instance {instance_hex}, waiting for the {}engine at {}",
        match config.engine.display_name() {
            "" => String::new(),
            name => format!("{name} "),
        },
        config.engine_endpoint,
    );
}

/// The worker's discovery record, as of now.
fn record(config: &RunConfig, instance_hex: &str, info: &EngineInfo) -> Record {
    Record {
        instance_id: instance_hex.to_string(),
        namespace: config.namespace.clone(),
        component: config.component.clone(),
        endpoint: config.endpoint.clone(),
        address: config.advertise.clone(),
        transport: "grpc".into(),
        engine: EngineRecord {
            kind: info.profile().name.into(),
            version: info.version.clone(),
            identity: info.identity.clone(),
        },
        model: info.model.clone(),
        pid: std::process::id(),
        registered_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
    }
}

/// A fresh random instance id (no RNG dependency: std's randomly keyed hasher).
fn new_instance_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish()
}

fn core_config(config: &RunConfig, instance_id: u64) -> CoreConfig {
    let t = &config.timings;
    CoreConfig {
        on_engine_loss: config.on_engine_loss,
        engine_display_name: config.engine.display_name().to_string(),
        instance_id,
        retry_interval: t.retry_interval,
        startup_deadline: t.startup_deadline,
        stale_after: t.stale_after,
        router_grace: t.router_grace,
        drain_timeout: t.drain_timeout,
        reregister_deadline: t.reregister_deadline,
    }
}
