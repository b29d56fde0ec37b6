//! The fake `trtllm.TrtllmService` (TensorRT-LLM's API as the SMG gateway calls it).

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
use tonic::{Request, Response, Status};

use crate::generate::{self, Ask};
use crate::{HealthCheckMode, State, lock};

pub(crate) struct Engine {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl TrtllmService for Engine {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request = request.into_inner();
        let id = request.request_id.clone();
        let ask = Ask {
            request_id: request.request_id,
            prompt: request
                .tokenized
                .map(|t| t.input_token_ids)
                .unwrap_or_default(),
            max_tokens: request.max_tokens,
            streaming: request.streaming,
        };
        let max = ask.max_tokens;
        let chunk_id = id.clone();
        generate::start(
            self.state.clone(),
            ask,
            move |t, i, prompt| GenerateResponse {
                request_id: chunk_id.clone(),
                response: Some(GenResponse::Chunk(GenerateStreamChunk {
                    token_ids: vec![t],
                    sequence_index: 0,
                    prompt_tokens: prompt,
                    completion_tokens: i + 1,
                    cached_tokens: 0,
                })),
            },
            move |all, prompt| GenerateResponse {
                request_id: id.clone(),
                response: Some(GenResponse::Complete(GenerateComplete {
                    output_token_ids: all,
                    sequence_index: 0,
                    finish_reason: "length".into(),
                    prompt_tokens: prompt,
                    completion_tokens: max,
                    cached_tokens: 0,
                })),
            },
        )
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
        self.state.count_info_call();
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
        self.state.answer_server_info()?;
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
