//! A Dynamo `PreprocessedRequest` as an OpenEngine `Generate`: every field
//! Dynamo 1.6.1 can send is mapped to an OpenEngine field, named as the
//! frontend's or the router's (used before the request reached this worker),
//! or refused with `InvalidArgument` before the engine is called. Nothing is
//! dropped without a word: docs/DYNAMO.md has the table, one row per field.
//!
//! Refusals come in two kinds. What OpenEngine cannot carry for an
//! aggregated worker with one sequence (beam search, `n` > 1, prompt
//! embeddings, multimodal input, disaggregated hand-offs, prompt logprobs,
//! visible stop token ids) is always refused. What OpenEngine can carry but
//! the engine says it does not serve (`GetModelInfo`'s generation
//! capabilities) is refused too, so the caller gets a 400 it can act on
//! instead of an engine error halfway; where the engine says nothing, the
//! option is forwarded and the engine answers for it.

use dynamo_backend_common::{
    BackendError, DynamoError, ErrorType, GuidedDecodingOptions, PreprocessedRequest,
};
use llm_sidecar_engine_api::openengine::{
    self as oe, CandidateTokenSelectionMode, GuidedDecodingMode, ModelInfo,
};
use llm_sidecar_engine_api::prost_types;
use tonic::metadata::{MetadataMap, MetadataValue};

/// The model as the engine reported it at start-up, and the card's settings.
#[derive(Debug, Clone)]
pub struct Served {
    /// The name clients ask for: `--model-path`, as Dynamo's own sidecar
    /// registers it.
    pub name: String,
    /// The engine's own name for its model (`GetModelInfo`), sent in every
    /// Generate.
    pub engine_model: String,
    /// Registered context length: the flag's, else the engine's.
    pub context_length: Option<u32>,
}

/// What the engine said it serves per request (`ModelInfo.generation`,
/// `supports_lora`). `None` is "not said".
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Capabilities {
    output_logprobs: Option<bool>,
    max_top_n: Option<u32>,
    top_n_selection: Option<bool>,
    guided: Option<bool>,
    guided_modes: Vec<i32>,
    priority: Option<bool>,
    stop_in_output: Option<bool>,
    cache_salt: Option<bool>,
    prefix_cache_bypass: Option<bool>,
    lora: Option<bool>,
}

impl Capabilities {
    /// What `GetModelInfo` reported.
    pub fn of(model: &ModelInfo) -> Self {
        let generation = model.generation.clone().unwrap_or_default();
        let output = generation.output_logprobs.unwrap_or_default();
        let guided = generation.guided_decoding.unwrap_or_default();
        Capabilities {
            output_logprobs: output.supported,
            max_top_n: output.max_top_n,
            top_n_selection: (!output.candidate_selection_modes.is_empty()).then(|| {
                output
                    .candidate_selection_modes
                    .contains(&(CandidateTokenSelectionMode::TopN as i32))
            }),
            guided: guided.supported,
            guided_modes: guided.modes,
            priority: generation.supports_priority,
            stop_in_output: generation.supports_stop_in_output,
            cache_salt: generation.supports_cache_salt,
            prefix_cache_bypass: generation.supports_prefix_cache_bypass,
            lora: model.supports_lora,
        }
    }

    fn guided_mode(&self, mode: GuidedDecodingMode) -> Result<(), DynamoError> {
        if self.guided == Some(false) {
            return Err(refuse("the engine does not serve guided decoding"));
        }
        if !self.guided_modes.is_empty() && !self.guided_modes.contains(&(mode as i32)) {
            return Err(refuse(format!(
                "the engine does not serve guided decoding by {}",
                mode.as_str_name()
            )));
        }
        Ok(())
    }
}

/// A request refused before the engine is called: the caller's to fix.
pub fn refuse(message: impl Into<String>) -> DynamoError {
    crate::answer::error(ErrorType::Backend(BackendError::InvalidArgument), message)
}

/// Refuses `what` when `present`, naming why.
fn refuse_if(present: bool, what: &str) -> Result<(), DynamoError> {
    if present {
        Err(refuse(format!("{what} is not supported by this worker")))
    } else {
        Ok(())
    }
}

/// Refuses an option the engine said it does not serve.
fn engine_serves(said: Option<bool>, what: &str) -> Result<(), DynamoError> {
    if said == Some(false) {
        Err(refuse(format!("the engine does not serve {what}")))
    } else {
        Ok(())
    }
}

/// The OpenEngine request (and its metadata) for a Dynamo one, or the
/// reason it is refused.
pub fn generate_request(
    id: &str,
    request: &PreprocessedRequest,
    served: &Served,
    caps: &Capabilities,
) -> Result<(oe::GenerateRequest, MetadataMap), DynamoError> {
    refuse_what_openengine_cannot_carry(request)?;
    let stop = &request.stop_conditions;
    let sampling = &request.sampling_options;
    let prompt_len = u32::try_from(request.token_ids.len()).unwrap_or(u32::MAX);
    // A prompt that fills the context leaves no room for one token: the
    // engine could only fail it (or, asked for one token, cut it), so it is
    // refused here, naming both lengths.
    if let Some(context) = served.context_length
        && prompt_len >= context
    {
        return Err(refuse(format!(
            "the prompt has {} tokens and the model's context length is {context}: \
             no room for a generated token",
            request.token_ids.len()
        )));
    }
    // A request without max_tokens gets what the context leaves, as Dynamo's
    // sidecar does; without a context length, the engine's default.
    let max_tokens = stop
        .max_tokens
        .or_else(|| served.context_length.map(|c| c.saturating_sub(prompt_len)));
    let texts = stop
        .stop
        .iter()
        .flatten()
        .cloned()
        .map(oe::stop_condition::Condition::StopText);
    let ids = stop
        .stop_token_ids_hidden
        .iter()
        .flatten()
        .chain(stop.stop_token_ids.iter().flatten())
        .chain(
            request
                .eos_token_ids
                .iter()
                .filter(|_| stop.ignore_eos != Some(true)),
        )
        .map(|id| oe::stop_condition::Condition::StopTokenId(*id));
    let mut conditions: Vec<oe::StopCondition> = Vec::new();
    for condition in texts.chain(ids) {
        let condition = oe::StopCondition {
            condition: Some(condition),
        };
        if !conditions.contains(&condition) {
            conditions.push(condition);
        }
    }
    if sampling.include_stop_str_in_output == Some(true) {
        engine_serves(caps.stop_in_output, "stop strings in the output")?;
    }
    let top_k = match sampling.top_k {
        None | Some(-1 | 0) => None,
        Some(k) if k > 0 => Some(k),
        Some(k) => return Err(refuse(format!("top_k must be -1, 0 or positive, not {k}"))),
    };
    let seed = match sampling.seed {
        None => None,
        Some(s) => Some(
            u64::try_from(s).map_err(|_| refuse(format!("seed must not be negative, not {s}")))?,
        ),
    };
    let detokenize = prost_types::Value {
        kind: Some(prost_types::value::Kind::BoolValue(false)),
    };
    let routing = request.routing.as_ref();
    let lora_name = routing
        .and_then(|r| r.lora_name.clone())
        .filter(|n| !n.is_empty());
    if lora_name.is_some() {
        engine_serves(caps.lora, "LoRA adapters")?;
    }
    let engine_request = oe::GenerateRequest {
        request_id: id.to_string(),
        model: served.engine_model.clone(),
        input: Some(oe::generate_request::Input::TokenIds(oe::TokenIds {
            ids: request.token_ids.to_vec(),
        })),
        sampling: Some(oe::SamplingParams {
            temperature: sampling.temperature.map(f64::from),
            top_p: sampling.top_p.map(f64::from),
            top_k,
            min_p: sampling.min_p.map(f64::from),
            frequency_penalty: sampling.frequency_penalty.map(f64::from),
            presence_penalty: sampling.presence_penalty.map(f64::from),
            repetition_penalty: sampling.repetition_penalty.map(f64::from),
            seed,
            // One sequence: `n` other than 1 was refused.
            num_sequences: None,
        }),
        stopping: Some(oe::StoppingOptions {
            max_tokens,
            min_tokens: stop.min_tokens,
            conditions,
            ignore_eos: stop.ignore_eos,
            include_stop_in_output: sampling.include_stop_str_in_output,
        }),
        response: response_options(request, caps)?,
        kv: kv_options(request, caps)?,
        guided: sampling
            .guided_decoding
            .as_ref()
            .map(|g| guided(g, caps))
            .transpose()?,
        lora_name: lora_name.unwrap_or_default(),
        extra: Some(prost_types::Struct {
            fields: [("detokenize".to_string(), detokenize)].into(),
        }),
    };
    Ok((engine_request, metadata(request, caps)?))
}

/// What an aggregated OpenEngine `Generate` of one sequence has no room for.
fn refuse_what_openengine_cannot_carry(request: &PreprocessedRequest) -> Result<(), DynamoError> {
    if request.token_ids.is_empty() {
        return Err(refuse("the request carries no prompt token ids"));
    }
    let sampling = &request.sampling_options;
    if let Some(n) = sampling.n.filter(|n| *n != 1) {
        return Err(refuse(format!(
            "n = {n} is not supported by this worker: one sequence per request (n = 1)"
        )));
    }
    if let Some(n) = sampling.best_of.filter(|n| *n != 1) {
        return Err(refuse(format!(
            "best_of = {n} is not supported by this worker: one sequence per request"
        )));
    }
    refuse_if(sampling.use_beam_search == Some(true), "beam search")?;
    refuse_if(
        sampling.length_penalty.is_some(),
        "length_penalty (a beam-search option)",
    )?;
    refuse_if(
        request.prompt_embeds.is_some(),
        "a prompt given as embeddings",
    )?;
    refuse_if(
        request.multi_modal_data.is_some()
            || request.multi_modal_uuids.is_some()
            || request.mm_routing_info.is_some()
            || request.mm_processor_kwargs.is_some()
            || request.media_io_kwargs.is_some()
            || request.image_cache_scope.is_some(),
        "multimodal input",
    )?;
    refuse_if(
        request.prefill_result.is_some()
            || request.bootstrap_info.is_some()
            || request.encoder_result.is_some(),
        "a disaggregated hand-off (this worker serves aggregated requests)",
    )?;
    refuse_if(
        request.output_options.prompt_logprobs.is_some(),
        "prompt logprobs",
    )?;
    refuse_if(
        request
            .stop_conditions
            .stop_token_ids_visible
            .as_ref()
            .is_some_and(|ids| !ids.is_empty()),
        "visible stop token ids (OpenEngine shows every stop or none)",
    )?;
    refuse_if(
        request.stop_conditions.max_thinking_tokens.is_some(),
        "max_thinking_tokens",
    )?;
    refuse_if(
        request.require_reasoning,
        "require_reasoning (an SGLang option)",
    )?;
    // The frontend passes these vLLM options through untyped:
    // `allowed_token_ids`, `bad_words_token_ids` and `logprob_token_ids`
    // have no OpenEngine field. `detokenize` is served as asked for any
    // value: the engine is always asked for token ids (`detokenize = false`)
    // and the frontend's detokenizer makes the text the client sees.
    if let Some(passthrough) = request
        .extra_args
        .as_ref()
        .and_then(|a| a.get("sampling_options"))
        .and_then(|s| s.as_object())
        && let Some(key) = passthrough.keys().find(|k| *k != "detokenize")
    {
        return Err(refuse(format!(
            "the sampling option {key} is not supported by this worker"
        )));
    }
    Ok(())
}

/// Output logprobs: the token's own, and the top `n` candidates when `n` > 0.
fn response_options(
    request: &PreprocessedRequest,
    caps: &Capabilities,
) -> Result<Option<oe::ResponseOptions>, DynamoError> {
    let Some(n) = request.output_options.logprobs else {
        return Ok(None);
    };
    engine_serves(caps.output_logprobs, "output logprobs")?;
    if n > 0 {
        engine_serves(caps.top_n_selection, "top-n logprob candidates")?;
        if let Some(max) = caps.max_top_n.filter(|max| n > *max) {
            return Err(refuse(format!(
                "the engine serves at most {max} logprob candidates, not {n}"
            )));
        }
    }
    Ok(Some(oe::ResponseOptions {
        return_output_logprobs: Some(true),
        output_candidates: (n > 0).then_some(oe::CandidateTokenSelection {
            selection: Some(oe::candidate_token_selection::Selection::TopN(n)),
        }),
        ..Default::default()
    }))
}

/// The cache salt and a prefix-cache bypass (`extra_args`, as Dynamo's
/// OpenEngine sidecar reads it).
fn kv_options(
    request: &PreprocessedRequest,
    caps: &Capabilities,
) -> Result<Option<oe::KvOptions>, DynamoError> {
    let salt = request
        .routing
        .as_ref()
        .and_then(|r| r.cache_namespace.clone());
    let bypass = request.extra_args.as_ref().and_then(|args| {
        ["bypass_prefix_cache", "disable_prefix_cache"]
            .iter()
            .find_map(|key| args.get(*key).and_then(serde_json::Value::as_bool))
    });
    if salt.is_some() {
        engine_serves(caps.cache_salt, "a cache salt")?;
    }
    if bypass == Some(true) {
        engine_serves(caps.prefix_cache_bypass, "a prefix-cache bypass")?;
    }
    Ok(
        (salt.is_some() || bypass.is_some()).then_some(oe::KvOptions {
            bypass_prefix_cache: bypass,
            cache_salt: salt,
        }),
    )
}

/// Dynamo's guided decoding (from `response_format`, a named or required
/// `tool_choice`, or `guided_*` directly) as OpenEngine's one guide.
fn guided(
    g: &GuidedDecodingOptions,
    caps: &Capabilities,
) -> Result<oe::GuidedDecoding, DynamoError> {
    use oe::guided_decoding::Guide;
    refuse_if(
        g.whitespace_pattern.is_some(),
        "a guided-decoding whitespace pattern",
    )?;
    let json_text = |v: &serde_json::Value| v.to_string();
    let mut guides = Vec::new();
    if let Some(schema) = &g.json {
        guides.push((
            GuidedDecodingMode::JsonSchema,
            Guide::JsonSchema(json_text(schema)),
        ));
    }
    if let Some(regex) = &g.regex {
        guides.push((GuidedDecodingMode::Regex, Guide::Regex(regex.clone())));
    }
    if let Some(choices) = &g.choice {
        guides.push((
            GuidedDecodingMode::Choice,
            Guide::Choice(oe::ChoiceConstraint {
                choices: choices.clone(),
            }),
        ));
    }
    if let Some(grammar) = &g.grammar {
        guides.push((
            GuidedDecodingMode::EbnfGrammar,
            Guide::EbnfGrammar(grammar.clone()),
        ));
    }
    if let Some(tag) = &g.structural_tag {
        guides.push((
            GuidedDecodingMode::StructuralTag,
            Guide::StructuralTag(json_text(tag)),
        ));
    }
    if guides.len() > 1 {
        return Err(refuse(
            "several guided-decoding constraints at once: OpenEngine takes one",
        ));
    }
    let Some((mode, guide)) = guides.pop() else {
        return Err(refuse("guided decoding without a constraint"));
    };
    caps.guided_mode(mode)?;
    Ok(oe::GuidedDecoding {
        guide: Some(guide),
        backend: g.backend.clone().unwrap_or_default(),
    })
}

/// The data-parallel rank the router chose and the engine-side priority, as
/// OpenEngine's metadata keys carry them.
fn metadata(
    request: &PreprocessedRequest,
    caps: &Capabilities,
) -> Result<MetadataMap, DynamoError> {
    let mut metadata = MetadataMap::new();
    let Some(routing) = request.routing.as_ref() else {
        return Ok(metadata);
    };
    if let Some(priority) = routing.priority {
        engine_serves(caps.priority, "request priorities")?;
        metadata.insert("openengine-priority", MetadataValue::from(priority));
    }
    if let Some(rank) = routing.dp_rank {
        metadata.insert("openengine-target-dp-rank", MetadataValue::from(rank));
    }
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_backend_common::{OutputOptions, SamplingOptions, StopConditions};
    use oe::generate_request::Input;
    use oe::guided_decoding::Guide;
    use oe::stop_condition::Condition;

    fn served() -> Served {
        Served {
            name: "tiny".into(),
            engine_model: "engine-tiny".into(),
            context_length: Some(100),
        }
    }

    fn request(ids: &[u32]) -> PreprocessedRequest {
        serde_json::from_value(serde_json::json!({
            "model": "tiny",
            "token_ids": ids,
            "stop_conditions": {},
            "sampling_options": {},
            "output_options": {},
            "eos_token_ids": [2],
        }))
        .expect("a minimal PreprocessedRequest")
    }

    /// The mock engine's capabilities, as `GetModelInfo` reports them.
    fn mock_caps() -> Capabilities {
        Capabilities {
            output_logprobs: Some(true),
            max_top_n: Some(20),
            top_n_selection: Some(true),
            guided: Some(true),
            guided_modes: vec![1, 2, 3, 4, 5, 6],
            priority: Some(false),
            stop_in_output: Some(true),
            cache_salt: Some(true),
            prefix_cache_bypass: Some(false),
            lora: Some(false),
        }
    }

    fn mapped(r: &PreprocessedRequest, caps: &Capabilities) -> (oe::GenerateRequest, MetadataMap) {
        generate_request("req-1", r, &served(), caps).expect("mapped")
    }

    fn refused(r: &PreprocessedRequest, caps: &Capabilities) -> String {
        let e = generate_request("req-1", r, &served(), caps).expect_err("refused");
        assert_eq!(
            e.error_type(),
            ErrorType::Backend(BackendError::InvalidArgument),
            "{e}"
        );
        e.message().to_string()
    }

    #[test]
    fn the_prompt_sampling_and_stop_conditions_map_to_their_fields() {
        let mut r = request(&[5, 6, 7]);
        r.stop_conditions = StopConditions {
            max_tokens: Some(9),
            stop: Some(vec!["END".into()]),
            stop_token_ids: Some(vec![11]),
            stop_token_ids_hidden: Some(vec![12, 11]),
            min_tokens: Some(2),
            ..Default::default()
        };
        r.sampling_options = SamplingOptions {
            n: Some(1),
            temperature: Some(0.5),
            top_p: Some(0.25),
            top_k: Some(-1),
            min_p: Some(0.125),
            frequency_penalty: Some(0.5),
            presence_penalty: Some(0.25),
            repetition_penalty: Some(1.5),
            seed: Some(42),
            include_stop_str_in_output: Some(true),
            ..Default::default()
        };
        let (g, md) = mapped(&r, &mock_caps());
        assert_eq!(g.request_id, "req-1");
        assert_eq!(g.model, "engine-tiny", "the engine's own model name");
        assert_eq!(
            g.input,
            Some(Input::TokenIds(oe::TokenIds { ids: vec![5, 6, 7] }))
        );
        let s = g.sampling.expect("sampling");
        assert_eq!(
            (
                s.temperature,
                s.top_p,
                s.top_k,
                s.min_p,
                s.seed,
                s.num_sequences
            ),
            (Some(0.5), Some(0.25), None, Some(0.125), Some(42), None)
        );
        assert_eq!(
            (
                s.frequency_penalty,
                s.presence_penalty,
                s.repetition_penalty
            ),
            (Some(0.5), Some(0.25), Some(1.5))
        );
        let stop = g.stopping.expect("stopping");
        assert_eq!((stop.max_tokens, stop.min_tokens), (Some(9), Some(2)));
        assert_eq!(stop.include_stop_in_output, Some(true));
        let conditions: Vec<_> = stop
            .conditions
            .into_iter()
            .filter_map(|c| c.condition)
            .collect();
        assert_eq!(
            conditions,
            vec![
                Condition::StopText("END".into()),
                Condition::StopTokenId(12),
                Condition::StopTokenId(11),
                Condition::StopTokenId(2),
            ],
            "stop texts, then hidden, visible-by-default and end-of-sequence ids, once each"
        );
        let extra = g.extra.expect("extra");
        assert_eq!(
            extra.fields["detokenize"].kind,
            Some(prost_types::value::Kind::BoolValue(false))
        );
        assert!(g.response.is_none() && g.guided.is_none() && g.kv.is_none());
        assert!(md.is_empty());
    }

    #[test]
    fn ignore_eos_drops_the_end_of_sequence_stop_and_no_max_tokens_takes_what_the_context_leaves() {
        let mut r = request(&[5, 6, 7]);
        r.stop_conditions.ignore_eos = Some(true);
        let (g, _) = mapped(&r, &mock_caps());
        let stop = g.stopping.expect("stopping");
        assert_eq!(stop.ignore_eos, Some(true));
        assert!(stop.conditions.is_empty(), "{:?}", stop.conditions);
        assert_eq!(stop.max_tokens, Some(97), "context 100 less a prompt of 3");
    }

    #[test]
    fn a_prompt_that_fills_the_context_is_refused_naming_both_lengths_with_or_without_max_tokens() {
        for len in [100usize, 101, 4_000] {
            let ids: Vec<u32> = (0..len as u32).map(|i| 3 + i % 100).collect();
            for max_tokens in [None, Some(1)] {
                let mut r = request(&ids);
                r.stop_conditions.max_tokens = max_tokens;
                let e = generate_request("id", &r, &served(), &mock_caps())
                    .expect_err("no room for a token");
                assert_eq!(
                    e.error_type(),
                    ErrorType::Backend(BackendError::InvalidArgument)
                );
                assert!(
                    e.to_string().contains(&format!("{len} tokens"))
                        && e.to_string().contains("context length is 100"),
                    "{e}"
                );
            }
        }
        let (g, _) = mapped(&request(&[5; 99]), &mock_caps());
        assert_eq!(
            g.stopping.expect("stopping").max_tokens,
            Some(1),
            "one left"
        );
    }

    #[test]
    fn logprobs_ask_for_the_tokens_own_and_the_top_n() {
        let mut r = request(&[5]);
        r.output_options = OutputOptions {
            logprobs: Some(3),
            ..Default::default()
        };
        let (g, _) = mapped(&r, &mock_caps());
        let response = g.response.expect("response options");
        assert_eq!(response.return_output_logprobs, Some(true));
        assert_eq!(
            response.output_candidates.and_then(|c| c.selection),
            Some(oe::candidate_token_selection::Selection::TopN(3))
        );
        r.output_options.logprobs = Some(0);
        let (g, _) = mapped(&r, &mock_caps());
        assert!(g.response.expect("response").output_candidates.is_none());
        r.output_options.logprobs = Some(21);
        assert!(refused(&r, &mock_caps()).contains("at most 20"));
        let caps = Capabilities {
            output_logprobs: Some(false),
            ..mock_caps()
        };
        r.output_options.logprobs = Some(1);
        assert!(refused(&r, &caps).contains("output logprobs"));
    }

    #[test]
    fn each_guide_maps_to_its_openengine_constraint_and_two_are_refused() {
        let cases = [
            (
                serde_json::json!({"json": {"type": "object"}}),
                Guide::JsonSchema(r#"{"type":"object"}"#.into()),
            ),
            (
                serde_json::json!({"regex": "a+"}),
                Guide::Regex("a+".into()),
            ),
            (
                serde_json::json!({"choice": ["x", "y"]}),
                Guide::Choice(oe::ChoiceConstraint {
                    choices: vec!["x".into(), "y".into()],
                }),
            ),
            (
                serde_json::json!({"grammar": "root ::= \"a\""}),
                Guide::EbnfGrammar("root ::= \"a\"".into()),
            ),
            (
                serde_json::json!({"structural_tag": {"k": 1}}),
                Guide::StructuralTag(r#"{"k":1}"#.into()),
            ),
        ];
        for (options, guide) in cases {
            let mut r = request(&[5]);
            let mut g: GuidedDecodingOptions =
                serde_json::from_value(options.clone()).expect("guided options");
            g.backend = Some("xgrammar".into());
            r.sampling_options.guided_decoding = Some(g);
            let (engine, _) = mapped(&r, &mock_caps());
            let guided = engine.guided.expect("guided");
            assert_eq!(guided.guide, Some(guide), "{options}");
            assert_eq!(guided.backend, "xgrammar");
        }
        let mut r = request(&[5]);
        r.sampling_options.guided_decoding = Some(
            serde_json::from_value(serde_json::json!({"regex": "a", "choice": ["b"]}))
                .expect("options"),
        );
        assert!(refused(&r, &mock_caps()).contains("several"));
        let caps = Capabilities {
            guided_modes: vec![GuidedDecodingMode::JsonSchema as i32],
            ..mock_caps()
        };
        r.sampling_options.guided_decoding =
            Some(serde_json::from_value(serde_json::json!({"regex": "a"})).expect("options"));
        assert!(refused(&r, &caps).contains("GUIDED_DECODING_MODE_REGEX"));
    }

    #[test]
    fn routing_hints_the_engine_reads_go_in_metadata_lora_and_the_cache_salt_in_fields() {
        let mut r = request(&[5]);
        r.routing = Some(
            serde_json::from_value(serde_json::json!({
                "dp_rank": 3, "priority": 7, "lora_name": "adapter", "cache_salt": "tenant-a",
                "backend_instance_id": 9, "expected_output_tokens": 4
            }))
            .expect("routing hints"),
        );
        let open = Capabilities::default();
        let (g, md) = mapped(&r, &open);
        assert_eq!(
            md.get("openengine-target-dp-rank")
                .and_then(|v| v.to_str().ok()),
            Some("3")
        );
        assert_eq!(
            md.get("openengine-priority").and_then(|v| v.to_str().ok()),
            Some("7")
        );
        assert_eq!(g.lora_name, "adapter");
        assert_eq!(g.kv.expect("kv").cache_salt.as_deref(), Some("tenant-a"));
        // The mock engine says it serves no LoRA and no priority.
        assert!(refused(&r, &mock_caps()).contains("LoRA"));
        r.routing.as_mut().expect("routing").lora_name = None;
        assert!(refused(&r, &mock_caps()).contains("request priorities"));
    }

    #[test]
    fn a_prefix_cache_bypass_is_refused_where_the_engine_says_it_has_none() {
        let mut r = request(&[5]);
        r.extra_args = Some(serde_json::json!({"bypass_prefix_cache": true}));
        assert!(refused(&r, &mock_caps()).contains("prefix-cache bypass"));
        let (g, _) = mapped(&r, &Capabilities::default());
        assert_eq!(g.kv.expect("kv").bypass_prefix_cache, Some(true));
    }

    #[test]
    fn a_callers_detokenize_is_served_and_the_engine_still_sends_token_ids() {
        let mut r = request(&[5]);
        r.extra_args = Some(serde_json::json!({"sampling_options": {"detokenize": true}}));
        let (g, _) = mapped(&r, &mock_caps());
        assert_eq!(
            g.extra.expect("extra").fields["detokenize"].kind,
            Some(prost_types::value::Kind::BoolValue(false))
        );
    }

    /// The fields the frontend and the router use before the request reaches
    /// this worker (docs/DYNAMO.md's "upstream" rows) are neither refused nor
    /// sent on: with all of them set, the engine is asked exactly what it is
    /// asked without them.
    #[test]
    fn upstream_fields_are_served_and_change_nothing_the_engine_is_asked() {
        let plain = request(&[5, 6]);
        let mut value = serde_json::to_value(&plain).expect("serialise");
        let upstream = serde_json::json!({
            "output_options": {
                "skip_special_tokens": true, "no_stop_trim": true,
                "formatted_prompt": true, "return_tokens_as_token_ids": true
            },
            "routing": {
                "backend_instance_id": 9, "prefill_worker_id": 8, "decode_worker_id": 9,
                "prefill_dp_rank": 0, "expected_output_tokens": 4, "priority_jump": 1.5,
                "strict_priority": 2, "allowed_worker_ids": [9]
            },
            "router_config_override": {},
            "annotations": ["formatted_prompt"],
            "mdc_sum": "abc",
            "request_timestamp_ms": 1.0,
            "router": {"ttft_target": 100.0},
            "agent_context": {"session_id": "s"},
            "migration_link": {"trace_id": "t", "span_id": "s"},
            "kv_hint": {"protocol_version": "1", "message_id": "m", "actions": []},
            "extra_args": {
                "nvext": {"extra_fields": ["worker_id"], "token_in": true},
                "reasoning_parser_kwargs": {"chat_template_kwargs": {}}
            },
            "_HEALTH_CHECK": true
        });
        for (k, v) in upstream.as_object().expect("object") {
            match (value.get_mut(k), v.as_object()) {
                (Some(slot), Some(inner)) if slot.is_object() => {
                    if let Some(slot) = slot.as_object_mut() {
                        slot.extend(inner.clone());
                    }
                }
                _ => value[k] = v.clone(),
            }
        }
        let busy: PreprocessedRequest = serde_json::from_value(value).expect("a request");
        assert!(
            busy.routing.is_some() && busy.is_probe,
            "the fields were read"
        );
        let (g_plain, md_plain) = mapped(&plain, &mock_caps());
        let (g_busy, md_busy) = mapped(&busy, &mock_caps());
        assert_eq!(g_busy, g_plain);
        assert_eq!(md_busy.into_headers(), md_plain.into_headers());
    }

    #[test]
    fn what_openengine_cannot_carry_is_refused_by_name() {
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (serde_json::json!({"sampling_options": {"n": 2}}), "n = 2"),
            (
                serde_json::json!({"sampling_options": {"best_of": 3}}),
                "best_of = 3",
            ),
            (
                serde_json::json!({"sampling_options": {"use_beam_search": true}}),
                "beam search",
            ),
            (
                serde_json::json!({"sampling_options": {"length_penalty": 1.0}}),
                "length_penalty",
            ),
            (
                serde_json::json!({"sampling_options": {"top_k": -2}}),
                "top_k",
            ),
            (
                serde_json::json!({"sampling_options": {"seed": -1}}),
                "seed",
            ),
            (serde_json::json!({"prompt_embeds": "AAAA"}), "embeddings"),
            (
                serde_json::json!({"multi_modal_data": {"image_url": []}}),
                "multimodal",
            ),
            (serde_json::json!({"mm_processor_kwargs": {}}), "multimodal"),
            (serde_json::json!({"image_cache_scope": "s"}), "multimodal"),
            (serde_json::json!({"encoder_result": {}}), "disaggregated"),
            (
                serde_json::json!({"bootstrap_info": {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2}}),
                "disaggregated",
            ),
            (
                serde_json::json!({"prefill_result": {"disaggregated_params": {}}}),
                "disaggregated",
            ),
            (
                serde_json::json!({"output_options": {"prompt_logprobs": 1}}),
                "prompt logprobs",
            ),
            (
                serde_json::json!({"stop_conditions": {"stop_token_ids_visible": [4]}}),
                "visible stop",
            ),
            (
                serde_json::json!({"stop_conditions": {"max_thinking_tokens": 4}}),
                "max_thinking_tokens",
            ),
            (
                serde_json::json!({"require_reasoning": true}),
                "require_reasoning",
            ),
            (
                serde_json::json!({"extra_args": {"sampling_options": {"allowed_token_ids": [1]}}}),
                "allowed_token_ids",
            ),
            (
                serde_json::json!({"extra_args": {"sampling_options": {"detokenize": false, "bad_words_token_ids": [1]}}}),
                "bad_words_token_ids",
            ),
            (serde_json::json!({"token_ids": []}), "no prompt token ids"),
        ];
        for (fields, expected) in cases {
            let mut value = serde_json::to_value(request(&[5])).expect("serialise");
            for (k, v) in fields.as_object().expect("object") {
                if let (Some(slot), Some(inner)) = (value.get_mut(k), v.as_object())
                    && let Some(slot) = slot.as_object_mut()
                {
                    slot.extend(inner.clone());
                } else {
                    value[k] = v.clone();
                }
            }
            let r: PreprocessedRequest = serde_json::from_value(value).expect("a request");
            let message = refused(&r, &Capabilities::default());
            assert!(message.contains(expected), "{fields}: {message}");
        }
    }

    #[test]
    fn capabilities_read_from_model_info_and_absent_means_not_said() {
        assert_eq!(
            Capabilities::of(&ModelInfo::default()),
            Capabilities::default()
        );
        let model = ModelInfo {
            generation: Some(oe::GenerationCapabilities {
                output_logprobs: Some(oe::LogprobCapabilities {
                    supported: Some(true),
                    candidate_selection_modes: vec![CandidateTokenSelectionMode::TokenIds as i32],
                    max_top_n: Some(5),
                }),
                supports_priority: Some(true),
                ..Default::default()
            }),
            supports_lora: Some(true),
            ..Default::default()
        };
        let caps = Capabilities::of(&model);
        assert_eq!(
            caps.top_n_selection,
            Some(false),
            "top-n not among the modes"
        );
        assert_eq!(
            (caps.priority, caps.lora, caps.guided),
            (Some(true), Some(true), None)
        );
    }
}
