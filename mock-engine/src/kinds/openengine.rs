//! The fake OpenEngine server (`openengine.v1.Inference` and `Control`), as
//! TensorRT-LLM serves it: `engine_name` "tensorrt_llm", an instance id
//! `<host>-<pid>-<ms>` fixed for the process, GetLoad that answers (or, by the
//! control endpoint, stalls or fails UNAVAILABLE as TensorRT-LLM's does when
//! its KV snapshot is stale), Health READY.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use llm_sidecar_engine_api::openengine::control_server::Control;
use llm_sidecar_engine_api::openengine::generate_request::Input;
use llm_sidecar_engine_api::openengine::generate_response::Event;
use llm_sidecar_engine_api::openengine::inference_server::Inference;
use llm_sidecar_engine_api::openengine::{
    AbortRequest, AbortResponse, AbortStatus, DeploymentCapacity, EngineRole, FinishReason,
    GenerateRequest, GenerateResponse, GenerationFinished, GetLoadRequest, GetModelInfoRequest,
    GetServerInfoRequest, HealthRequest, HealthResponse, HealthState, LoadInfo, ModelInfo,
    ParallelismInfo, RankLoadInfo, ServerInfo, TokenInfo, TokenOutput, Usage, abort_request,
    stop_condition,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::generate::{self, Ask};
use crate::{LoadMode, State, lock};

pub(crate) struct OpenEngine {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl Inference for OpenEngine {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request = request.into_inner();
        let id = request.request_id.clone();
        lock(&self.state.asked).push(asked(&request));
        let prompt = match request.input {
            Some(Input::TokenIds(t)) => t.ids,
            Some(Input::Prompt(_)) | None => Vec::new(),
        };
        let ask = Ask {
            request_id: request.request_id,
            prompt,
            max_tokens: request.stopping.and_then(|s| s.max_tokens).unwrap_or(16),
            streaming: true,
        };
        let max = ask.max_tokens;
        let chunk_id = id.clone();
        generate::start(
            self.state.clone(),
            ask,
            move |t, _, _| GenerateResponse {
                request_id: chunk_id.clone(),
                event: Some(Event::Token(TokenOutput {
                    output_index: Some(0),
                    tokens: vec![TokenInfo {
                        token_id: t,
                        token: String::new(),
                    }],
                    text: String::new(),
                })),
                usage: None,
            },
            move |_, prompt| GenerateResponse {
                request_id: id.clone(),
                event: Some(Event::Finished(GenerationFinished {
                    output_index: Some(0),
                    reason: FinishReason::Length as i32,
                    message: String::new(),
                })),
                usage: Some(Usage {
                    prompt_tokens: prompt,
                    completion_tokens: max,
                    total_tokens: prompt + max,
                }),
            },
        )
    }
}

#[tonic::async_trait]
impl Control for OpenEngine {
    async fn get_server_info(
        &self,
        _: Request<GetServerInfoRequest>,
    ) -> Result<Response<ServerInfo>, Status> {
        let s = &self.state;
        s.answer_server_info()?;
        Ok(Response::new(ServerInfo {
            engine_name: s.config.engine_name.clone(),
            engine_version: lock(&s.version).clone(),
            engine_role: EngineRole::Unspecified as i32,
            instance_id: s.instance_id.clone(),
            supported_models: vec![s.config.model_id.clone()],
            schema_revision: 1,
            minimum_client_revision: 1,
            schema_release: "768a93c7b44e40f28c692ad0b471a8f2".into(),
            parallelism: Some(ParallelismInfo {
                tensor_parallel_size: Some(1),
                pipeline_parallel_size: Some(1),
                data_parallel_size: Some(1),
                data_parallel_rank: None,
                data_parallel_start_rank: Some(0),
            }),
            capacity: Some(DeploymentCapacity {
                kv_block_size: Some(crate::KV_BLOCK_SIZE),
                total_kv_blocks: Some(crate::TOTAL_KV_BLOCKS),
                max_running_requests: None,
                max_batched_tokens: None,
            }),
        }))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        let c = &self.state.config;
        self.state.count_info_call();
        Ok(Response::new(ModelInfo {
            model_id: c.model_id.clone(),
            served_model_name: c.model_id.clone(),
            served_model_aliases: vec![],
            max_context_length: Some(c.max_seq_len.max(0) as u32),
            max_output_tokens: Some(c.max_seq_len.max(0) as u32),
        }))
    }

    async fn get_load(
        &self,
        request: Request<GetLoadRequest>,
    ) -> Result<Response<LoadInfo>, Status> {
        let s = &self.state;
        s.counters.load_calls.fetch_add(1, Ordering::Relaxed);
        s.answer_load().await?;
        let kv = *lock(&s.kv);
        // One data-parallel rank, reported per rank when asked, as
        // TensorRT-LLM's server does with --openengine-enable-load-metrics.
        let ranks = if request.get_ref().include_per_rank {
            vec![RankLoadInfo {
                data_parallel_rank: Some(0),
                running_requests: Some(kv.running),
                queued_requests: Some(kv.queued),
                used_kv_blocks: Some(kv.used_blocks),
                total_kv_blocks: Some(crate::TOTAL_KV_BLOCKS),
            }]
        } else {
            Vec::new()
        };
        Ok(Response::new(LoadInfo {
            instance_id: s.instance_id.clone(),
            timestamp_unix_nanos: Some(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos() as u64,
            ),
            running_requests: Some(kv.running),
            queued_requests: Some(kv.queued),
            used_kv_blocks: Some(kv.used_blocks),
            total_kv_blocks: Some(crate::TOTAL_KV_BLOCKS),
            ranks,
        }))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse {
            state: HealthState::Ready as i32,
            checks: vec![],
        }))
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        self.state.counters.aborts.fetch_add(1, Ordering::Relaxed);
        if let Some(abort_request::Target::RequestId(id)) = request.into_inner().target {
            self.state.journal("abort", &id);
            lock(&self.state.aborted_ids).push(id);
        }
        Ok(Response::new(AbortResponse {
            status: AbortStatus::AlreadyFinished as i32,
            message: String::new(),
        }))
    }
}

/// What a Generate asked for, as `/stats` lists it.
fn asked(request: &GenerateRequest) -> serde_json::Value {
    let prompt = match &request.input {
        Some(Input::TokenIds(t)) => serde_json::json!(t.ids),
        Some(Input::Prompt(p)) => serde_json::json!(p),
        None => serde_json::Value::Null,
    };
    let stopping = request.stopping.as_ref();
    let stop_token_ids: Vec<u32> = stopping
        .map(|s| {
            s.conditions
                .iter()
                .filter_map(|c| match c.condition {
                    Some(stop_condition::Condition::StopTokenId(id)) => Some(id),
                    Some(stop_condition::Condition::StopText(_)) | None => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let detokenize = request
        .extra
        .as_ref()
        .and_then(|e| e.fields.get("detokenize"))
        .and_then(|v| match v.kind {
            Some(llm_sidecar_engine_api::prost_types::value::Kind::BoolValue(b)) => Some(b),
            _ => None,
        });
    serde_json::json!({
        "request_id": request.request_id,
        "model": request.model,
        "prompt": prompt,
        "max_tokens": stopping.and_then(|s| s.max_tokens),
        "stop_token_ids": stop_token_ids,
        "temperature": request.sampling.as_ref().and_then(|s| s.temperature),
        "detokenize": detokenize,
    })
}

impl State {
    /// GetLoad / GetLoads as the control endpoint set them.
    pub(crate) async fn answer_load(&self) -> Result<(), Status> {
        let mode = *lock(&self.load_mode);
        match mode {
            LoadMode::Ok => Ok(()),
            LoadMode::Unavailable => Err(Status::unavailable(
                "load metrics unavailable: the KV snapshot is stale",
            )),
            LoadMode::Stall => {
                self.cancel_calls.cancelled().await;
                Err(Status::unavailable("Cancelling all calls"))
            }
            LoadMode::Unimplemented => Err(Status::unimplemented("Method not found!")),
        }
    }

    /// Counts an info call (GetServerInfo, GetModelInfo) for `/stats`.
    pub(crate) fn count_info_call(&self) {
        self.counters.info_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// GetServerInfo, for a server older than it: UNIMPLEMENTED as grpcio
    /// answers a method the servicer lacks.
    pub(crate) fn answer_server_info(&self) -> Result<(), Status> {
        self.count_info_call();
        if self.config.server_info_unimplemented {
            Err(Status::unimplemented("Method not found!"))
        } else {
            Ok(())
        }
    }
}
