//! The engine side of a Dynamo request: each `PreprocessedRequest` becomes an
//! OpenEngine `Generate`, each answer an `LLMEngineOutput`, a caller's cancel
//! a `Control.Abort`. Every request is admitted through llm-sidecar's gate, so
//! the core's drain counts it, the drain deadline cuts it, and the call
//! account at exit includes it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use dynamo_backend_common::{
    AsyncEngineContext, BackendError, DynamoError, EngineConfig, ErrorType, GenerateContext,
    LLMEngine, LLMEngineOutput, LlmRegistration, MetricsBindings, MetricsCtx, PreprocessedRequest,
    usage,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use llm_sidecar_engine_api::openengine::control_client::ControlClient;
use llm_sidecar_engine_api::openengine::inference_client::InferenceClient;
use llm_sidecar_engine_api::openengine::{
    self as oe, AbortRequest, FinishReason, GenerateRequest, GenerateResponse, generate_response,
};
use llm_sidecar_engine_api::prost_types;
use llm_sidecar_io::request_plane::{Admitted, CallOutcome, HostedCalls};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::load::{self, Capacity};

/// The message of a request refused while admission is closed.
const DRAINING: &str = "worker draining; retry on another worker";

/// The message of a request cut at the drain deadline.
const CUT: &str = "drain deadline reached; retry on another worker";

/// How long a `Control.Abort` may take: the engine stream is reset anyway,
/// so a wedged engine must not hold the cancelling task.
const ABORT_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// The model as the engine reported it at start-up, and the card's settings.
#[derive(Debug, Clone)]
pub struct Served {
    /// The name clients ask for: `--model-path`, as Dynamo's own sidecar
    /// registers it.
    pub name: String,
    /// The engine's own name for its model (`GetModelInfo`), sent in every
    /// Generate.
    pub engine_model: String,
    /// Registered context length: the flag's, else the engine's.
    pub context_length: Option<u32>,
}

/// Dynamo's `LLMEngine` in front of an OpenEngine engine.
pub struct Bridge {
    channels: Vec<Channel>,
    next: AtomicUsize,
    calls: HostedCalls,
    served: Served,
    /// What the engine reported of its KV cache at this worker's start.
    capacity: Mutex<Capacity>,
    /// Ends the load poller with this worker.
    stop: CancellationToken,
}

impl Bridge {
    /// A bridge over `channels` (at least one; calls take them in turn),
    /// whose background work ends with `stop`.
    pub fn new(
        channels: Vec<Channel>,
        calls: HostedCalls,
        served: Served,
        stop: CancellationToken,
    ) -> Self {
        assert!(!channels.is_empty(), "at least one engine channel");
        Bridge {
            channels,
            next: AtomicUsize::new(0),
            calls,
            served,
            capacity: Mutex::new(Capacity::default()),
            stop,
        }
    }

    fn capacity(&self) -> Capacity {
        *self.capacity.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn channel(&self) -> Channel {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        self.channels[i].clone()
    }

    /// The OpenEngine request for a Dynamo one. The frontend tokenized and
    /// holds the stop strings; the engine gets token ids, the stop token ids
    /// and `extra.detokenize = false` (nothing reads its text).
    fn generate_request(&self, id: &str, request: &PreprocessedRequest) -> GenerateRequest {
        let stop = &request.stop_conditions;
        let sampling = &request.sampling_options;
        let prompt_len = u32::try_from(request.token_ids.len()).unwrap_or(u32::MAX);
        // A request without max_tokens gets what the context leaves, as
        // Dynamo's sidecar does; without a context length, the engine's default.
        let max_tokens = stop.max_tokens.or_else(|| {
            self.served
                .context_length
                .map(|c| c.saturating_sub(prompt_len).max(1))
        });
        let stop_ids = stop
            .stop_token_ids_hidden
            .iter()
            .flatten()
            .chain(stop.stop_token_ids.iter().flatten())
            .chain(
                request
                    .eos_token_ids
                    .iter()
                    .filter(|_| stop.ignore_eos != Some(true)),
            );
        let mut conditions: Vec<oe::StopCondition> = Vec::new();
        for id in stop_ids {
            let condition = oe::StopCondition {
                condition: Some(oe::stop_condition::Condition::StopTokenId(*id)),
            };
            if !conditions.contains(&condition) {
                conditions.push(condition);
            }
        }
        let detokenize = prost_types::Value {
            kind: Some(prost_types::value::Kind::BoolValue(false)),
        };
        GenerateRequest {
            request_id: id.to_string(),
            model: self.served.engine_model.clone(),
            input: Some(oe::generate_request::Input::TokenIds(oe::TokenIds {
                ids: request.token_ids.to_vec(),
            })),
            sampling: Some(oe::SamplingParams {
                temperature: sampling.temperature.map(f64::from),
                top_p: sampling.top_p.map(f64::from),
                top_k: sampling.top_k,
                min_p: sampling.min_p.map(f64::from),
                frequency_penalty: sampling.frequency_penalty.map(f64::from),
                presence_penalty: sampling.presence_penalty.map(f64::from),
                repetition_penalty: sampling.repetition_penalty.map(f64::from),
                seed: sampling.seed.and_then(|s| u64::try_from(s).ok()),
                num_sequences: sampling.n.map(u32::from),
            }),
            stopping: Some(oe::StoppingOptions {
                max_tokens,
                min_tokens: stop.min_tokens,
                conditions,
                ignore_eos: stop.ignore_eos,
            }),
            extra: Some(prost_types::Struct {
                fields: [("detokenize".to_string(), detokenize)].into(),
            }),
        }
    }
}

fn error(kind: BackendError, message: impl Into<String>) -> DynamoError {
    DynamoError::builder()
        .error_type(ErrorType::Backend(kind))
        .message(message)
        .build()
}

/// A gRPC status from the engine: how the frontend should take it, and how
/// the call account counts it.
fn status_error(status: &tonic::Status, before_stream: bool) -> (DynamoError, CallOutcome) {
    use tonic::Code;
    let message = format!("engine: {}: {}", status.code(), status.message());
    match status.code() {
        Code::Unavailable | Code::Unknown if before_stream => (
            error(BackendError::CannotConnect, message),
            CallOutcome::EngineUnreachable,
        ),
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Aborted => (
            error(BackendError::Disconnected, message),
            CallOutcome::EngineFailed,
        ),
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => (
            error(BackendError::InvalidArgument, message),
            CallOutcome::EngineStatus,
        ),
        Code::Cancelled => (
            error(BackendError::Cancelled, message),
            CallOutcome::EngineStatus,
        ),
        Code::DeadlineExceeded => (
            error(BackendError::ResponseTimeout, message),
            CallOutcome::EngineStatus,
        ),
        _ => (
            error(BackendError::Unknown, message),
            CallOutcome::EngineStatus,
        ),
    }
}

/// An `EngineError` event in the stream.
fn engine_error(e: &oe::EngineError) -> DynamoError {
    let code = oe::ErrorCode::try_from(e.code).unwrap_or(oe::ErrorCode::Unspecified);
    let kind = match code {
        oe::ErrorCode::InvalidArgument
        | oe::ErrorCode::UnsupportedFeature
        | oe::ErrorCode::ModelNotFound
        | oe::ErrorCode::DuplicateRequest => BackendError::InvalidArgument,
        oe::ErrorCode::Cancelled => BackendError::Cancelled,
        _ if e.retryable => BackendError::EngineShutdown,
        _ => BackendError::Unknown,
    };
    error(kind, format!("engine: {:?}: {}", code, e.message))
}

/// What one message of the engine's stream means for the caller.
enum Step {
    Tokens(LLMEngineOutput),
    Finished(LLMEngineOutput),
    Failed(DynamoError),
}

fn step(message: GenerateResponse, prompt_len: u32, generated: &mut u32) -> Option<Step> {
    match message.event? {
        generate_response::Event::Token(t) => {
            let ids: Vec<u32> = t.tokens.iter().map(|t| t.token_id).collect();
            *generated += u32::try_from(ids.len()).unwrap_or(u32::MAX);
            Some(Step::Tokens(LLMEngineOutput {
                token_ids: ids,
                ..Default::default()
            }))
        }
        generate_response::Event::Finished(f) => {
            let mut out = match FinishReason::try_from(f.reason) {
                Ok(FinishReason::Length) => LLMEngineOutput::length(),
                Ok(FinishReason::Cancelled) => LLMEngineOutput::cancelled(),
                Ok(FinishReason::Stop | FinishReason::Unspecified) | Err(_) => {
                    LLMEngineOutput::stop()
                }
            };
            out.completion_usage = Some(match message.usage {
                Some(u) => usage(u.prompt_tokens, u.completion_tokens),
                None => usage(prompt_len, *generated),
            });
            Some(Step::Finished(out))
        }
        generate_response::Event::Error(e) => Some(Step::Failed(engine_error(&e))),
    }
}

#[async_trait]
impl LLMEngine for Bridge {
    async fn start(&self, _worker_id: u64) -> Result<EngineConfig, DynamoError> {
        // The engine answered its start-up calls before llm-sidecar
        // registered; its capacity is read here, for the registration.
        let capacity = load::read_capacity(self.channel())
            .await
            .map_err(|status| status_error(&status, true).0)?;
        *self.capacity.lock().unwrap_or_else(|p| p.into_inner()) = capacity;
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

    /// Declares the ranks whose load is published, and starts the `GetLoad`
    /// poller once Dynamo hands over its snapshot publisher.
    async fn setup_metrics(&self, _ctx: MetricsCtx<'_>) -> Result<MetricsBindings, DynamoError> {
        let ranks = self.capacity().ranks();
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
            return Err(error(BackendError::EngineShutdown, DRAINING));
        };
        let ctx = ctx.inner_arc();
        let prompt_len = u32::try_from(request.token_ids.len()).unwrap_or(u32::MAX);
        let engine_request = self.generate_request(ctx.id(), &request);
        let mut client = InferenceClient::new(self.channel()).max_decoding_message_size(64 << 20);
        let cut = call.cut();
        let started = tokio::select! {
            r = client.generate(engine_request) => r,
            () = cut.cancelled() => {
                call.set_outcome(CallOutcome::CutAtDeadline);
                return Err(error(BackendError::EngineShutdown, CUT));
            }
        };
        let mut stream = match started {
            Ok(response) => response.into_inner(),
            Err(status) => {
                let (e, outcome) = status_error(&status, true);
                call.set_outcome(outcome);
                return Err(e);
            }
        };
        Ok(async_stream::stream! {
            // Holding the admission here keeps the request in flight until
            // its last item was taken, whatever ends it.
            let mut call: Admitted = call;
            let mut generated = 0u32;
            loop {
                let next = tokio::select! {
                    biased;
                    () = cut.cancelled() => {
                        call.set_outcome(CallOutcome::CutAtDeadline);
                        yield Err(error(BackendError::EngineShutdown, CUT));
                        break;
                    }
                    () = ctx.stopped() => {
                        // The framework calls `abort` (Control.Abort); dropping
                        // the engine stream resets it as well.
                        call.set_outcome(CallOutcome::CancelledByCaller);
                        yield Ok(LLMEngineOutput::cancelled());
                        break;
                    }
                    next = stream.next() => next,
                };
                match next {
                    Some(Ok(message)) => match step(message, prompt_len, &mut generated) {
                        Some(Step::Tokens(out)) => yield Ok(out),
                        Some(Step::Finished(out)) => {
                            call.set_outcome(CallOutcome::Ok);
                            yield Ok(out);
                            break;
                        }
                        Some(Step::Failed(e)) => {
                            call.set_outcome(CallOutcome::EngineStatus);
                            yield Err(e);
                            break;
                        }
                        None => {}
                    },
                    Some(Err(status)) => {
                        let (e, outcome) = status_error(&status, false);
                        call.set_outcome(outcome);
                        yield Err(e);
                        break;
                    }
                    None => {
                        call.set_outcome(CallOutcome::EngineFailed);
                        yield Err(error(
                            BackendError::StreamIncomplete,
                            "engine: the stream ended before the generation finished",
                        ));
                        break;
                    }
                }
            }
            drop(call);
        }
        .boxed())
    }

    async fn abort(&self, ctx: Arc<dyn AsyncEngineContext>) {
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
