//! The fake vLLM native server (`vllm.Inference` and `vllm.Control`, as vLLM's
//! Rust frontend serves them): `ServerInfo.instance_id` is the per-process
//! identity; there is no load RPC.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use llm_sidecar_engine_api::vllm_native::control_server::Control;
use llm_sidecar_engine_api::vllm_native::finish_info::FinishReason;
use llm_sidecar_engine_api::vllm_native::generate_request::Prompt;
use llm_sidecar_engine_api::vllm_native::inference_server::Inference;
use llm_sidecar_engine_api::vllm_native::{
    AbortRequest, AbortResponse, FinishInfo, GenerateRequest, GenerateResponse,
    GetModelInfoRequest, GetServerInfoRequest, ModelInfo, ParallelismInfo, PromptInfo,
    SequenceOutput, ServerInfo,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::generate::{self, Ask};
use crate::{State, lock};

pub(crate) struct VllmNative {
    pub(crate) state: Arc<State>,
}

#[tonic::async_trait]
impl Inference for VllmNative {
    type GenerateStreamStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate_stream(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        let request = request.into_inner();
        let prompt = match request.prompt {
            Some(Prompt::TokenIds(t)) => t.ids,
            Some(Prompt::Text(_)) | None => Vec::new(),
        };
        let max_tokens = request
            .stopping
            .map(|s| s.max_new_tokens)
            .filter(|n| *n > 0)
            .unwrap_or(16);
        let ask = Ask {
            request_id: request.request_id,
            prompt,
            max_tokens,
            streaming: true,
        };
        generate::start(
            self.state.clone(),
            ask,
            |t, i, prompt| GenerateResponse {
                prompt_info: (i == 0).then_some(PromptInfo {
                    num_prompt_tokens: prompt,
                }),
                outputs: Some(SequenceOutput {
                    num_tokens: 1,
                    token_ids: vec![t],
                    ..Default::default()
                }),
            },
            move |_all, _prompt| GenerateResponse {
                prompt_info: None,
                outputs: Some(SequenceOutput {
                    finish_info: Some(FinishInfo {
                        num_output_tokens: max_tokens,
                        finish_reason: FinishReason::Length as i32,
                    }),
                    ..Default::default()
                }),
            },
        )
    }
}

#[tonic::async_trait]
impl Control for VllmNative {
    async fn get_server_info(
        &self,
        _: Request<GetServerInfoRequest>,
    ) -> Result<Response<ServerInfo>, Status> {
        let s = &self.state;
        s.answer_server_info()?;
        Ok(Response::new(ServerInfo {
            engine_version: lock(&s.version).clone(),
            api_version: "vllm".into(),
            instance_id: s.instance_id.clone(),
            parallelism: Some(ParallelismInfo {
                tensor_parallel_size: 1,
                pipeline_parallel_size: 1,
                data_parallel_size: 1,
                data_parallel_rank: 0,
            }),
            max_model_len: u32::try_from(s.config.max_seq_len).unwrap_or(0),
            kv_block_size: 16,
            total_kv_blocks: 4_096,
        }))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        let c = &self.state.config;
        self.state.count_info_call();
        Ok(Response::new(ModelInfo {
            model_id: format!("/models/{}", c.model_id),
            served_model_name: c.model_id.clone(),
        }))
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        self.state.counters.aborts.fetch_add(1, Ordering::Relaxed);
        lock(&self.state.aborted_ids).extend(request.into_inner().request_ids);
        Ok(Response::new(AbortResponse {}))
    }
}
