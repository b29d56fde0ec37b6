//! The fake vLLM server (`vllm.grpc.engine.VllmEngine`, as the smg servicer
//! serves it): no per-process identity; GetLoads carries the version.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use llm_sidecar_engine_api::vllm::generate_request::Input;
use llm_sidecar_engine_api::vllm::generate_response::Response as GenResponse;
use llm_sidecar_engine_api::vllm::vllm_engine_server::VllmEngine;
use llm_sidecar_engine_api::vllm::{
    AbortRequest, AbortResponse, GenerateComplete, GenerateRequest, GenerateResponse,
    GenerateStreamChunk, GetLoadsRequest, GetLoadsResponse, GetModelInfoRequest,
    GetModelInfoResponse, GetServerInfoRequest, GetServerInfoResponse, HealthCheckRequest,
    HealthCheckResponse, SchedulerLoad,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::generate::{self, Ask};
use crate::{State, lock};

pub(crate) struct Vllm {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl VllmEngine for Vllm {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request = request.into_inner();
        let prompt = match request.input {
            Some(Input::Tokenized(t)) => t.input_ids,
            Some(Input::Text(_)) | None => Vec::new(),
        };
        let ask = Ask {
            request_id: request.request_id,
            prompt,
            max_tokens: request
                .sampling_params
                .and_then(|p| p.max_tokens)
                .unwrap_or(16),
            streaming: request.stream,
        };
        let max = ask.max_tokens;
        generate::start(
            self.state.clone(),
            ask,
            |t, i, prompt| GenerateResponse {
                response: Some(GenResponse::Chunk(GenerateStreamChunk {
                    token_ids: vec![t],
                    prompt_tokens: prompt,
                    completion_tokens: i + 1,
                    cached_tokens: 0,
                    index: 0,
                })),
            },
            move |all, prompt| GenerateResponse {
                response: Some(GenResponse::Complete(GenerateComplete {
                    output_ids: all,
                    finish_reason: "length".into(),
                    prompt_tokens: prompt,
                    completion_tokens: max,
                    cached_tokens: 0,
                    index: 0,
                })),
            },
        )
    }

    async fn health_check(
        &self,
        _: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.state
            .counters
            .health_checks
            .fetch_add(1, Ordering::Relaxed);
        let healthy = self.state.engine_serving();
        Ok(Response::new(HealthCheckResponse {
            healthy,
            message: if healthy {
                String::new()
            } else {
                "engine errored".into()
            },
        }))
    }

    async fn abort(&self, _: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        self.state.counters.aborts.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(AbortResponse {}))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<GetModelInfoResponse>, Status> {
        let c = &self.state.config;
        self.state.count_info_call();
        Ok(Response::new(GetModelInfoResponse {
            model_path: format!("/models/{}", c.model_id),
            is_generation: true,
            max_context_length: c.max_seq_len.max(0) as u32,
            vocab_size: 32_000,
            served_model_name: c.model_id.clone(),
            max_req_input_len: c.max_input_len,
        }))
    }

    async fn get_server_info(
        &self,
        _: Request<GetServerInfoRequest>,
    ) -> Result<Response<GetServerInfoResponse>, Status> {
        self.state.answer_server_info()?;
        Ok(Response::new(GetServerInfoResponse {
            active_requests: 0,
            is_paused: false,
            last_receive_timestamp: 0.0,
            uptime_seconds: self.state.started.elapsed().as_secs_f64(),
            server_type: "vllm-grpc".into(),
            data_parallel_size: 1,
            max_num_seqs: 64,
        }))
    }

    async fn get_loads(
        &self,
        _: Request<GetLoadsRequest>,
    ) -> Result<Response<GetLoadsResponse>, Status> {
        let s = &self.state;
        s.counters.load_calls.fetch_add(1, Ordering::Relaxed);
        s.answer_load().await?;
        Ok(Response::new(GetLoadsResponse {
            timestamp: String::new(),
            version: lock(&s.version).clone(),
            dp_rank_count: 1,
            loads: vec![SchedulerLoad::default()],
        }))
    }
}
