//! The engine side of a Dynamo request: each `PreprocessedRequest` becomes an
//! OpenEngine `Generate`, each answer an `LLMEngineOutput`, a caller's cancel
//! a `Control.Abort`. Every request is admitted through llm-sidecar's gate, so
//! the core's drain counts it, the drain deadline cuts it, and the call
//! account at exit includes it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use dynamo_backend_common::{
    AsyncEngineContext, BackendError, DynamoError, EngineConfig, ErrorType, GenerateContext,
    LLMEngine, LLMEngineOutput, LlmRegistration, MetricsBindings, MetricsCtx, PreprocessedRequest,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use llm_sidecar_engine_api::openengine::control_client::ControlClient;
use llm_sidecar_engine_api::openengine::inference_client::InferenceClient;
use llm_sidecar_engine_api::openengine::{
    self as oe, AbortRequest, GenerateResponse, GetModelInfoRequest,
};
use llm_sidecar_io::request_plane::{Admitted, CallOutcome, HostedCalls};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::answer::{self, Reader, Step, status_error};
use crate::kv_events::{self, NoEvents};
use crate::load::{self, Capacity};
use crate::request::{self, Capabilities, Served};

/// The message of a request refused while admission is closed.
const DRAINING: &str = "worker draining; retry on another worker";

/// The message of a request cut at the drain deadline: the proxy's.
const CUT: &str = llm_sidecar_io::request_plane::CUT_MESSAGE;

/// How long a `Control.Abort` may take: the engine stream is reset anyway,
/// so a wedged engine must not hold the cancelling task.
const ABORT_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// How long the engine may take to end its stream after the final message.
const TRAILERS_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// Dynamo's `LLMEngine` in front of an OpenEngine engine.
pub struct Bridge {
    channels: Vec<Channel>,
    next: AtomicUsize,
    calls: HostedCalls,
    served: Served,
    /// What the engine reported of its KV cache and ranks, checked, read
    /// just before this worker started.
    capacity: Capacity,
    /// What the engine said it serves per request, set at this worker's
    /// start (before any request), read by every request.
    caps: OnceLock<Capabilities>,
    /// Requests whose engine stream is open.
    open: Arc<OpenStreams>,
    /// Dynamo's id of this worker, once it started (the KV events name it).
    worker_id: AtomicU64,
    /// Ends the load poller and the KV event relays with this worker.
    stop: CancellationToken,
    /// What the KV event relays leave out, on `/metrics`.
    kv_dropped: kv_events::Dropped,
}

impl Bridge {
    /// A bridge over `channels` (at least one; calls take them in turn) for
    /// an engine of this (checked) capacity, whose background work ends with
    /// `stop`.
    pub fn new(
        channels: Vec<Channel>,
        calls: HostedCalls,
        served: Served,
        capacity: Capacity,
        stop: CancellationToken,
    ) -> Self {
        assert!(!channels.is_empty(), "at least one engine channel");
        let kv_dropped = kv_events::Dropped {
            events: calls.counter(
                "llm_sidecar_kv_events_dropped",
                "KV events of the engine not relayed to Dynamo's router: their rank sent more \
                 than 50,000 blocks a second (the router's view of the rank is cleared once \
                 they slow down).",
            ),
            blocks: calls.counter(
                "llm_sidecar_kv_blocks_not_credited",
                "Stored KV blocks not credited at Dynamo's router: beyond the engine's total.",
            ),
            messages: calls.counter(
                "llm_sidecar_kv_event_messages_lost",
                "KV event messages of the engine that never reached the relay (a gap in the \
                 engine's sequence: ZMQ dropped them, its queue full); the rank's blocks are \
                 cleared from Dynamo's router and learned anew.",
            ),
        };
        Bridge {
            kv_dropped,
            channels,
            next: AtomicUsize::new(0),
            calls,
            served,
            capacity,
            caps: OnceLock::new(),
            open: Arc::new(OpenStreams::default()),
            worker_id: AtomicU64::new(0),
            stop,
        }
    }

    fn channel(&self) -> Channel {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        self.channels[i].clone()
    }

    fn caps(&self) -> &Capabilities {
        self.caps.get_or_init(Capabilities::default)
    }
}

/// The requests whose engine stream is open and has not ended by itself:
/// the ones a `Control.Abort` is for. A request the engine finished (or
/// failed, or never saw) is never aborted.
#[derive(Default)]
struct OpenStreams(Mutex<HashSet<String>>);

impl OpenStreams {
    /// Marks `id`'s engine stream open until the returned guard is closed or
    /// dropped. A guard dropped while its request is cancelled leaves the id
    /// for [`Bridge::abort`], which Dynamo calls then; one dropped otherwise
    /// (its stream given up without a cancel) takes it out, so no id stays.
    fn open(self: &Arc<Self>, id: &str, ctx: Arc<dyn AsyncEngineContext>) -> OpenStream {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string());
        OpenStream {
            streams: self.clone(),
            id: id.to_string(),
            ctx,
        }
    }

    /// Whether `id` was open.
    fn close(&self, id: &str) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id)
    }
}

/// One request's mark in [`OpenStreams`].
struct OpenStream {
    streams: Arc<OpenStreams>,
    id: String,
    ctx: Arc<dyn AsyncEngineContext>,
}

impl OpenStream {
    /// The engine stream ended by itself: nothing to abort.
    fn close(&self) {
        self.streams.close(&self.id);
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        if !(self.ctx.is_stopped() || self.ctx.is_killed()) {
            self.close();
        }
    }
}

/// The error of a request its caller gave up on.
fn cancelled(message: &str) -> DynamoError {
    answer::error(ErrorType::Backend(BackendError::Cancelled), message)
}

/// The error of a request this worker will not serve as it shuts down:
/// another worker may.
fn shutdown(message: &str) -> DynamoError {
    answer::error(ErrorType::Backend(BackendError::EngineShutdown), message)
}

/// Reads the rest of an engine stream after its final message, so the
/// engine sees the stream end rather than a reset: an engine's trailers
/// follow its last message, and dropping the stream between the two makes
/// the engine count a completed generation as cancelled by the client. The
/// call stays in flight until then (bounded by [`TRAILERS_BOUND`] and the
/// drain deadline); a message after the final one is dropped.
fn read_to_end(
    mut stream: tonic::Streaming<GenerateResponse>,
    call: Admitted,
    cut: CancellationToken,
    id: String,
) {
    tokio::spawn(async move {
        let _in_flight = call;
        let rest = async {
            let mut after = 0u32;
            while let Some(message) = stream.next().await {
                match message {
                    Ok(_) => after += 1,
                    Err(status) => {
                        tracing::debug!(
                            request_id = id,
                            %status,
                            "the engine stream ended with an error after its final message"
                        );
                        break;
                    }
                }
            }
            after
        };
        tokio::select! {
            () = cut.cancelled() => {}
            read = tokio::time::timeout(TRAILERS_BOUND, rest) => match read {
                Ok(0) => {}
                Ok(after) => tracing::debug!(
                    request_id = id,
                    "the engine sent {after} message(s) after its final one: ignored"
                ),
                Err(_) => tracing::warn!(
                    request_id = id,
                    "the engine did not end the stream within {TRAILERS_BOUND:?} of its final \
                     message: the stream is reset (the engine may count it as cancelled)"
                ),
            },
        }
    });
}

#[async_trait]
impl LLMEngine for Bridge {
    async fn start(&self, worker_id: u64) -> Result<EngineConfig, DynamoError> {
        self.worker_id.store(worker_id, Ordering::Relaxed);
        let capacity = self.capacity;
        // What the engine serves per request, so a request it cannot serve
        // is refused before it is sent.
        let mut control = ControlClient::new(self.channel());
        let model = control
            .get_model_info(GetModelInfoRequest {
                model: self.served.engine_model.clone(),
            })
            .await
            .map_err(|status| status_error(&status, true).0)?
            .into_inner();
        let caps = Capabilities::of(&model);
        tracing::debug!(?caps, "the engine's generation capabilities");
        // Dynamo starts each worker (a new bridge) once.
        let _ = self.caps.set(caps);
        if capacity.ranks().is_empty() {
            tracing::info!(
                "the engine reports no KV block size and total (GetServerInfo capacity): \
                 the registration carries none and no load is published; Dynamo's KV \
                 router treats this worker as one it knows nothing about"
            );
        }
        Ok(EngineConfig {
            model: self.served.name.clone(),
            served_model_name: Some(self.served.name.clone()),
            llm: Some(LlmRegistration {
                context_length: self.served.context_length,
                kv_cache_block_size: capacity.kv_block_size,
                total_kv_blocks: capacity.total_kv_blocks,
                max_num_seqs: capacity.max_running_requests,
                max_num_batched_tokens: capacity.max_batched_tokens,
                data_parallel_size: Some(capacity.data_parallel_size),
                data_parallel_start_rank: Some(capacity.data_parallel_start_rank),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    /// The engine's KV event publishers, one per rank, each relayed by a
    /// task of this worker (`kv_events`): none (one line saying why) when the
    /// engine lists none, has no such RPC, or reports no block size.
    async fn kv_event_sources(
        &self,
    ) -> Result<Vec<dynamo_backend_common::KvEventSource>, DynamoError> {
        let capacity = self.capacity;
        let found = match capacity.kv_block_size {
            None => Err(NoEvents::NoBlockSize),
            Some(block_size) => kv_events::discover(self.channel(), &capacity.ranks())
                .await
                .map(|sources| (sources, block_size)),
        };
        let (sources, block_size) = match found {
            Ok(sources) => sources,
            Err(why @ (NoEvents::Failed(_) | NoEvents::Unusable(_))) => {
                tracing::warn!(
                    "the engine's KV events are not relayed: {why}; Dynamo's router routes \
                     this worker as one without events"
                );
                return Ok(Vec::new());
            }
            Err(why) => {
                tracing::info!(
                    "no KV events: {why}; Dynamo's router routes this worker as one without \
                     events"
                );
                return Ok(Vec::new());
            }
        };
        if capacity.kv_event_heartbeat.is_none() {
            tracing::info!(
                "the engine advertises no KV event heartbeat (kv_event_heartbeat_interval_ms): \
                 a publisher that falls silent is not noticed"
            );
        }
        let worker_id = self.worker_id.load(Ordering::Relaxed);
        Ok(sources
            .into_iter()
            .map(|source| {
                let (rank, stop) = (source.rank, self.stop.clone());
                let heartbeat = capacity.kv_event_heartbeat;
                let total_blocks = capacity.total_kv_blocks.unwrap_or(0);
                let dropped = self.kv_dropped.clone();
                dynamo_backend_common::KvEventSource::Push {
                    dp_rank: rank,
                    on_ready: Box::new(move |publisher| {
                        tokio::spawn(
                            kv_events::Relay {
                                source,
                                publisher,
                                worker_id,
                                block_size,
                                heartbeat,
                                total_blocks,
                                dropped,
                                stop,
                            }
                            .run(),
                        );
                        Ok(())
                    }),
                }
            })
            .collect())
    }

    /// Declares the ranks whose load is published, and starts the `GetLoad`
    /// poller once Dynamo hands over its snapshot publisher.
    async fn setup_metrics(&self, _ctx: MetricsCtx<'_>) -> Result<MetricsBindings, DynamoError> {
        let ranks = self.capacity.ranks();
        if ranks.is_empty() {
            return Ok(MetricsBindings::default());
        }
        let (channel, stop, poller_ranks) = (self.channel(), self.stop.clone(), ranks.clone());
        Ok(MetricsBindings {
            dp_ranks: ranks,
            on_publisher_ready: Some(Box::new(move |publisher| {
                load::spawn_poller(channel, publisher, poller_ranks, stop);
                Ok(())
            })),
        })
    }

    async fn generate(
        &self,
        request: PreprocessedRequest,
        ctx: GenerateContext,
    ) -> Result<BoxStream<'static, Result<LLMEngineOutput, DynamoError>>, DynamoError> {
        let Some(mut call) = self.calls.admit() else {
            return Err(shutdown(DRAINING));
        };
        let ctx = ctx.inner_arc();
        let (engine_request, metadata) =
            match request::generate_request(ctx.id(), &request, &self.served, self.caps()) {
                Ok(mapped) => mapped,
                Err(refused) => {
                    // Never forwarded, and the caller's to fix.
                    call.set_outcome(CallOutcome::Malformed);
                    return Err(refused);
                }
            };
        // A caller gone before the engine was asked: the engine never hears
        // of the request, not even as an abort.
        if ctx.is_stopped() || ctx.is_killed() {
            call.set_outcome(CallOutcome::CancelledByCaller);
            return Err(cancelled("cancelled before the engine was called"));
        }
        let id = ctx.id().to_string();
        let prompt_len = u32::try_from(request.token_ids.len()).unwrap_or(u32::MAX);
        let mut client = InferenceClient::new(self.channel()).max_decoding_message_size(64 << 20);
        let engine_request =
            tonic::Request::from_parts(metadata, tonic::Extensions::default(), engine_request);
        let cut = call.cut();
        let started = tokio::select! {
            biased;
            () = cut.cancelled() => {
                call.set_outcome(CallOutcome::CutAtDeadline);
                return Err(shutdown(CUT));
            }
            // Dropping the half-open call resets it: the engine drops it.
            () = ctx.stopped() => {
                call.set_outcome(CallOutcome::CancelledByCaller);
                return Err(cancelled("cancelled before the engine answered"));
            }
            r = client.generate(engine_request) => r,
        };
        let mut stream = match started {
            Ok(response) => response.into_inner(),
            Err(status) => {
                let (e, outcome) = status_error(&status, true);
                call.set_outcome(outcome);
                return Err(e);
            }
        };
        let open = self.open.open(&id, ctx.clone());
        Ok(async_stream::stream! {
            // Holding the admission here keeps the request in flight until
            // its last item was taken, whatever ends it.
            let mut call: Admitted = call;
            let mut reader = Reader::new(&id, prompt_len);
            // Made once, not per message: `stopped` is a boxed future and
            // each new one registers anew.
            let cut_fired = cut.clone().cancelled_owned();
            tokio::pin!(cut_fired);
            let mut stopped = ctx.stopped();
            loop {
                let next = tokio::select! {
                    biased;
                    () = &mut cut_fired => {
                        open.close();
                        call.set_outcome(CallOutcome::CutAtDeadline);
                        yield Err(shutdown(CUT));
                        break;
                    }
                    () = &mut stopped => {
                        // The framework calls `abort` (Control.Abort; the id
                        // stays open for it); dropping the engine stream
                        // resets it as well.
                        call.set_outcome(CallOutcome::CancelledByCaller);
                        yield Ok(LLMEngineOutput::cancelled());
                        break;
                    }
                    next = stream.next() => next,
                };
                let step = match next {
                    Some(Ok(message)) => reader.step(message),
                    Some(Err(status)) => {
                        let (e, outcome) = status_error(&status, false);
                        Step::Failed(e, outcome)
                    }
                    None => Step::Failed(
                        answer::error(
                            ErrorType::Backend(BackendError::StreamIncomplete),
                            "engine: the stream ended before the generation finished",
                        ),
                        CallOutcome::EngineFailed,
                    ),
                };
                match step {
                    Step::Tokens(out) => {
                        call.first_message_sent();
                        yield Ok(out);
                    }
                    Step::Nothing => {}
                    Step::Finished(out) => {
                        open.close();
                        call.set_outcome(CallOutcome::Ok);
                        read_to_end(stream, call, cut, id);
                        yield Ok(out);
                        break;
                    }
                    Step::Failed(e, outcome) => {
                        open.close();
                        if outcome != CallOutcome::EngineStatus {
                            tracing::warn!(request_id = id, "request failed: {e}");
                        }
                        call.set_outcome(outcome);
                        yield Err(e);
                        break;
                    }
                }
            }
        }
        .boxed())
    }

    /// `Control.Abort` for a request whose engine stream is still open;
    /// never for one the engine finished or never saw.
    async fn abort(&self, ctx: Arc<dyn AsyncEngineContext>) {
        if !self.open.close(ctx.id()) {
            tracing::debug!(
                request_id = ctx.id(),
                "no engine stream open for the request: no Control.Abort"
            );
            return;
        }
        let mut control = ControlClient::new(self.channel());
        let request = AbortRequest {
            target: Some(oe::abort_request::Target::RequestId(ctx.id().to_string())),
        };
        match tokio::time::timeout(ABORT_BOUND, control.abort(request)).await {
            Ok(Ok(_)) => {}
            Ok(Err(status)) => {
                tracing::debug!(request_id = ctx.id(), %status, "Control.Abort failed");
            }
            Err(_) => tracing::debug!(request_id = ctx.id(), "Control.Abort got no answer"),
        }
    }

    async fn cleanup(&self) -> Result<(), DynamoError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_runtime::pipeline::context::Controller;

    #[test]
    fn an_open_stream_given_up_without_a_cancel_leaves_no_id_and_a_cancelled_one_waits_for_abort() {
        let streams = Arc::new(OpenStreams::default());
        let live: Arc<dyn AsyncEngineContext> = Arc::new(Controller::new("live".into()));
        drop(streams.open("live", live));
        assert!(!streams.close("live"), "dropped without a cancel: gone");

        let stopped = Arc::new(Controller::new("stopped".into()));
        let ctx: Arc<dyn AsyncEngineContext> = stopped.clone();
        let guard = streams.open("stopped", ctx);
        stopped.stop();
        drop(guard);
        assert!(
            streams.close("stopped"),
            "cancelled: left for Control.Abort"
        );

        let ended: Arc<dyn AsyncEngineContext> = Arc::new(Controller::new("ended".into()));
        let guard = streams.open("ended", ended);
        guard.close();
        assert!(!streams.close("ended"), "ended by itself: nothing to abort");
    }
}
