//! The engine's answer as Dynamo reads it: each OpenEngine `GenerateResponse`
//! an `LLMEngineOutput` (tokens, logprobs, finish reason, stop match, usage),
//! and every way the engine can fail a request a Dynamo error type, so the
//! frontend knows whether the request may migrate to another worker
//! (`CannotConnect`, `Disconnected`, `StreamIncomplete`, `EngineShutdown`
//! may; a refusal, a cancel or a message no one can read may not).

use dynamo_backend_common::{
    BackendError, DynamoError, ErrorType, LLMEngineOutput, PromptTokensDetails, StopReason,
    TopLogprob, usage,
};
use llm_sidecar_engine_api::openengine::{self as oe, GenerateResponse, generate_response};
use llm_sidecar_io::request_plane::CallOutcome;

/// A Dynamo error of this type with this message, which the frontend
/// shows the client too (its default for a 5xx is a bare "Internal server
/// error"): every message here is this worker's own words or the engine's
/// status for the client's request.
pub fn error(error_type: ErrorType, message: impl Into<String>) -> DynamoError {
    let message = message.into();
    DynamoError::builder()
        .error_type(error_type)
        .message(message.clone())
        .public_message(message)
        .build()
}

fn backend(kind: BackendError, message: impl Into<String>) -> DynamoError {
    error(ErrorType::Backend(kind), message)
}

/// The engine sent a message this worker cannot read: that request fails,
/// not migratable (another engine of the same build may send the same).
pub fn protocol_error(message: impl Into<String>) -> DynamoError {
    error(
        ErrorType::BackendProtocol,
        format!("engine: {}", message.into()),
    )
}

/// A gRPC status from the engine: how the frontend should take it, and how
/// the call account counts it. `before_stream`: the engine had not accepted
/// the request yet. The engine's message is kept.
pub fn status_error(status: &tonic::Status, before_stream: bool) -> (DynamoError, CallOutcome) {
    use tonic::Code;
    let message = format!("engine: {}: {}", status.code(), status.message());
    match status.code() {
        // tonic's own word for a message that does not decode.
        Code::Internal if status.message().starts_with("failed to decode") => (
            error(ErrorType::BackendProtocol, message),
            CallOutcome::EngineFailed,
        ),
        Code::Unavailable | Code::Unknown if before_stream => (
            backend(BackendError::CannotConnect, message),
            CallOutcome::EngineUnreachable,
        ),
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Aborted | Code::DataLoss => (
            backend(BackendError::Disconnected, message),
            CallOutcome::EngineFailed,
        ),
        Code::InvalidArgument
        | Code::OutOfRange
        | Code::FailedPrecondition
        | Code::NotFound
        | Code::AlreadyExists
        | Code::Unimplemented => (
            backend(BackendError::InvalidArgument, message),
            CallOutcome::EngineStatus,
        ),
        Code::ResourceExhausted => (
            error(ErrorType::WorkerOverloaded, message),
            CallOutcome::EngineStatus,
        ),
        Code::Cancelled => (
            backend(BackendError::Cancelled, message),
            CallOutcome::EngineStatus,
        ),
        Code::DeadlineExceeded => (
            backend(BackendError::ResponseTimeout, message),
            CallOutcome::EngineStatus,
        ),
        Code::Ok | Code::PermissionDenied | Code::Unauthenticated => (
            backend(BackendError::Unknown, message),
            CallOutcome::EngineStatus,
        ),
    }
}

/// An `EngineError` event: the engine failed the request after accepting it.
pub fn engine_error(e: &oe::EngineError) -> DynamoError {
    let code = oe::ErrorCode::try_from(e.code).unwrap_or(oe::ErrorCode::Unspecified);
    let message = format!("engine: {}: {}", code.as_str_name(), e.message);
    match code {
        oe::ErrorCode::InvalidArgument
        | oe::ErrorCode::UnsupportedFeature
        | oe::ErrorCode::RoleMismatch
        | oe::ErrorCode::ModelNotFound
        | oe::ErrorCode::RequestNotFound
        | oe::ErrorCode::DuplicateRequest
        | oe::ErrorCode::KvSessionNotFound => backend(BackendError::InvalidArgument, message),
        oe::ErrorCode::Cancelled => backend(BackendError::Cancelled, message),
        // TensorRT-LLM's answer to a client that stalled: another worker may do.
        oe::ErrorCode::Overloaded => error(ErrorType::WorkerOverloaded, message),
        oe::ErrorCode::KvTransferFailed => backend(BackendError::Disconnected, message),
        oe::ErrorCode::Internal | oe::ErrorCode::Unspecified if e.retryable => {
            backend(BackendError::EngineShutdown, message)
        }
        oe::ErrorCode::Internal | oe::ErrorCode::Unspecified => {
            backend(BackendError::Unknown, message)
        }
    }
}

/// What one message of the engine's stream means for the caller.
#[derive(Debug)]
pub enum Step {
    /// Tokens to pass on.
    Tokens(LLMEngineOutput),
    /// A message with nothing to pass on (an empty token delta).
    Nothing,
    /// The generation finished: its last output, with the usage.
    Finished(LLMEngineOutput),
    /// The engine failed the request, or said something unreadable.
    Failed(DynamoError, CallOutcome),
}

/// Reads one engine stream for one request, counting its tokens.
#[derive(Debug)]
pub struct Reader {
    request_id: String,
    prompt_len: u32,
    generated: u32,
}

impl Reader {
    /// A reader of the stream for `request_id`, whose prompt had `prompt_len` tokens.
    pub fn new(request_id: &str, prompt_len: u32) -> Self {
        Reader {
            request_id: request_id.to_string(),
            prompt_len,
            generated: 0,
        }
    }

    /// The next message of the stream.
    pub fn step(&mut self, message: GenerateResponse) -> Step {
        let malformed =
            |what: String| Step::Failed(protocol_error(what), CallOutcome::EngineFailed);
        if !message.request_id.is_empty() && message.request_id != self.request_id {
            return malformed(format!(
                "a message for request {:?} on the stream of {:?}",
                message.request_id, self.request_id
            ));
        }
        let Some(event) = message.event else {
            return malformed("a message with no event this worker reads".into());
        };
        match event {
            generate_response::Event::Token(t) => {
                if let Some(index) = t.output_index.filter(|i| *i != 0) {
                    return malformed(format!("tokens of sequence {index}; one was asked for"));
                }
                if t.tokens.is_empty() {
                    return Step::Nothing;
                }
                self.generated = self
                    .generated
                    .saturating_add(u32::try_from(t.tokens.len()).unwrap_or(u32::MAX));
                Step::Tokens(tokens(t.tokens))
            }
            generate_response::Event::Finished(f) => {
                if let Some(index) = f.output_index.filter(|i| *i != 0) {
                    return malformed(format!("the end of sequence {index}; one was asked for"));
                }
                let mut out = match oe::FinishReason::try_from(f.reason) {
                    Ok(oe::FinishReason::Stop) => LLMEngineOutput::stop(),
                    Ok(oe::FinishReason::Length) => LLMEngineOutput::length(),
                    Ok(oe::FinishReason::Cancelled) => LLMEngineOutput::cancelled(),
                    Ok(oe::FinishReason::Unspecified) | Err(_) => {
                        return malformed(format!("a finish with no known reason ({})", f.reason));
                    }
                };
                out.stop_reason = f.stop_match.and_then(|m| match m.r#match? {
                    oe::stop_match::Match::StopTokenId(id)
                    | oe::stop_match::Match::EosTokenId(id) => Some(StopReason::Int(i64::from(id))),
                    oe::stop_match::Match::StopText(text) => Some(StopReason::String(text)),
                });
                out.completion_usage = Some(match message.usage {
                    Some(u) => {
                        let mut total = usage(u.prompt_tokens, u.completion_tokens);
                        total.prompt_tokens_details =
                            u.cached_prompt_tokens.map(|cached| PromptTokensDetails {
                                cached_tokens: Some(cached),
                                ..Default::default()
                            });
                        total.completion_tokens_details = u.reasoning_tokens.and_then(|r| {
                            serde_json::from_value(serde_json::json!({"reasoning_tokens": r})).ok()
                        });
                        total
                    }
                    None => usage(self.prompt_len, self.generated),
                });
                Step::Finished(out)
            }
            generate_response::Event::Error(e) => {
                Step::Failed(engine_error(&e), CallOutcome::EngineStatus)
            }
            generate_response::Event::Prompt(_) => {
                malformed("prompt logprobs, which were not asked for".into())
            }
        }
    }
}

/// Token ids, with their logprobs and top candidates when the engine sent them.
fn tokens(tokens: Vec<oe::TokenInfo>) -> LLMEngineOutput {
    let with_logprobs = tokens.iter().any(|t| t.logprob.is_some());
    let text = |t: String| (!t.is_empty()).then_some(t);
    let mut out = LLMEngineOutput {
        token_ids: tokens.iter().map(|t| t.token_id).collect(),
        ..Default::default()
    };
    if with_logprobs {
        out.log_probs = Some(
            tokens
                .iter()
                .map(|t| t.logprob.unwrap_or(f64::NEG_INFINITY))
                .collect(),
        );
        out.top_logprobs = Some(
            tokens
                .into_iter()
                .map(|t| {
                    t.candidates
                        .into_iter()
                        .enumerate()
                        .map(|(i, c)| TopLogprob {
                            rank: c
                                .rank
                                .unwrap_or_else(|| u32::try_from(i + 1).unwrap_or(u32::MAX)),
                            token_id: c.token_id,
                            token: text(c.token),
                            logprob: c.logprob,
                            bytes: None,
                        })
                        .collect()
                })
                .collect(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use oe::generate_response::Event;

    fn finished(reason: oe::FinishReason, usage: Option<oe::Usage>) -> GenerateResponse {
        GenerateResponse {
            request_id: "r".into(),
            event: Some(Event::Finished(oe::GenerationFinished {
                output_index: Some(0),
                reason: reason as i32,
                message: String::new(),
                stop_match: Some(oe::StopMatch {
                    r#match: Some(oe::stop_match::Match::StopText("END".into())),
                }),
            })),
            usage,
        }
    }

    fn token(id: u32, logprob: Option<f64>) -> GenerateResponse {
        GenerateResponse {
            request_id: "r".into(),
            event: Some(Event::Token(oe::TokenOutput {
                output_index: Some(0),
                tokens: vec![oe::TokenInfo {
                    token_id: id,
                    logprob,
                    candidates: vec![oe::LogProb {
                        token_id: id + 1,
                        logprob: -2.0,
                        token: String::new(),
                        rank: Some(2),
                    }],
                    ..Default::default()
                }],
                text: String::new(),
            })),
            usage: None,
        }
    }

    #[test]
    fn tokens_carry_their_logprobs_and_candidates() {
        let mut reader = Reader::new("r", 3);
        let Step::Tokens(out) = reader.step(token(7, Some(-0.5))) else {
            panic!("tokens")
        };
        assert_eq!(out.token_ids, vec![7]);
        assert_eq!(out.log_probs, Some(vec![-0.5]));
        let top = out.top_logprobs.expect("top logprobs");
        assert_eq!(
            (top[0][0].token_id, top[0][0].rank, top[0][0].logprob),
            (8, 2, -2.0)
        );
        let Step::Tokens(out) = reader.step(token(9, None)) else {
            panic!("tokens")
        };
        assert!(out.log_probs.is_none() && out.top_logprobs.is_none());
    }

    #[test]
    fn the_finish_carries_reason_stop_match_and_the_engines_usage_in_full() {
        let mut reader = Reader::new("r", 3);
        let _ = reader.step(token(7, None));
        let usage = oe::Usage {
            prompt_tokens: 3,
            completion_tokens: 1,
            total_tokens: 4,
            cached_prompt_tokens: Some(2),
            reasoning_tokens: Some(1),
        };
        let Step::Finished(out) = reader.step(finished(oe::FinishReason::Stop, Some(usage))) else {
            panic!("finished")
        };
        assert_eq!(out.stop_reason, Some(StopReason::String("END".into())));
        let u = out.completion_usage.expect("usage");
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.total_tokens),
            (3, 1, 4)
        );
        assert_eq!(
            u.prompt_tokens_details.and_then(|d| d.cached_tokens),
            Some(2)
        );
        assert_eq!(
            u.completion_tokens_details.and_then(|d| d.reasoning_tokens),
            Some(1)
        );
        // Without the engine's usage, the worker's own count.
        let Step::Finished(out) = reader.step(finished(oe::FinishReason::Length, None)) else {
            panic!("finished")
        };
        let u = out.completion_usage.expect("usage");
        assert_eq!((u.prompt_tokens, u.completion_tokens), (3, 1));
    }

    #[test]
    fn unreadable_messages_fail_the_request_as_a_protocol_error() {
        let cases = [
            GenerateResponse {
                request_id: "r".into(),
                event: None,
                usage: None,
            },
            GenerateResponse {
                request_id: "other".into(),
                ..token(1, None)
            },
            GenerateResponse {
                request_id: "r".into(),
                event: Some(Event::Prompt(oe::PromptOutput::default())),
                usage: None,
            },
            finished(oe::FinishReason::Unspecified, None),
        ];
        for message in cases {
            let shown = format!("{message:?}");
            let Step::Failed(e, outcome) = Reader::new("r", 1).step(message) else {
                panic!("{shown} fails")
            };
            assert_eq!(e.error_type(), ErrorType::BackendProtocol, "{shown}");
            assert_eq!(outcome, CallOutcome::EngineFailed);
        }
    }

    #[test]
    fn engine_statuses_keep_their_message_and_say_whether_the_request_may_migrate() {
        let cases = [
            (
                tonic::Code::Unavailable,
                true,
                ErrorType::Backend(BackendError::CannotConnect),
            ),
            (
                tonic::Code::Unavailable,
                false,
                ErrorType::Backend(BackendError::Disconnected),
            ),
            (
                tonic::Code::Internal,
                false,
                ErrorType::Backend(BackendError::Disconnected),
            ),
            (
                tonic::Code::InvalidArgument,
                true,
                ErrorType::Backend(BackendError::InvalidArgument),
            ),
            (
                tonic::Code::ResourceExhausted,
                true,
                ErrorType::WorkerOverloaded,
            ),
            (
                tonic::Code::DeadlineExceeded,
                false,
                ErrorType::Backend(BackendError::ResponseTimeout),
            ),
        ];
        for (code, before, expected) in cases {
            let (e, _) = status_error(&tonic::Status::new(code, "the engine's words"), before);
            assert_eq!(e.error_type(), expected, "{code:?}");
            assert!(
                e.message().contains("the engine's words"),
                "{}",
                e.message()
            );
        }
        let (e, _) = status_error(
            &tonic::Status::internal("failed to decode Protobuf message: x"),
            false,
        );
        assert_eq!(e.error_type(), ErrorType::BackendProtocol);
        let overloaded = engine_error(&oe::EngineError {
            code: oe::ErrorCode::Overloaded as i32,
            message: "client stalled".into(),
            retryable: true,
        });
        assert_eq!(overloaded.error_type(), ErrorType::WorkerOverloaded);
    }
}
