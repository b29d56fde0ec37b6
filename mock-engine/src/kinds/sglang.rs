//! The fake SGLang server (`sglang.grpc.scheduler.SglangScheduler`, as the smg
//! servicer serves it): `start_time` in whole seconds is the identity.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use llm_sidecar_engine_api::sglang::generate_response::Response as GenResponse;
use llm_sidecar_engine_api::sglang::sglang_scheduler_server::SglangScheduler;
use llm_sidecar_engine_api::sglang::{
    AbortRequest, AbortResponse, ArgValue, Args, GenerateComplete, GenerateRequest,
    GenerateResponse, GenerateStreamChunk, GetLoadsRequest, GetLoadsResponse, GetModelInfoRequest,
    GetModelInfoResponse, GetServerInfoRequest, GetServerInfoResponse, HealthCheckRequest,
    HealthCheckResponse, Instant, SchedulerLoad, arg_value,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::generate::{self, Ask};
use crate::{State, lock};

/// The mock's KV pool, in tokens (SGLang's `max_total_num_tokens`).
pub(crate) const KV_POOL_TOKENS: i32 = 65_536;

pub(crate) struct Sglang {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl SglangScheduler for Sglang {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request = request.into_inner();
        let id = request.request_id.clone();
        let ask = Ask {
            request_id: request.request_id,
            prompt: request.tokenized.map(|t| t.input_ids).unwrap_or_default(),
            max_tokens: request
                .sampling_params
                .and_then(|p| p.max_new_tokens)
                .unwrap_or(16),
            streaming: request.stream,
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
                    prompt_tokens: prompt,
                    completion_tokens: i + 1,
                    cached_tokens: 0,
                    index: 0,
                })),
            },
            move |all, prompt| GenerateResponse {
                request_id: id.clone(),
                response: Some(GenResponse::Complete(GenerateComplete {
                    output_ids: all,
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
        _: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.state
            .counters
            .health_checks
            .fetch_add(1, Ordering::Relaxed);
        let healthy = self.state.engine_serving();
        Ok(Response::new(HealthCheckResponse {
            healthy,
            message: String::new(),
        }))
    }

    async fn abort(&self, _: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        self.state.counters.aborts.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(AbortResponse {
            success: true,
            message: String::new(),
        }))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<GetModelInfoResponse>, Status> {
        let c = &self.state.config;
        self.state.count_info_call();
        Ok(Response::new(GetModelInfoResponse {
            model_path: format!("/models/{}", c.model_id),
            tokenizer_path: format!("/models/{}", c.model_id),
            is_generation: true,
            served_model_name: c.model_id.clone(),
            // smg-grpc-servicer 0.14.1 (Python) reports the KV pool here, and
            // SGLang's own input limit: min(context - 1, pool - 1) - 5.
            max_context_length: KV_POOL_TOKENS,
            vocab_size: 32_000,
            max_req_input_len: (c.max_seq_len - 1).min(KV_POOL_TOKENS - 1) - 5,
        }))
    }

    async fn get_server_info(
        &self,
        _: Request<GetServerInfoRequest>,
    ) -> Result<Response<GetServerInfoResponse>, Status> {
        let s = &self.state;
        s.answer_server_info()?;
        // The operator set no --context-length: SGLang's argument is null.
        let null = ArgValue {
            kind: Some(arg_value::Kind::NullValue(0)),
        };
        let path = ArgValue {
            kind: Some(arg_value::Kind::StringValue(format!(
                "/models/{}",
                s.config.model_id
            ))),
        };
        Ok(Response::new(GetServerInfoResponse {
            server_args: Some(Args {
                fields: [
                    ("context_length".to_string(), null),
                    ("model_path".to_string(), path),
                ]
                .into(),
            }),
            active_requests: 0,
            is_paused: false,
            last_receive_timestamp: 0.0,
            uptime_seconds: s.started.elapsed().as_secs_f64(),
            sglang_version: lock(&s.version).clone(),
            server_type: "grpc".into(),
            // Whole seconds, as SGLang gives it.
            start_time: Some(Instant {
                seconds: s.start_unix_secs,
                nanos: 0,
            }),
            max_total_num_tokens: KV_POOL_TOKENS,
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
