//! One Generate call in whichever API the target speaks, as a stream of
//! [`Piece`]s: the benchmark and the demo measure every kind the same way.

use std::pin::Pin;

use llm_sidecar_engine_api::{openengine, sglang, sglang_runtime, trtllm, vllm, vllm_native};
use llm_sidecar_io::engine::EngineKind;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;
use tonic::transport::Channel;

/// What one streamed message carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Tokens as they are generated.
    Tokens(Vec<u32>),
    /// The last message (its tokens, where the API repeats them there).
    Done(Vec<u32>),
}

/// A Generate's messages.
pub type Pieces = Pin<Box<dyn Stream<Item = Result<Piece, Status>> + Send>>;

/// Largest message a client here accepts (a whole completion in one message).
const MAX_MESSAGE: usize = 64 << 20;

fn prompt(tokens: u32) -> Vec<u32> {
    (0..tokens).map(|i| 100 + i).collect()
}

/// Starts one streaming Generate of `max_tokens` after a prompt of
/// `prompt_tokens`, in `kind`'s API.
pub async fn generate(
    kind: EngineKind,
    channel: Channel,
    request_id: String,
    prompt_tokens: u32,
    max_tokens: u32,
) -> Result<Pieces, Status> {
    let input = prompt(prompt_tokens);
    match kind {
        EngineKind::Trtllm => {
            use trtllm::generate_response::Response;
            let request = trtllm::GenerateRequest {
                request_id,
                tokenized: Some(trtllm::TokenizedInput {
                    original_text: String::new(),
                    input_token_ids: input,
                }),
                max_tokens,
                streaming: true,
            };
            let stream = trtllm::trtllm_service_client::TrtllmServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .generate(request)
                .await?
                .into_inner();
            Ok(Box::pin(stream.map(|m| {
                m.map(|m| match m.response {
                    Some(Response::Chunk(c)) => Piece::Tokens(c.token_ids),
                    Some(Response::Complete(c)) => Piece::Done(c.output_token_ids),
                    None => Piece::Done(Vec::new()),
                })
            })))
        }
        EngineKind::OpenEngine => {
            use openengine::generate_response::Event;
            let request = openengine::GenerateRequest {
                request_id,
                input: Some(openengine::generate_request::Input::TokenIds(
                    openengine::TokenIds { ids: input },
                )),
                stopping: Some(openengine::StoppingOptions {
                    max_tokens: Some(max_tokens),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let stream = openengine::inference_client::InferenceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .generate(request)
                .await?
                .into_inner();
            Ok(Box::pin(stream.map(|m| {
                m.and_then(|m| match m.event {
                    Some(Event::Token(t)) => Ok(Piece::Tokens(
                        t.tokens.into_iter().map(|t| t.token_id).collect(),
                    )),
                    // Prompt logprobs come before the tokens; the load
                    // generator never asks for them.
                    Some(Event::Prompt(_)) => Ok(Piece::Tokens(Vec::new())),
                    Some(Event::Finished(_)) | None => Ok(Piece::Done(Vec::new())),
                    // OpenEngine reports a failed generation in the stream.
                    Some(Event::Error(e)) => Err(Status::internal(e.message)),
                })
            })))
        }
        EngineKind::Vllm => {
            use vllm::generate_response::Response;
            let request = vllm::GenerateRequest {
                request_id,
                input: Some(vllm::generate_request::Input::Tokenized(
                    vllm::TokenizedInput {
                        original_text: String::new(),
                        input_ids: input,
                    },
                )),
                sampling_params: Some(vllm::SamplingParams {
                    max_tokens: Some(max_tokens),
                }),
                stream: true,
            };
            let stream = vllm::vllm_engine_client::VllmEngineClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .generate(request)
                .await?
                .into_inner();
            Ok(Box::pin(stream.map(|m| {
                m.map(|m| match m.response {
                    Some(Response::Chunk(c)) => Piece::Tokens(c.token_ids),
                    Some(Response::Complete(c)) => Piece::Done(c.output_ids),
                    None => Piece::Done(Vec::new()),
                })
            })))
        }
        EngineKind::Sglang => {
            use sglang::generate_response::Response;
            let request = sglang::GenerateRequest {
                request_id,
                tokenized: Some(sglang::TokenizedInput {
                    original_text: String::new(),
                    input_ids: input,
                }),
                sampling_params: Some(sglang::SamplingParams {
                    max_new_tokens: Some(max_tokens),
                }),
                stream: true,
            };
            let stream = sglang::sglang_scheduler_client::SglangSchedulerClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .generate(request)
                .await?
                .into_inner();
            Ok(Box::pin(stream.map(|m| {
                m.map(|m| match m.response {
                    Some(Response::Chunk(c)) => Piece::Tokens(c.token_ids),
                    Some(Response::Complete(c)) => Piece::Done(c.output_ids),
                    None => Piece::Done(Vec::new()),
                })
            })))
        }
        EngineKind::VllmNative => {
            let request = vllm_native::GenerateRequest {
                request_id,
                prompt: Some(vllm_native::generate_request::Prompt::TokenIds(
                    vllm_native::TokenIds { ids: input },
                )),
                stopping: Some(vllm_native::StoppingCriteria {
                    max_new_tokens: max_tokens,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let stream = vllm_native::inference_client::InferenceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .generate_stream(request)
                .await?
                .into_inner();
            Ok(Box::pin(stream.map(|m| {
                m.map(|m| {
                    let out = m.outputs.unwrap_or_default();
                    if out.finish_info.is_some() {
                        Piece::Done(out.token_ids)
                    } else {
                        Piece::Tokens(out.token_ids)
                    }
                })
            })))
        }
        EngineKind::SglangNative => {
            let request = sglang_runtime::GenerateRequest {
                input_ids: input
                    .into_iter()
                    .map(|t| i32::try_from(t).unwrap_or(i32::MAX))
                    .collect(),
                sampling_params: Some(sglang_runtime::SamplingParams {
                    max_new_tokens: Some(i32::try_from(max_tokens).unwrap_or(i32::MAX)),
                    ..Default::default()
                }),
                stream: Some(true),
                rid: Some(request_id),
            };
            let stream = sglang_runtime::sglang_service_client::SglangServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .generate(request)
                .await?
                .into_inner();
            Ok(Box::pin(stream.map(|m| {
                m.map(|m| {
                    let ids = m
                        .output_ids
                        .into_iter()
                        .map(|t| u32::try_from(t).unwrap_or(0))
                        .collect();
                    if m.finished {
                        Piece::Done(ids)
                    } else {
                        Piece::Tokens(ids)
                    }
                })
            })))
        }
    }
}

/// Runs one Generate to its end; the number of tokens streamed.
pub async fn tokens_of(mut pieces: Pieces) -> Result<usize, Status> {
    let mut n = 0;
    while let Some(piece) = pieces.next().await {
        if let Piece::Tokens(t) = piece? {
            n += t.len();
        }
    }
    Ok(n)
}
