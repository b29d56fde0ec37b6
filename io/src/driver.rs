//! The driver: one loop that feeds the core and carries out what it decides.
//!
//! Shape (quinn's ConnectionDriver): wait for the next input or the next
//! deadline, feed it to the [`Lifecycle`], perform every action in order, re-arm
//! the one timer, repeat, until the core says exit.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use llm_sidecar_core::{
    Action, Admission, Config as CoreConfig, Event, ExitCode, Level, Lifecycle,
    LivenessObservation, Phase, Time,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::admin_http::{self, Handler, Request, Response};
use crate::config::RunConfig;
use crate::discovery::{
    Discovery, DiscoveryError, DiscoveryUri, EngineRecord, EtcdDiscovery, FileDiscovery, Record,
};
use crate::engine::{self, EngineInfo, EngineProfile};
use crate::monitors;
use crate::own_health::OwnHealth;
use crate::proxy::{self, Plane, ProxyMetrics};
use crate::status::{Shared, loss_kind};

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
    /// The discovery backend is not available.
    #[error("discovery {uri}: {message}")]
    Discovery {
        /// The URI.
        uri: String,
        /// What is wrong.
        message: String,
    },
}

/// The engine answered its start-up calls; its connection is handed over.
type EngineReady = (EngineInfo, Channel);

enum DiscoveryOp {
    Register(Box<Record>),
    Withdraw,
}

/// Runs the sidecar until the core decides to exit; returns the exit code.
///
/// `shutdown` delivers one item per SIGTERM/SIGINT (tests send their own).
pub async fn run(
    config: RunConfig,
    shutdown: mpsc::UnboundedReceiver<()>,
) -> Result<ExitCode, RunError> {
    match config.discovery.clone() {
        DiscoveryUri::File(dir) => drive(config, Arc::new(FileDiscovery::new(dir)), shutdown).await,
        DiscoveryUri::Etcd(endpoints) => {
            let etcd = EtcdDiscovery::new(
                endpoints,
                config.timings.lease_ttl,
                config.timings.connect_attempt_timeout,
                config.etcd_tls.as_ref(),
            )
            .map_err(|e| RunError::Discovery {
                uri: config.discovery.to_string(),
                message: e.to_string(),
            })?;
            drive(config, Arc::new(etcd), shutdown).await
        }
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
        engine_display_name: config.engine.display_name().to_string(),
        liveness_service: config.liveness_service.clone(),
        instance_id,
        retry_interval: t.retry_interval,
        startup_deadline: t.startup_deadline,
        stale_after: t.stale_after,
        router_grace: t.router_grace,
        drain_timeout: t.drain_timeout,
    }
}

async fn drive<D: Discovery>(
    config: RunConfig,
    discovery: Arc<D>,
    mut shutdown: mpsc::UnboundedReceiver<()>,
) -> Result<ExitCode, RunError> {
    let admin = crate::net::bind("admin", config.admin_listen).await?;
    let listener = crate::net::bind("request plane", config.listen).await?;
    let engine_channel = engine::endpoint(&config.engine_endpoint, &config.timings)
        .map_err(|e| RunError::Engine {
            address: config.engine_endpoint.clone(),
            message: e.to_string(),
        })?
        .connect_lazy();
    let own_health = OwnHealth::new(config.engine.service_name());
    let plane = Arc::new(Plane {
        gate: llm_sidecar_core::gate::Gate::new(),
        serving: Default::default(),
        cut: CancellationToken::new(),
        drained: Default::default(),
        metrics: ProxyMetrics::default(),
        engine: engine_channel,
        health: own_health.server(),
        health_rpc_path: config.engine.health_rpc_path(),
        limits: config.limits,
    });
    let instance_id = new_instance_id();
    let instance_hex = format!("{instance_id:x}");
    let origin = tokio::time::Instant::now();
    // The same origin on the wall clock, for the deadlines `/state` shows: one
    // anchor, so an unchanged deadline always shows the same instant.
    let wall_origin = SystemTime::now();
    let now = move || Time::from(origin.elapsed());
    let mut lifecycle = Lifecycle::new(core_config(&config, instance_id), now());

    let root = CancellationToken::new();
    let status = Shared::default();
    status.update(|s| {
        s.live = true;
        s.instance_id = instance_hex.clone();
    });
    tokio::spawn(admin_http::serve(
        admin,
        admin_handler(status.clone(), plane.clone()),
        root.child_token(),
    ));
    let connections = tokio_util::task::TaskTracker::new();
    tokio::spawn(proxy::serve(
        listener,
        config.tls.clone(),
        plane.clone(),
        root.child_token(),
        connections.clone(),
    ));

    let (ready_tx, mut ready) = mpsc::channel::<EngineReady>(1);
    let (events_tx, mut events) = mpsc::channel::<Event>(256);
    let (lost_tx, mut lost) = mpsc::unbounded_channel::<()>();
    let (ops_tx, ops_rx) = mpsc::unbounded_channel::<DiscoveryOp>();

    tokio::spawn(wait_for_engine(
        config.clone(),
        ready_tx,
        root.child_token(),
    ));
    tokio::spawn(discovery_worker(
        discovery.clone(),
        ops_rx,
        events_tx.clone(),
        lost_tx,
        config.timings.connect_attempt_timeout,
        status.clone(),
    ));
    tracing::info!(
        engine = %config.engine_endpoint,
        discovery = %config.discovery,
        admin = %config.admin_listen,
        request_plane = match &config.tls {
            None => "h2 plaintext",
            Some(t) if t.mutual => "h2 over TLS, client certificates required",
            Some(_) => "h2 over TLS",
        },
        "llm-sidecar starting: instance {instance_hex}, waiting for the {} engine at {}",
        config.engine.display_name(),
        config.engine_endpoint,
    );

    let mut engine: Option<(EngineInfo, Channel)> = None;
    let mut monitors: Option<CancellationToken> = None;
    let mut shutdown_open = true;
    loop {
        // Perform what the core decided, in order.
        while let Some(action) = lifecycle.poll_action() {
            match action {
                Action::Register => {
                    let Some((info, _)) = &engine else { continue };
                    let record = Record {
                        instance_id: instance_hex.clone(),
                        namespace: config.namespace.clone(),
                        component: config.component.clone(),
                        endpoint: config.endpoint.clone(),
                        address: config.advertise.clone(),
                        transport: "grpc".into(),
                        engine: EngineRecord {
                            kind: config.engine.kind_name().into(),
                            version: info.version.clone(),
                            identity: info.identity.clone(),
                        },
                        model: info.model.clone(),
                        pid: std::process::id(),
                        registered_at: crate::timefmt::rfc3339(SystemTime::now()),
                    };
                    let _ = ops_tx.send(DiscoveryOp::Register(Box::new(record)));
                }
                Action::Withdraw => {
                    let _ = ops_tx.send(DiscoveryOp::Withdraw);
                }
                Action::SetAdmission(Admission::Open) => plane.gate.open(),
                Action::SetAdmission(Admission::Closed) => {
                    if plane.gate.close().drained {
                        plane.drained.notify_one();
                    }
                }
                Action::SetHealth(health) => {
                    let serving = health == llm_sidecar_core::Health::Serving;
                    plane.serving.store(serving, Ordering::Release);
                    own_health.set(serving);
                }
                Action::StartMonitors => {
                    if let Some((_, channel)) = &engine {
                        let token = root.child_token();
                        tokio::spawn(monitors::watch_liveness(
                            channel.clone(),
                            config.liveness_service.clone(),
                            config.timings.connect_attempt_timeout,
                            events_tx.clone(),
                            token.clone(),
                        ));
                        tokio::spawn(monitors::probe(
                            config.engine,
                            channel.clone(),
                            config.timings.probe_interval,
                            events_tx.clone(),
                            token.clone(),
                        ));
                        monitors = Some(token);
                    }
                }
                Action::StopMonitors => {
                    if let Some(token) = monitors.take() {
                        token.cancel();
                    }
                }
                Action::Log { level, message } => match level {
                    Level::Info => tracing::info!("{message}"),
                    Level::Warn => tracing::warn!("{message}"),
                    Level::Error => tracing::error!("{message}"),
                },
                Action::CancelInFlight => plane.cut.cancel(),
                Action::Exit(code) => {
                    status.update(|s| {
                        s.state = "Exited";
                        s.live = false;
                    });
                    // Decide (done), tell, wait with a bound: cut calls end with their
                    // trailers, connections send GOAWAY and flush, then we go.
                    root.cancel();
                    connections.close();
                    if tokio::time::timeout(Duration::from_secs(3), connections.wait())
                        .await
                        .is_err()
                    {
                        tracing::warn!(
                            "request-plane connections did not close within 3s; exiting anyway"
                        );
                    }
                    // The sidecar's side of the call account, once /metrics is gone.
                    tracing::info!(
                        "request plane account at exit: {} in_flight={}",
                        plane.metrics.account(),
                        plane.gate.in_flight()
                    );
                    return Ok(code);
                }
            }
        }
        // The gate counts calls; the core hears the count when it changed.
        let in_flight = plane.gate.in_flight();
        if in_flight != lifecycle.in_flight() {
            lifecycle.handle_event(now(), Event::InFlightChanged { count: in_flight });
            continue;
        }
        let deadline = lifecycle.poll_timeout();
        publish(&lifecycle, deadline, &status, wall_origin);

        let sleep = async {
            match deadline {
                Some((at, _)) => tokio::time::sleep_until(origin + at.since_origin()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some((info, channel)) = ready.recv() => {
                status.update(|s| s.engine_identity = Some(info.identity.clone()));
                let identity = info.identity.clone();
                engine = Some((info, channel));
                feed(&mut lifecycle, &plane.gate, now(), Event::EngineReady { identity });
            }
            Some(event) = events.recv() => {
                note_event(&event, &status);
                feed(&mut lifecycle, &plane.gate, now(), event);
            }
            Some(()) = lost.recv() => feed(&mut lifecycle, &plane.gate, now(), Event::RegistrationLost),
            signal = shutdown.recv(), if shutdown_open => match signal {
                Some(()) => {
                    tracing::info!("received a shutdown signal");
                    feed(&mut lifecycle, &plane.gate, now(), Event::ShutdownSignal);
                }
                None => shutdown_open = false,
            },
            () = plane.drained.notified() => {}
            () = sleep => lifecycle.handle_timeout(now()),
        }
    }
}

/// Feeds one event, first telling the core the gate's current in-flight count,
/// so decisions (and their log lines) never rest on a stale count.
fn feed(lifecycle: &mut Lifecycle, gate: &llm_sidecar_core::gate::Gate, now: Time, event: Event) {
    let in_flight = gate.in_flight();
    if in_flight != lifecycle.in_flight() {
        lifecycle.handle_event(now, Event::InFlightChanged { count: in_flight });
    }
    lifecycle.handle_event(now, event);
}

/// Metrics derived from events before the core sees them.
fn note_event(event: &Event, status: &Shared) {
    match event {
        Event::Liveness(LivenessObservation::Status(raw)) => {
            status.update(|s| s.liveness_status = Some(*raw));
        }
        Event::ProbeSucceeded => status.update(|s| s.last_fresh_probe = Some(Instant::now())),
        Event::Withdrawn => status.update(|s| {
            if let Some(at) = s.lost_at.take() {
                s.loss_to_withdraw = Some(at.elapsed());
            }
        }),
        Event::RegistrationFailed { .. } | Event::WithdrawFailed { .. } => {
            status.update(|s| s.discovery_write_failures += 1);
        }
        _ => {}
    }
}

/// Copies the lifecycle's state into the admin view after every step.
fn publish(
    lifecycle: &Lifecycle,
    deadline: Option<(Time, &'static str)>,
    status: &Shared,
    wall_origin: SystemTime,
) {
    let phase = lifecycle.phase();
    status.update(|s| {
        let name = phase.name();
        if s.state != name {
            s.since = Some(SystemTime::now());
            if phase == Phase::Lost {
                s.lost_at = Some(Instant::now());
                let kind = loss_kind(lifecycle.reason().unwrap_or(""));
                *s.losses.entry(kind).or_default() += 1;
            }
            if phase == Phase::Serving && s.last_fresh_probe.is_none() {
                s.last_fresh_probe = Some(Instant::now());
            }
        }
        s.state = name;
        s.reason = lifecycle.reason().map(str::to_string);
        s.in_flight = lifecycle.in_flight();
        s.deadline = deadline.map(|(at, why)| (wall_origin + at.since_origin(), why));
    });
}

fn admin_handler(status: Shared, plane: Arc<Plane>) -> Handler {
    Arc::new(move |req: &Request| {
        if req.method != "GET" && req.method != "HEAD" {
            return Response::text(405, "only GET\n");
        }
        match req.path.as_str() {
            "/live" => status.read(|s| {
                if s.live {
                    Response::text(200, "live\n")
                } else {
                    Response::text(503, "exiting\n")
                }
            }),
            "/ready" => status.read(|s| {
                if s.state == "Serving" {
                    Response::text(200, "ready\n")
                } else {
                    Response::text(503, format!("not ready: {}\n", s.state))
                }
            }),
            "/state" => Response::json(200, status.read(|s| s.state_json())),
            "/metrics" => Response {
                status: 200,
                content_type: "text/plain; version=0.0.4",
                body: status.read(|s| s.metrics(&plane.metrics, plane.gate.in_flight())),
            },
            _ => Response::text(404, "not found; try /live, /ready, /state or /metrics\n"),
        }
    })
}

/// Start-up: connect and read the engine until it answers, every retry interval.
/// A refused connection means the engine is still loading its model.
async fn wait_for_engine(
    config: RunConfig,
    ready: mpsc::Sender<EngineReady>,
    cancel: CancellationToken,
) {
    let profile: EngineProfile = config.engine;
    let t = &config.timings;
    let endpoint = match engine::endpoint(&config.engine_endpoint, t) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("engine endpoint {}: {e}", config.engine_endpoint);
            return;
        }
    };
    let mut last_error = String::new();
    let mut attempts: u64 = 0;
    loop {
        attempts += 1;
        let attempt = async {
            let channel = engine::connect(&endpoint, t.connect_attempt_timeout).await?;
            let info = engine::read_info(&profile, &channel, t.connect_attempt_timeout).await?;
            Ok::<_, engine::EngineError>((info, channel))
        };
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            outcome = attempt => outcome,
        };
        match outcome {
            Ok((info, channel)) => {
                tracing::info!(
                    model = %info.model.name,
                    version = %info.version,
                    "{} engine at {} answered (start-up attempt {attempts})",
                    profile.display_name(),
                    config.engine_endpoint
                );
                let _ = ready.send((info, channel)).await;
                return;
            }
            Err(e) => {
                let text = e.to_string();
                if text != last_error {
                    tracing::info!(
                        "{} engine at {} not ready yet ({text}); retrying every {}",
                        profile.display_name(),
                        config.engine_endpoint,
                        llm_sidecar_core::HumanDuration(t.retry_interval)
                    );
                    last_error = text;
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(t.retry_interval) => {}
        }
    }
}

/// Runs discovery writes one at a time, in order; answers each exactly once.
async fn discovery_worker<D: Discovery>(
    discovery: Arc<D>,
    mut ops: mpsc::UnboundedReceiver<DiscoveryOp>,
    events: mpsc::Sender<Event>,
    lost: mpsc::UnboundedSender<()>,
    bound: std::time::Duration,
    status: Shared,
) {
    let timeout_error =
        || DiscoveryError::Timeout(llm_sidecar_core::HumanDuration(bound).to_string());
    while let Some(op) = ops.recv().await {
        let event = match op {
            DiscoveryOp::Register(record) => {
                match tokio::time::timeout(bound, discovery.register(&record, lost.clone())).await {
                    Ok(Ok(())) => {
                        let location = discovery.location(&record);
                        tracing::info!(record = %location, key = %record.key(), "record written to discovery");
                        status.update(|s| s.record_location = Some(location));
                        Event::Registered
                    }
                    Ok(Err(e)) => Event::RegistrationFailed {
                        error: engine::error_chain(&e),
                    },
                    Err(_) => Event::RegistrationFailed {
                        error: timeout_error().to_string(),
                    },
                }
            }
            DiscoveryOp::Withdraw => {
                match tokio::time::timeout(bound, discovery.withdraw()).await {
                    Ok(Ok(())) => Event::Withdrawn,
                    Ok(Err(e)) => Event::WithdrawFailed {
                        error: engine::error_chain(&e),
                    },
                    Err(_) => Event::WithdrawFailed {
                        error: timeout_error().to_string(),
                    },
                }
            }
        };
        if events.send(event).await.is_err() {
            return;
        }
    }
}
