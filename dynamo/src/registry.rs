//! Dynamo's discovery as llm-sidecar's registry: the core's `Register` runs
//! Dynamo's own `Worker` (which writes the instance record, the model card and
//! its event channels, and serves Dynamo's request plane through the
//! [`Bridge`]); the core's `Withdraw` cancels that worker's shutdown token and
//! removes every record of this worker at once. Each write is confirmed by
//! reading Dynamo's discovery back, so the core's book of discovery writes
//! stays true: by listing (file, etcd), or in the `kubernetes` backend by
//! reading this worker's own object, since a list there shows only Ready
//! pods (see [`crate::kube`]). Dynamo's system port (`DYN_SYSTEM_PORT`): its
//! `/health` is ready once Dynamo's worker serves its endpoint, and 503 from
//! the instant the withdrawal starts (a readiness hold this registry takes),
//! so a pod's readiness probe takes the worker out as a second line.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dynamo_backend_common::{Worker, WorkerConfig};
use dynamo_runtime::DistributedRuntime;
use dynamo_runtime::discovery::{
    DiscoveryInstance, DiscoveryMetadata, DiscoveryQuery, EventChannelQuery, EventSourceQuery,
    EventTransport,
};
use llm_sidecar_io::discovery::{CallStatus, Discovery, DiscoveryError, Record};
use llm_sidecar_io::request_plane::HostedCalls;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::bridge::Bridge;
use crate::kube::OwnObject;
use crate::load::{self, Capacity};
use crate::own_channels;
use crate::request::Served;

/// How often discovery is read back while a write settles.
const SETTLE_POLL: Duration = Duration::from_millis(20);

/// How often a registered worker's records are looked for.
const WATCH_POLL: Duration = Duration::from_secs(1);

/// As [`WATCH_POLL`], in the `kubernetes` backend: each look is a GET on the
/// API server, which every worker of a cluster shares, and nothing but this
/// worker or its pod's deletion removes the object there.
const WATCH_POLL_KUBE: Duration = Duration::from_secs(10);

/// The readiness hold this registry takes on Dynamo's system health from
/// the withdrawal on: `/health` answers 503 while any hold is outstanding,
/// whichever of Dynamo's health layers the operator's variables select.
const WITHDRAWN: &str = "llm-sidecar: withdrawn from discovery";

/// Records that could not be read back for this long count as gone: Dynamo's
/// file store expires a record its owner has not touched for 10 s, and an
/// etcd lease of 10 s ends as surely, so by then no router sees them (the
/// reads fail, say, while the process's file descriptors are used up).
const UNREADABLE_FOR: Duration = Duration::from_secs(10);

/// The longest context registered, in tokens (2^26, some 64 million: six
/// times the longest context any model offers today). An engine reporting
/// more is taken to report nonsense.
pub const MAX_CONTEXT_LENGTH: u32 = 1 << 26;

/// Where this worker's records are read back from.
#[derive(Clone)]
pub enum ReadBack {
    /// Dynamo's discovery lists them (file, etcd): every record is listed.
    Listing,
    /// The worker's own `DynamoWorkerMetadata` object (kubernetes).
    OwnObject(Box<OwnObject>),
}

impl ReadBack {
    /// How often the watch looks.
    fn poll(&self) -> Duration {
        match self {
            ReadBack::Listing => WATCH_POLL,
            ReadBack::OwnObject(_) => WATCH_POLL_KUBE,
        }
    }

    /// Whether records that cannot be read for [`UNREADABLE_FOR`] are gone:
    /// listed records expire with their lease or TTL; an object does not.
    fn expires(&self) -> bool {
        matches!(self, ReadBack::Listing)
    }
}

/// One reading of discovery, for the queries of one look.
enum Reading {
    Listing(Arc<dyn dynamo_runtime::discovery::Discovery>),
    Object(DiscoveryMetadata),
}

impl Reading {
    async fn take(drt: &DistributedRuntime, read_back: &ReadBack) -> Result<Self, DiscoveryError> {
        match read_back {
            ReadBack::Listing => Ok(Reading::Listing(drt.discovery())),
            ReadBack::OwnObject(object) => {
                let records = object.records().await.map_err(|e| DiscoveryError::Hosted {
                    what: format!(
                        "DynamoWorkerMetadata {}/{}",
                        object.identity().namespace,
                        object.identity().object
                    ),
                    source: e.into(),
                })?;
                Ok(Reading::Object(records.unwrap_or_default()))
            }
        }
    }

    async fn list(&self, query: DiscoveryQuery) -> Result<Vec<DiscoveryInstance>, DiscoveryError> {
        match self {
            Reading::Listing(discovery) => {
                discovery
                    .list(query)
                    .await
                    .map_err(|e| DiscoveryError::Hosted {
                        what: "Dynamo discovery".into(),
                        source: e.into(),
                    })
            }
            Reading::Object(records) => Ok(records.filter(&query)),
        }
    }
}

/// This worker's records in Dynamo's discovery.
struct Ours {
    /// The instance records (`v1/instances/...`).
    instances: Vec<DiscoveryInstance>,
    /// Model cards (`v1/mdc/...`), the other endpoints of this instance (the
    /// KV publisher's query endpoint), and (when asked for) the KV event
    /// sources naming this worker (`v1/event_sources/...`) and the event
    /// channels this process publishes (`v1/event_channels/...`): Dynamo's
    /// worker leaves these behind until its own cleanup or the process's
    /// exit, so the withdrawal removes them itself.
    rest: Vec<DiscoveryInstance>,
}

impl Ours {
    /// Whether a model card is among the records.
    fn card(&self) -> bool {
        self.rest
            .iter()
            .any(|r| matches!(r, DiscoveryInstance::Model { .. }))
    }

    /// Registered: the instance record and a model card are both there.
    fn registered(&self) -> bool {
        !self.instances.is_empty() && self.card()
    }
}

/// The running Dynamo worker of the current registration.
struct Running {
    shutdown: CancellationToken,
    worker: JoinHandle<Result<(), String>>,
    /// Stops the watch on the records.
    watch: CancellationToken,
    /// Its records were confirmed in discovery once: a later `register` is
    /// a re-registration after they left, which this worker cannot do (it
    /// believes itself registered), so a fresh one replaces it.
    confirmed: bool,
}

/// Dynamo's discovery, written through Dynamo's `Worker`.
pub struct DynamoRegistry {
    drt: DistributedRuntime,
    /// Where the records are read back from.
    read_back: ReadBack,
    /// Everything of the worker's settings but what the engine reports.
    worker: WorkerConfig,
    /// The context length of `--context-length`, if given.
    context_length: Option<u32>,
    channels: Vec<Channel>,
    /// Admission for requests; set once the driver is started, before any write.
    calls: OnceLock<HostedCalls>,
    running: Mutex<Option<Running>>,
}

impl DynamoRegistry {
    /// A registry on `drt` for a worker configured as `worker`.
    pub fn new(
        drt: DistributedRuntime,
        read_back: ReadBack,
        worker: WorkerConfig,
        context_length: Option<u32>,
        channels: Vec<Channel>,
    ) -> Self {
        DynamoRegistry {
            drt,
            read_back,
            worker,
            context_length,
            channels,
            calls: OnceLock::new(),
            running: Mutex::new(None),
        }
    }

    /// Hands over admission for the bridge (the driver's gate).
    pub fn set_calls(&self, calls: HostedCalls) {
        let _ = self.calls.set(calls);
    }

    fn id(&self) -> u64 {
        self.drt.connection_id()
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This worker's records in Dynamo's discovery now; its event channels
    /// only if `channels`.
    async fn ours(&self, channels: bool) -> Result<Ours, DiscoveryError> {
        ours(
            &self.drt,
            &self.read_back,
            &self.worker,
            self.id(),
            channels,
        )
        .await
    }

    /// Holds Dynamo's `/health` at 503 (`true`) or lets it follow Dynamo's
    /// worker again (`false`).
    fn hold_readiness(&self, hold: bool) {
        let health = self.drt.system_health();
        let health = health.lock();
        if hold {
            health.hold_endpoint_readiness(WITHDRAWN);
        } else {
            health.release_endpoint_readiness(WITHDRAWN);
        }
    }

    /// The context length to register: the flag's, else the engine's; a
    /// disagreement is said, and so is an engine's length out of bounds
    /// (none is registered then: the frontend's own default applies).
    fn context_length(&self, record: &Record) -> Option<u32> {
        let reported = record.model.max_seq_len;
        let engine = u32::try_from(reported)
            .ok()
            .filter(|c| *c > 0 && *c <= MAX_CONTEXT_LENGTH);
        if engine.is_none() && reported > i64::from(MAX_CONTEXT_LENGTH) {
            tracing::warn!(
                "the engine reports a context length of {reported} tokens (GetModelInfo), \
                 above {MAX_CONTEXT_LENGTH}: registered without one{}",
                if self.context_length.is_some() {
                    ""
                } else {
                    " (--context-length sets one)"
                }
            );
        }
        match (self.context_length, engine) {
            (Some(flag), Some(engine)) if flag != engine => {
                tracing::warn!(
                    "--context-length {flag} differs from the engine's {engine} \
                     (GetModelInfo); registering {flag}"
                );
                Some(flag)
            }
            (Some(flag), _) => Some(flag),
            (None, engine) => engine,
        }
    }

    /// What the engine reports of its KV cache and ranks, checked: each value
    /// out of bounds is left out with one line; ranks out of bounds refuse
    /// the registration (retried, in case the engine is restarted with sane
    /// settings, until the phase's deadline).
    async fn checked_capacity(&self) -> Result<Capacity, DiscoveryError> {
        let reported = load::read_capacity(self.channels[0].clone())
            .await
            .map_err(|status| DiscoveryError::Engine {
                call: "GetServerInfo",
                source: CallStatus(status),
            })?;
        let (capacity, left_out) = reported
            .check()
            .map_err(|e| DiscoveryError::Refused(e.to_string()))?;
        for line in left_out {
            tracing::warn!("{line}");
        }
        Ok(capacity)
    }

    /// Stops a worker whose records left discovery, and waits until it has
    /// ended (Dynamo's worker sleeps its own grace first), so the next one
    /// serves the endpoint alone.
    async fn retire_unregistered_worker(&self) {
        let retiring = {
            let running = self.running();
            match running.as_ref() {
                Some(r) if r.confirmed => {
                    r.watch.cancel();
                    r.shutdown.cancel();
                    true
                }
                _ => false,
            }
        };
        if !retiring {
            return;
        }
        tracing::info!(
            "restarting Dynamo's worker to write this worker's records again (it cannot \
             rewrite records it believes written)"
        );
        loop {
            let ended = {
                let mut running = self.running();
                if running.as_ref().is_some_and(|r| r.worker.is_finished()) {
                    running.take()
                } else {
                    None
                }
            };
            if let Some(ended) = ended {
                if let Ok(Err(e)) = ended.worker.await {
                    tracing::debug!("the replaced Dynamo worker ended with: {e}");
                }
                return;
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }

    /// Starts Dynamo's worker for this registration.
    fn start_worker(&self, record: &Record, calls: HostedCalls, capacity: Capacity) -> Running {
        let served = Served {
            name: self.worker.model_name.clone(),
            engine_model: record.model.name.clone(),
            context_length: self.context_length(record),
        };
        let shutdown = CancellationToken::new();
        let bridge = Arc::new(Bridge::new(
            self.channels.clone(),
            calls,
            served,
            capacity,
            shutdown.clone(),
        ));
        let worker = Worker::new(bridge, self.worker.clone());
        let drt = self.drt.clone();
        let token = shutdown.clone();
        let worker = tokio::spawn(async move {
            worker
                .run_with_drt(drt, token)
                .await
                .map_err(|e| e.to_string())
        });
        Running {
            shutdown,
            worker,
            watch: CancellationToken::new(),
            confirmed: false,
        }
    }
}

/// This worker's records in discovery: its instance, model cards, event
/// sources, and with `channels` the event channels this process publishes in
/// its namespace.
async fn ours(
    drt: &DistributedRuntime,
    read_back: &ReadBack,
    worker: &WorkerConfig,
    id: u64,
    channels: bool,
) -> Result<Ours, DiscoveryError> {
    let discovery = Reading::take(drt, read_back).await?;
    // Every endpoint of the component: beside the served one, Dynamo's KV
    // publisher registers a query endpoint of its own under the same id
    // (`worker_kv_query_source_<publisher>`), which the router asks to
    // recover this worker's blocks.
    let endpoints = discovery
        .list(DiscoveryQuery::ComponentEndpoints {
            namespace: worker.namespace.clone(),
            component: worker.component.clone(),
        })
        .await?;
    let (instances, others): (Vec<_>, Vec<_>) = endpoints
        .into_iter()
        .filter(|e| e.instance_id() == id)
        .partition(|e| match e {
            DiscoveryInstance::Endpoint(i) => i.endpoint == worker.endpoint,
            _ => false,
        });
    let cards = discovery
        .list(DiscoveryQuery::EndpointModels {
            namespace: worker.namespace.clone(),
            component: worker.component.clone(),
            endpoint: worker.endpoint.clone(),
        })
        .await?;
    let mut rest: Vec<_> = cards
        .into_iter()
        .filter(|c| c.instance_id() == id)
        .collect();
    rest.extend(others);
    if channels {
        // A KV event source is named by its publisher's incarnation; the
        // worker it speaks for is in its descriptor.
        let sources = discovery
            .list(DiscoveryQuery::EventSources(EventSourceQuery::all()))
            .await?;
        rest.extend(sources.into_iter().filter(|s| {
            match s {
                DiscoveryInstance::EventSource {
                    publisher_id,
                    metadata,
                    ..
                } => {
                    *publisher_id == id
                        || metadata
                            .pointer("/worker/worker_id")
                            .and_then(|w| w.as_u64())
                            == Some(id)
                }
                _ => false,
            }
        }));
        let listening = own_channels::listening_ports();
        let channels = discovery
            .list(DiscoveryQuery::EventChannels(EventChannelQuery::all()))
            .await?;
        // Every channel in this worker's own object is this process's.
        let own_object = matches!(discovery, Reading::Object(_));
        rest.extend(channels.into_iter().filter(|c| match c {
            DiscoveryInstance::EventChannel {
                scope,
                transport: EventTransport::Zmq { endpoint },
                ..
            } => {
                scope.namespace() == worker.namespace
                    && (own_object || own_channels::is_ours(endpoint, &listening))
            }
            _ => false,
        }));
    }
    Ok(Ours { instances, rest })
}

/// Reports a lost registration when either record leaves discovery on its
/// own (removed by someone, expired), or Dynamo's worker stops serving.
fn watch(
    drt: DistributedRuntime,
    read_back: ReadBack,
    worker: WorkerConfig,
    id: u64,
    stop: CancellationToken,
    lost: mpsc::UnboundedSender<String>,
) {
    tokio::spawn(async move {
        let mut unreadable_since: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(read_back.poll()) => {}
            }
            let cause = match ours(&drt, &read_back, &worker, id, false).await {
                Ok(o) if o.registered() => {
                    unreadable_since = None;
                    continue;
                }
                Ok(o) if o.instances.is_empty() => {
                    "the instance record left Dynamo's discovery".to_string()
                }
                Ok(_) => "the model card left Dynamo's discovery".to_string(),
                // A read that fails is not a lost record, unless they keep
                // failing past the records' own lifetime (an object has none).
                Err(_) if !read_back.expires() => continue,
                Err(e) => {
                    let since = *unreadable_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() < UNREADABLE_FOR {
                        continue;
                    }
                    format!(
                        "its records could not be read back for {}s: {e}",
                        UNREADABLE_FOR.as_secs()
                    )
                }
            };
            if !stop.is_cancelled() {
                let _ = lost.send(cause);
            }
            return;
        }
    });
}

impl Discovery for DynamoRegistry {
    async fn register(
        &self,
        record: &Record,
        lost: mpsc::UnboundedSender<String>,
    ) -> Result<(), DiscoveryError> {
        let Some(calls) = self.calls.get().cloned() else {
            return Err(DiscoveryError::NotReady(
                "the request plane is not ready yet",
            ));
        };
        // A worker whose records left discovery is replaced; one from an
        // attempt that timed out may still be coming up; a finished one is
        // replaced.
        self.retire_unregistered_worker().await;
        let start = {
            let mut running = self.running();
            if running.as_ref().is_some_and(|r| r.worker.is_finished())
                && let Some(old) = running.take()
            {
                old.watch.cancel();
            }
            running.is_none()
        };
        if start {
            let capacity = self.checked_capacity().await?;
            let mut running = self.running();
            if running.is_none() {
                *running = Some(self.start_worker(record, calls, capacity));
            }
        }
        loop {
            if self.ours(false).await?.registered() {
                break;
            }
            let ended = {
                let mut guard = self.running();
                match guard.as_ref() {
                    Some(r) if r.worker.is_finished() => guard.take(),
                    _ => None,
                }
            };
            if let Some(ended) = ended {
                let why = match ended.worker.await {
                    Ok(Ok(())) => "Dynamo's worker ended before it registered".to_string(),
                    Ok(Err(e)) => format!("Dynamo's worker failed: {e}"),
                    Err(e) => format!("Dynamo's worker panicked: {e}"),
                };
                return Err(DiscoveryError::Hosted {
                    what: "Dynamo discovery".into(),
                    source: why.into(),
                });
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
        self.hold_readiness(false);
        if let Some(running) = self.running().as_mut() {
            running.confirmed = true;
            watch(
                self.drt.clone(),
                self.read_back.clone(),
                self.worker.clone(),
                self.id(),
                running.watch.clone(),
                lost,
            );
        }
        Ok(())
    }

    async fn withdraw(&self) -> Result<(), DiscoveryError> {
        // Dynamo's /health turns 503 first: in Kubernetes the pod's endpoint
        // goes not ready, which hides the worker from every frontend even
        // while the API server cannot take the rewrite of its object.
        self.hold_readiness(true);
        // Cancelling Dynamo's worker unregisters its instance at once (then it
        // sleeps Dynamo's own grace, which the core's timing supersedes).
        if let Some(running) = self.running().as_ref() {
            running.watch.cancel();
            running.shutdown.cancel();
        }
        let discovery = self.drt.discovery();
        loop {
            let Ours { instances, rest } = self.ours(true).await?;
            if instances.is_empty() && rest.is_empty() {
                return Ok(());
            }
            // Dynamo's worker removes its instance record at its shutdown,
            // once: if that write failed (the API server or etcd away at that
            // moment), nothing would retry it. So every record of this worker
            // is removed here, the instance first, until none is left. Dynamo's
            // worker leaves its model card and its event channels to expire
            // with its lease; they go now too, so no frontend lists a model
            // nobody serves and no router subscribes to a publisher that left.
            for record in instances.into_iter().chain(rest) {
                if let Err(e) = discovery.unregister(record).await {
                    tracing::debug!("discovery record removal failed, retrying: {e:#}");
                }
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }

    fn location(&self, record: &Record) -> String {
        format!(
            "Dynamo discovery v1/instances/{}/{}/{}/{:x}, its model card and event channels",
            record.namespace,
            record.component,
            record.endpoint,
            self.id()
        )
    }
}
