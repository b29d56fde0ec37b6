//! The fake `trtllm.TrtllmService`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use llm_sidecar_engine_api::trtllm::generate_response::Response as GenResponse;
use llm_sidecar_engine_api::trtllm::trtllm_service_server::TrtllmService;
use llm_sidecar_engine_api::trtllm::{
    AbortRequest, AbortResponse, GenerateComplete, GenerateRequest, GenerateResponse,
    GenerateStreamChunk, GetModelInfoRequest, GetModelInfoResponse, GetServerInfoRequest,
    GetServerInfoResponse, HealthCheckRequest, HealthCheckResponse,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use crate::{HealthCheckMode, State, lock};

pub(crate) struct Engine {
    pub(crate) state: Arc<State>,
}

/// The `i`-th token of a request: deterministic, so direct and proxied runs compare.
pub fn token(seed: u64, i: u32) -> u32 {
    ((seed
        .wrapping_mul(2_654_435_761)
        .wrapping_add(u64::from(i) * 7_919))
        % 32_000) as u32
}

fn seed_of(request: &GenerateRequest) -> u64 {
    let mut seed: u64 = 17;
    for b in request.request_id.bytes() {
        seed = seed.wrapping_mul(31).wrapping_add(u64::from(b));
    }
    if let Some(t) = &request.tokenized {
        for id in &t.input_token_ids {
            seed = seed.wrapping_mul(31).wrapping_add(u64::from(*id));
        }
    }
    seed
}

/// `big-headers:<bytes>` as a request id makes Generate answer with response
/// headers of about that size (one `x-big` header) before its tokens.
fn requested_header_bytes(request_id: &str) -> Option<usize> {
    request_id.strip_prefix("big-headers:")?.parse().ok()
}

/// `error:<code>:<message>` as a request id makes Generate fail with that status
/// and an `x-engine-error` trailer, so tests can check that errors pass unchanged.
fn requested_error(request_id: &str) -> Option<Status> {
    let rest = request_id.strip_prefix("error:")?;
    let (code, message) = rest.split_once(':').unwrap_or((rest, ""));
    let code = tonic::Code::from_i32(code.parse().unwrap_or(13));
    let mut status = Status::new(code, message.to_string());
    if let Ok(v) = MetadataValue::try_from(format!("mock-{request_id}")) {
        status.metadata_mut().insert("x-engine-error", v);
    }
    Some(status)
}

#[tonic::async_trait]
impl TrtllmService for Engine {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request = request.into_inner();
        let state = self.state.clone();
        state
            .counters
            .generate_started
            .fetch_add(1, Ordering::Relaxed);
        lock(&state.seen_ids).push(request.request_id.clone());
        state.journal("seen", &request.request_id);
        if let Some(status) = requested_error(&request.request_id) {
            state.journal("error", &request.request_id);
            return Err(status);
        }
        let big_headers = requested_header_bytes(&request.request_id);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let delay = state.config.token_delay;
        tokio::spawn(async move {
            let seed = seed_of(&request);
            let prompt = request
                .tokenized
                .as_ref()
                .map_or(0, |t| t.input_token_ids.len() as u32);
            let mut all = Vec::with_capacity(request.max_tokens as usize);
            let cancelled = |state: &State, id: &str| {
                state
                    .counters
                    .generate_cancelled
                    .fetch_add(1, Ordering::Relaxed);
                lock(&state.cancelled_ids).push(id.to_string());
                state.journal("cancelled", id);
            };
            for i in 0..request.max_tokens {
                if !delay.is_zero() {
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = tx.closed() => return cancelled(&state, &request.request_id),
                        () = state.cancel_calls.cancelled() => {
                            state.journal("aborted", &request.request_id);
                            let _ = tx.send(Err(Status::unavailable("Cancelling all calls"))).await;
                            return;
                        }
                    }
                }
                let t = token(seed, i);
                all.push(t);
                if request.streaming {
                    let chunk = GenerateResponse {
                        request_id: request.request_id.clone(),
                        response: Some(GenResponse::Chunk(GenerateStreamChunk {
                            token_ids: vec![t],
                            sequence_index: 0,
                            prompt_tokens: prompt,
                            completion_tokens: i + 1,
                            cached_tokens: 0,
                        })),
                    };
                    if tx.send(Ok(chunk)).await.is_err() {
                        return cancelled(&state, &request.request_id);
                    }
                }
            }
            let complete = GenerateResponse {
                request_id: request.request_id.clone(),
                response: Some(GenResponse::Complete(GenerateComplete {
                    output_token_ids: all,
                    sequence_index: 0,
                    finish_reason: "length".into(),
                    prompt_tokens: prompt,
                    completion_tokens: request.max_tokens,
                    cached_tokens: 0,
                })),
            };
            if tx.send(Ok(complete)).await.is_err() {
                return cancelled(&state, &request.request_id);
            }
            state.journal("done", &request.request_id);
            state
                .counters
                .generate_completed
                .fetch_add(1, Ordering::Relaxed);
        });
        let mut response = Response::new(ReceiverStream::new(rx));
        if let Some(bytes) = big_headers
            && let Ok(value) = MetadataValue::try_from("a".repeat(bytes))
        {
            response.metadata_mut().insert("x-big", value);
        }
        Ok(response)
    }

    async fn health_check(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.state
            .counters
            .health_checks
            .fetch_add(1, Ordering::Relaxed);
        let mode = lock(&self.state.health_check).clone();
        match mode {
            HealthCheckMode::Ok => Ok(Response::new(HealthCheckResponse {
                status: "OK".into(),
            })),
            HealthCheckMode::Text(text) => Ok(Response::new(HealthCheckResponse { status: text })),
            HealthCheckMode::Stall => {
                self.state.cancel_calls.cancelled().await;
                Err(Status::unavailable("Cancelling all calls"))
            }
        }
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        self.state.counters.aborts.fetch_add(1, Ordering::Relaxed);
        let id = request.into_inner().request_id;
        Ok(Response::new(AbortResponse {
            success: true,
            message: format!("abort requested for {id}"),
        }))
    }

    async fn get_model_info(
        &self,
        _request: Request<GetModelInfoRequest>,
    ) -> Result<Response<GetModelInfoResponse>, Status> {
        self.state
            .counters
            .info_calls
            .fetch_add(1, Ordering::Relaxed);
        let c = &self.state.config;
        Ok(Response::new(GetModelInfoResponse {
            model_id: c.model_id.clone(),
            max_input_len: c.max_input_len,
            max_seq_len: c.max_seq_len,
            max_batch_size: 64,
            vocab_size: 32_000,
            hidden_size: 4096,
            num_layers: 32,
            num_heads: 32,
            supported_features: vec![],
        }))
    }

    async fn get_server_info(
        &self,
        _request: Request<GetServerInfoRequest>,
    ) -> Result<Response<GetServerInfoResponse>, Status> {
        self.state
            .counters
            .info_calls
            .fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(GetServerInfoResponse {
            version: lock(&self.state.version).clone(),
            backend: self.state.config.backend.clone(),
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            context_parallel_size: 1,
            world_size: 1,
        }))
    }
}
