//! The fake OpenEngine server (`openengine.v1.Inference` and `Control`), as
//! TensorRT-LLM serves it: `engine_name` "tensorrt_llm", an instance id
//! `<host>-<pid>-<ms>` fixed for the process, GetLoad that answers (or, by the
//! control endpoint, stalls or fails UNAVAILABLE as TensorRT-LLM's does when
//! its KV snapshot is stale), Health READY.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use llm_sidecar_engine_api::openengine::candidate_token_selection::Selection;
use llm_sidecar_engine_api::openengine::control_server::Control;
use llm_sidecar_engine_api::openengine::generate_request::Input;
use llm_sidecar_engine_api::openengine::generate_response::Event;
use llm_sidecar_engine_api::openengine::guided_decoding::Guide;
use llm_sidecar_engine_api::openengine::inference_server::Inference;
use llm_sidecar_engine_api::openengine::{
    AbortRequest, AbortResponse, AbortStatus, DeploymentCapacity, EngineRole, FinishReason,
    GenerateRequest, GenerateResponse, GenerationCapabilities, GenerationFinished,
    GetKvEventSourcesRequest, GetKvEventSourcesResponse, GetLoadRequest, GetModelInfoRequest,
    GetServerInfoRequest, HealthRequest, HealthResponse, HealthState, KvEndpoint, KvEventSource,
    LoadInfo, LogProb, ModelInfo, ParallelismInfo, RankLoadInfo, ServerInfo, TokenInfo,
    TokenOutput, Usage, abort_request, stop_condition,
};
use llm_sidecar_engine_api::prost_types;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::generate::{self, Ask};
use crate::{FaultAction, LoadMode, State, lock};

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
        let metadata = request.metadata().clone();
        let request = request.into_inner();
        let id = request.request_id.clone();
        lock(&self.state.asked).push(asked(&request, &metadata));
        // Logprobs as asked: the token's own and its top-n candidates.
        let response = request.response.as_ref();
        let top_n = response
            .filter(|r| r.return_output_logprobs == Some(true))
            .map(|r| {
                match r
                    .output_candidates
                    .as_ref()
                    .and_then(|c| c.selection.as_ref())
                {
                    Some(Selection::TopN(n)) => *n,
                    _ => 0,
                }
            });
        let prompt = match request.input {
            Some(Input::TokenIds(t)) => t.ids,
            Some(Input::Prompt(_)) | None => Vec::new(),
        };
        // The prompt's blocks are in the cache from now on (as after its
        // prefill); the router hears of them through the KV events.
        if let Some(events) = &self.state.kv_events {
            events.served(&prompt);
        }
        let malformed_at = lock(&self.state.fault)
            .as_ref()
            .filter(|f| f.action == FaultAction::Malformed && f.applies_to(prompt.len()))
            .map(|f| f.at);
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
            move |t, i, _| {
                if malformed_at == Some(i) {
                    return malformed(&chunk_id, 0, i);
                }
                GenerateResponse {
                    request_id: chunk_id.clone(),
                    event: Some(Event::Token(TokenOutput {
                        output_index: Some(0),
                        tokens: vec![token_info(t, top_n)],
                        text: String::new(),
                    })),
                    usage: None,
                }
            },
            move |_, prompt| {
                if malformed_at == Some(max) {
                    return malformed(&id, prompt, max);
                }
                GenerateResponse {
                    request_id: id.clone(),
                    event: Some(Event::Finished(GenerationFinished {
                        output_index: Some(0),
                        reason: FinishReason::Length as i32,
                        message: String::new(),
                        stop_match: None,
                    })),
                    usage: Some(Usage {
                        prompt_tokens: prompt,
                        completion_tokens: max,
                        total_tokens: prompt + max,
                        cached_prompt_tokens: None,
                        reasoning_tokens: None,
                    }),
                }
            },
        )
    }
}

/// A token's logprob in the mock: a pure function of the token id and the
/// candidate's rank (0 for the token itself), so a test can compute what the
/// engine sent.
pub(crate) fn logprob(token: u32, rank: u32) -> f64 {
    -f64::from(token % 50) / 10.0 - 0.25 - f64::from(rank) * 0.5
}

/// The `rank`-th candidate for a token (0 is the token itself): ids the
/// tests' word-level tokenizer has (3 and up).
pub(crate) fn candidate(token: u32, rank: u32) -> u32 {
    let id = (token + 97 * rank) % 32_000;
    if id < 3 { id + 3 } else { id }
}

fn token_info(t: u32, top_n: Option<u32>) -> TokenInfo {
    let Some(n) = top_n else {
        return TokenInfo {
            token_id: t,
            ..Default::default()
        };
    };
    TokenInfo {
        token_id: t,
        token: String::new(),
        logprob: Some(logprob(t, 0)),
        rank: Some(1),
        candidates: (0..n)
            .map(|r| LogProb {
                token_id: candidate(t, r),
                logprob: logprob(t, r),
                token: String::new(),
                rank: Some(r + 1),
            })
            .collect(),
    }
}

/// A message no client can read: it says it is for the request and carries
/// no event (a server of another schema, or a broken one).
fn malformed(id: &str, prompt: u32, tokens: u32) -> GenerateResponse {
    GenerateResponse {
        request_id: id.to_string(),
        event: None,
        usage: Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: tokens,
            total_tokens: prompt + tokens,
            cached_prompt_tokens: None,
            reasoning_tokens: None,
        }),
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
        let reported = *lock(&s.server_info);
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
                data_parallel_size: Some(reported.data_parallel_size),
                data_parallel_rank: None,
                data_parallel_start_rank: Some(reported.data_parallel_start_rank),
            }),
            capacity: Some(DeploymentCapacity {
                kv_block_size: Some(reported.kv_block_size),
                total_kv_blocks: Some(reported.total_kv_blocks),
                max_running_requests: None,
                max_batched_tokens: None,
            }),
            // As TensorRT-LLM's newer server: the heartbeat interval of its
            // KV event publisher, when it runs one.
            extra: s.kv_events.as_ref().map(|events| prost_types::Struct {
                fields: [(
                    "kv_event_heartbeat_interval_ms".to_string(),
                    prost_types::Value {
                        kind: Some(prost_types::value::Kind::NumberValue(
                            events.heartbeat.as_millis() as f64,
                        )),
                    },
                )]
                .into(),
            }),
        }))
    }

    /// One ZMQ source for rank 0, or UNIMPLEMENTED without a publisher (as
    /// TensorRT-LLM's older servers answer).
    async fn get_kv_event_sources(
        &self,
        _: Request<GetKvEventSourcesRequest>,
    ) -> Result<Response<GetKvEventSourcesResponse>, Status> {
        let Some(events) = &self.state.kv_events else {
            return Err(Status::unimplemented(
                "Method not found: openengine.v1.Control/GetKvEventSources",
            ));
        };
        Ok(Response::new(GetKvEventSourcesResponse {
            sources: vec![KvEventSource {
                transport: "zmq".into(),
                endpoint_addr: Some(KvEndpoint {
                    host: events.addr.ip().to_string(),
                    port: u32::from(events.addr.port()),
                    protocol: "tcp".into(),
                }),
                topic: crate::kv_events::TOPIC.into(),
                replay_endpoint: String::new(),
                data_parallel_rank: Some(0),
                encoding: "msgpack".into(),
                schema_version: Some(1),
                buffer_steps: None,
                hwm: None,
                max_queue_size: None,
            }],
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
            generation: Some(capabilities()),
            supports_lora: Some(false),
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

/// What the mock serves per request: output logprobs (top-n up to 20) and
/// every guided-decoding mode (recorded, not enforced), one sequence, stop
/// strings in the output, a cache salt; no prompt logprobs, priority,
/// prefix-cache bypass or LoRA, as TensorRT-LLM's OpenEngine server.
fn capabilities() -> GenerationCapabilities {
    use llm_sidecar_engine_api::openengine::{
        CandidateTokenSelectionMode as Mode, GuidedDecodingCapabilities,
        GuidedDecodingMode as Guide, LogprobCapabilities,
    };
    GenerationCapabilities {
        prompt_logprobs: Some(LogprobCapabilities {
            supported: Some(false),
            ..Default::default()
        }),
        output_logprobs: Some(LogprobCapabilities {
            supported: Some(true),
            candidate_selection_modes: vec![Mode::TopN as i32],
            max_top_n: Some(20),
        }),
        guided_decoding: Some(GuidedDecodingCapabilities {
            supported: Some(true),
            modes: [
                Guide::JsonSchema,
                Guide::Regex,
                Guide::EbnfGrammar,
                Guide::StructuralTag,
                Guide::Choice,
                Guide::JsonObject,
            ]
            .map(|m| m as i32)
            .to_vec(),
        }),
        max_num_sequences: Some(1),
        supports_priority: Some(false),
        supports_stop_in_output: Some(true),
        supports_cache_salt: Some(true),
        supports_prefix_cache_bypass: Some(false),
    }
}

/// What a Generate asked for, as `/stats` lists it.
fn asked(request: &GenerateRequest, metadata: &tonic::metadata::MetadataMap) -> serde_json::Value {
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
    let stop_texts: Vec<&str> = stopping
        .map(|s| {
            s.conditions
                .iter()
                .filter_map(|c| match &c.condition {
                    Some(stop_condition::Condition::StopText(t)) => Some(t.as_str()),
                    Some(stop_condition::Condition::StopTokenId(_)) | None => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let guided = request.guided.as_ref().map(|g| {
        let (mode, value) = match &g.guide {
            Some(Guide::JsonSchema(v)) => ("json_schema", serde_json::json!(v)),
            Some(Guide::Regex(v)) => ("regex", serde_json::json!(v)),
            Some(Guide::EbnfGrammar(v)) => ("ebnf_grammar", serde_json::json!(v)),
            Some(Guide::StructuralTag(v)) => ("structural_tag", serde_json::json!(v)),
            Some(Guide::Choice(c)) => ("choice", serde_json::json!(c.choices)),
            Some(Guide::JsonObject(_)) => ("json_object", serde_json::Value::Null),
            None => ("none", serde_json::Value::Null),
        };
        serde_json::json!({"mode": mode, "value": value, "backend": g.backend})
    });
    let response = request.response.as_ref();
    let top_n = response
        .and_then(|r| r.output_candidates.as_ref())
        .and_then(|c| match c.selection {
            Some(Selection::TopN(n)) => Some(n),
            _ => None,
        });
    let header = |key: &str| metadata.get(key).and_then(|v| v.to_str().ok());
    let sampling = request.sampling.unwrap_or_default();
    let kv = request.kv.clone().unwrap_or_default();
    serde_json::json!({
        "request_id": request.request_id,
        "model": request.model,
        "prompt": prompt,
        "max_tokens": stopping.and_then(|s| s.max_tokens),
        "min_tokens": stopping.and_then(|s| s.min_tokens),
        "ignore_eos": stopping.and_then(|s| s.ignore_eos),
        "include_stop_in_output": stopping.and_then(|s| s.include_stop_in_output),
        "stop_token_ids": stop_token_ids,
        "stop_texts": stop_texts,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed,
        "num_sequences": sampling.num_sequences,
        "output_logprobs": response.and_then(|r| r.return_output_logprobs),
        "top_logprobs": top_n,
        "prompt_logprobs": response.and_then(|r| r.return_prompt_logprobs),
        "guided": guided,
        "lora_name": request.lora_name,
        "cache_salt": kv.cache_salt,
        "bypass_prefix_cache": kv.bypass_prefix_cache,
        "priority": header("openengine-priority"),
        "target_dp_rank": header("openengine-target-dp-rank"),
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
