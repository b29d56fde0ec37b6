//! The fake SGLang native server (`sglang.runtime.v1.SglangService`, as SGLang
//! 0.5.23's `--grpc-port` server serves it): info as JSON documents (no
//! `version` key), `GetLoad`, `HealthCheck`, and `WatchEngineState` (the state
//! now, then one message per change of `healthy` or `is_pause`; unhealthy
//! through warm-up and once a stop begins, then the end). No grpc.health.v1.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use llm_sidecar_engine_api::sglang_runtime::sglang_service_server::SglangService;
use llm_sidecar_engine_api::sglang_runtime::{
    AbortRequest, AbortResponse, GenerateRequest, GenerateResponse, GetLoadRequest,
    GetLoadResponse, GetModelInfoRequest, GetModelInfoResponse, GetServerInfoRequest,
    GetServerInfoResponse, HealthCheckRequest, HealthCheckResponse,
};
use llm_sidecar_engine_api::sglang_runtime::{EngineState, WatchEngineStateRequest};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::generate::{self, Ask};
use crate::{State, WatchControl, lock};

pub(crate) struct SglangNative {
    pub(crate) state: Arc<State>,
}

/// SGLang's ids are `int32` on this API.
fn ids(tokens: impl IntoIterator<Item = u32>) -> Vec<i32> {
    tokens
        .into_iter()
        .map(|t| i32::try_from(t).unwrap_or(i32::MAX))
        .collect()
}

#[tonic::async_trait]
impl SglangService for SglangNative {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request = request.into_inner();
        let ask = Ask {
            request_id: request.rid.unwrap_or_default(),
            prompt: request
                .input_ids
                .into_iter()
                .map(|t| u32::try_from(t).unwrap_or(0))
                .collect(),
            max_tokens: request
                .sampling_params
                .and_then(|p| p.max_new_tokens)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(16),
            streaming: request.stream.unwrap_or(true),
        };
        generate::start(
            self.state.clone(),
            ask,
            |t, i, prompt| GenerateResponse {
                output_ids: ids([t]),
                meta_info: [
                    ("prompt_tokens".to_string(), prompt.to_string()),
                    ("completion_tokens".to_string(), (i + 1).to_string()),
                ]
                .into(),
                finished: false,
            },
            |_all, _prompt| GenerateResponse {
                output_ids: Vec::new(),
                meta_info: [(
                    "finish_reason".to_string(),
                    r#"{"type":"length"}"#.to_string(),
                )]
                .into(),
                finished: true,
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
        Ok(Response::new(HealthCheckResponse {
            healthy: self.state.engine_serving(),
        }))
    }

    async fn get_model_info(
        &self,
        _: Request<GetModelInfoRequest>,
    ) -> Result<Response<GetModelInfoResponse>, Status> {
        let c = &self.state.config;
        self.state.count_info_call();
        let path = format!("/models/{}", c.model_id);
        let json = serde_json::json!({
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": true,
        });
        Ok(Response::new(GetModelInfoResponse {
            model_path: path,
            json_info: json.to_string(),
        }))
    }

    async fn get_server_info(
        &self,
        _: Request<GetServerInfoRequest>,
    ) -> Result<Response<GetServerInfoResponse>, Status> {
        let s = &self.state;
        s.answer_server_info()?;
        Ok(Response::new(server_info(s)))
    }

    type WatchEngineStateStream = ReceiverStream<Result<EngineState, Status>>;

    async fn watch_engine_state(
        &self,
        _: Request<WatchEngineStateRequest>,
    ) -> Result<Response<Self::WatchEngineStateStream>, Status> {
        let state = self.state.clone();
        if state.config.health == crate::HealthMode::Absent {
            return Err(Status::unimplemented("WatchEngineState"));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let mut changed = state.changed.subscribe();
        let mut control = state.watch_control.subscribe();
        tokio::spawn(async move {
            state.counters.watch_streams.fetch_add(1, Ordering::Relaxed);
            let mut revision = 1;
            let now = |s: &State, revision| engine_state(s, revision);
            let mut last = now(&state, revision);
            if tx.send(Ok(last.clone())).await.is_err() {
                return;
            }
            loop {
                tokio::select! {
                    () = tx.closed() => return,
                    c = changed.changed() => {
                        if c.is_err() { return; }
                        let next = now(&state, revision + 1);
                        if (next.healthy, next.is_pause) != (last.healthy, last.is_pause) {
                            revision += 1;
                            last = next;
                            if tx.send(Ok(last.clone())).await.is_err() { return; }
                        }
                    }
                    msg = control.recv() => match msg {
                        // SGLang's stop: unhealthy at once, then the server goes.
                        Ok(WatchControl::End) => {
                            if state.stopping.load(Ordering::Acquire) && last.healthy {
                                let mut stopping = now(&state, revision + 1);
                                stopping.healthy = false;
                                let _ = tx.send(Ok(stopping)).await;
                            }
                            return;
                        }
                        Ok(WatchControl::Fail { code, message }) => {
                            let _ = tx.send(Err(Status::new(tonic::Code::from_i32(code), message))).await;
                            return;
                        }
                        Err(_) => return,
                    },
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_load(
        &self,
        _: Request<GetLoadRequest>,
    ) -> Result<Response<GetLoadResponse>, Status> {
        let s = &self.state;
        s.counters.load_calls.fetch_add(1, Ordering::Relaxed);
        s.answer_load().await?;
        Ok(Response::new(GetLoadResponse {
            json_info: r#"{"num_running_reqs":0,"num_waiting_reqs":0}"#.to_string(),
        }))
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        self.state.counters.aborts.fetch_add(1, Ordering::Relaxed);
        lock(&self.state.aborted_ids).push(request.into_inner().rid);
        Ok(Response::new(AbortResponse { success: true }))
    }
}

/// GetServerInfo's document as SGLang 0.5.23 builds it: the server's resolved
/// arguments and scheduler info, and no `version` (`--engine-version` does
/// not reach it, as nothing on the real server's gRPC API carries one).
fn server_info(s: &State) -> GetServerInfoResponse {
    let json = serde_json::json!({
        "model_path": format!("/models/{}", s.config.model_id),
        "served_model_name": s.config.model_id,
        "context_length": s.config.max_seq_len,
        "max_req_input_len": s.config.max_input_len,
        "tp_size": 1,
        // The scheduler's info, merged in.
        "max_total_num_tokens": super::sglang::KV_POOL_TOKENS,
        "grpc_features": [],
    });
    GetServerInfoResponse {
        json_info: json.to_string(),
    }
}

/// The state WatchEngineState sends.
fn engine_state(s: &State, revision: u64) -> EngineState {
    let path = format!("/models/{}", s.config.model_id);
    EngineState {
        instance_id: s.start_unix_nanos,
        revision,
        healthy: s.engine_serving() && !s.stopping.load(Ordering::Acquire),
        is_pause: s.paused.load(Ordering::Acquire),
        model_info: Some(GetModelInfoResponse {
            json_info: serde_json::json!({ "model_path": path, "is_generation": true }).to_string(),
            model_path: path,
        }),
        server_info: Some(server_info(s)),
    }
}
