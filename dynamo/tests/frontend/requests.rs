//! Every request as Dynamo's own sidecar answers it, behind Dynamo 1.6.1's
//! real frontend: logprobs and guided decoding reach the engine and come
//! back, what the engine cannot serve is refused before it is called, stop
//! strings and `max_tokens` end the answer, an engine that fails mid-stream
//! gives one typed error, a finished generation is never cancelled, and a
//! request whose engine dies migrates with nothing lost (docs/DYNAMO.md).

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use crate::support::*;
use crate::{HANG, Setup, start_pair, wait_until};

/// The first prompt `[a, a + 1]` from `from` on whose first `n` tokens the
/// mock produces no special token (the frontend shows no text for those
/// and stops at the end of sequence), and `ok(prompt, tokens)` holds.
fn prompt_where(from: u32, n: u32, ok: impl Fn(&[u32], &[u32]) -> bool) -> (Vec<u32>, String) {
    (from..from + 500)
        .map(|a| vec![a, a + 1])
        .find(|p| {
            let t = mock_tokens(p, n);
            !any_special(&t) && ok(p, &t)
        })
        .map(|p| {
            let text = format!("w{} w{}", p[0], p[1]);
            (p, text)
        })
        .expect("a prompt among 500")
}

/// The JSON `data:` events of an SSE answer (without `[DONE]`), and
/// whether it ended with `[DONE]`.
fn sse_events(body: &str) -> (Vec<serde_json::Value>, bool) {
    let data: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::trim)
        .collect();
    let done = data.last() == Some(&"[DONE]");
    let events = data
        .iter()
        .filter(|d| **d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}")))
        .collect();
    (events, done)
}

/// An SSE event that reports an error (the frontend's error event).
fn is_error_event(event: &serde_json::Value) -> bool {
    event.get("error").is_some() || event.get("choices").is_none()
}

/// The last finish reason an answer names, streamed or not.
fn finish_reason(body: &str) -> Option<String> {
    let choices: Vec<serde_json::Value> = if body.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(body).expect("JSON");
        v["choices"].as_array().cloned().unwrap_or_default()
    } else {
        sse_events(body)
            .0
            .iter()
            .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
            .collect()
    };
    choices
        .iter()
        .filter_map(|c| c["finish_reason"].as_str().map(str::to_string))
        .next_back()
}

/// A token's text and logprob as the HTTP answer gives them.
type Scored = (String, f64);

/// `((token, logprob), [(candidate, logprob)])` per generated token of a
/// chat answer, streamed or not.
fn chat_logprobs(body: &str) -> Vec<(Scored, Vec<Scored>)> {
    let contents: Vec<serde_json::Value> = if body.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(body).expect("JSON");
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    } else {
        sse_events(body)
            .0
            .iter()
            .flat_map(|e| {
                e["choices"][0]["logprobs"]["content"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .collect()
    };
    contents
        .iter()
        .map(|c| {
            let top = c["top_logprobs"]
                .as_array()
                .map(|t| {
                    t.iter()
                        .map(|x| {
                            (
                                x["token"].as_str().unwrap_or_default().trim().to_string(),
                                x["logprob"].as_f64().unwrap_or(f64::NAN),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            (
                (
                    c["token"].as_str().unwrap_or_default().trim().to_string(),
                    c["logprob"].as_f64().unwrap_or(f64::NAN),
                ),
                top,
            )
        })
        .collect()
}

fn assert_close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() < 1e-3,
        "{what}: {got} (the engine sent {want})"
    );
}

fn started(engine: &Engine) -> u64 {
    engine.stats()["generate_started"].as_u64().unwrap_or(0)
}

#[test]
fn logprobs_the_engine_produced_reach_the_http_answer_streamed_and_not() {
    let s = Setup::start("dyn-logprobs", 1, false, "2ms");
    let (prompt, text) = prompt_where(60, 6, |_, _| true);
    let tokens = mock_tokens(&prompt, 6);
    for stream in [false, true] {
        let mut body = chat(&s.model, &text, 6, stream);
        body["logprobs"] = true.into();
        body["top_logprobs"] = 2.into();
        let (status, answer) = s.frontend.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{answer}");
        let asked = s.engines[0].asked_for(&prompt);
        assert_eq!(asked["output_logprobs"], true, "{asked}");
        assert_eq!(asked["top_logprobs"], 2, "{asked}");
        let got = chat_logprobs(&answer);
        assert_eq!(
            got.len(),
            tokens.len(),
            "one entry per token (stream {stream}): {answer}"
        );
        for (i, (((token, logprob), top), t)) in got.iter().zip(&tokens).enumerate() {
            assert_eq!(token, &format!("w{t}"), "token {i}");
            assert_close(
                *logprob,
                mock_logprob(*t, 0),
                &format!("token {i}'s logprob"),
            );
            assert_eq!(top.len(), 2, "token {i}'s top logprobs: {top:?}");
            for (rank, (candidate, lp)) in top.iter().enumerate() {
                let rank = rank as u32;
                assert_eq!(
                    candidate,
                    &format!("w{}", mock_candidate(*t, rank)),
                    "token {i}"
                );
                assert_close(
                    *lp,
                    mock_logprob(*t, rank),
                    &format!("token {i} candidate {rank}"),
                );
            }
        }
    }
    // Completions: `logprobs: N` is the top N.
    let mut body = completion(&s.model, &text, 6, false);
    body["logprobs"] = 1.into();
    let (status, answer) = s.frontend.post("/v1/completions", &body);
    assert_eq!(status, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).expect("JSON");
    let token_logprobs = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("completion logprobs: {answer}"));
    assert_eq!(token_logprobs.len(), tokens.len(), "{answer}");
    for (lp, t) in token_logprobs.iter().zip(&tokens) {
        assert_close(
            lp.as_f64().unwrap_or(f64::NAN),
            mock_logprob(*t, 0),
            "completion logprob",
        );
    }
}

#[test]
fn a_json_schema_response_format_and_a_named_tool_choice_reach_the_engine_as_guidance() {
    let s = Setup::start("dyn-guided", 1, false, "1ms");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    });
    let mut body = chat(&s.model, "w90 w91", 4, false);
    body["response_format"] = serde_json::json!({
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": schema},
    });
    let (status, answer) = s.frontend.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{answer}");
    let guided = &s.engines[0].asked_for(&[90, 91])["guided"];
    assert_eq!(guided["mode"], "json_schema", "{guided}");
    let sent: serde_json::Value =
        serde_json::from_str(guided["value"].as_str().expect("a schema")).expect("JSON schema");
    assert_eq!(sent["properties"], schema["properties"], "{sent}");

    let mut body = chat(&s.model, "w92 w93", 4, false);
    body["tools"] = serde_json::json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}},
                "required": ["location"],
            },
        },
    }]);
    body["tool_choice"] =
        serde_json::json!({"type": "function", "function": {"name": "get_weather"}});
    let (status, answer) = s.frontend.post("/v1/chat/completions", &body);
    eprintln!("named tool_choice: HTTP {status}: {answer}");
    let guided = &s.engines[0].asked_for(&[92, 93])["guided"];
    assert!(
        guided["mode"].is_string() && guided["value"].to_string().contains("location"),
        "the tool's parameters reach the engine as guidance: {guided}"
    );
}

#[test]
fn a_request_the_engine_cannot_serve_is_refused_400_before_the_engine_sees_it() {
    let s = Setup::start("dyn-refused", 1, false, "1ms");
    let before = started(&s.engines[0]);
    let mut body = chat(&s.model, "w94", 4, false);
    body["n"] = 2.into();
    let (status, answer) = s.frontend.post("/v1/chat/completions", &body);
    assert_eq!(status, 400, "n = 2: {answer}");
    assert!(answer.contains("n = 2"), "the refusal names n: {answer}");
    let mut body = completion(&s.model, "w94", 4, true);
    body["n"] = 3.into();
    let (status, answer) = s.frontend.post("/v1/completions", &body);
    assert_eq!(status, 400, "n = 3, streamed: {answer}");
    assert_eq!(started(&s.engines[0]), before, "the engine saw no Generate");
    // The worker serves the next request.
    let (status, answer) = s
        .frontend
        .post("/v1/completions", &completion(&s.model, "w94", 3, false));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(started(&s.engines[0]), before + 1);
}

#[test]
fn stop_strings_and_max_tokens_end_the_answer_streamed_and_not() {
    let s = Setup::start("dyn-stop", 1, false, "1ms");
    // A prompt whose fifth token's word appears in none of the four before it.
    let (prompt, text) = prompt_where(100, 12, |_, t| {
        let stop = format!("w{}", t[4]);
        !words(&t[..4]).contains(&stop)
    });
    let tokens = mock_tokens(&prompt, 12);
    let stop = format!("w{}", tokens[4]);
    for (path, stream) in [
        ("/v1/completions", false),
        ("/v1/completions", true),
        ("/v1/chat/completions", false),
        ("/v1/chat/completions", true),
    ] {
        let mut body = if path.contains("chat") {
            chat(&s.model, &text, 12, stream)
        } else {
            completion(&s.model, &text, 12, stream)
        };
        body["stop"] = serde_json::json!([stop]);
        let (status, answer) = s.frontend.post(path, &body);
        assert_eq!(status, 200, "{path} {stream}: {answer}");
        assert_eq!(
            answer_text(&answer).trim_end(),
            words(&tokens[..4]).trim_end(),
            "{path} stream {stream}: the answer ends before the stop string {stop}: {answer}"
        );
        assert_eq!(finish_reason(&answer).as_deref(), Some("stop"), "{answer}");
        let asked = s.engines[0].asked_for(&prompt);
        assert_eq!(asked["stop_texts"], serde_json::json!([stop]), "{asked}");
        // max_tokens alone: exactly that many.
        let body = if path.contains("chat") {
            chat(&s.model, &text, 5, stream)
        } else {
            completion(&s.model, &text, 5, stream)
        };
        let (status, answer) = s.frontend.post(path, &body);
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer_text(&answer), words(&tokens[..5]), "{path} {stream}");
        assert_eq!(
            finish_reason(&answer).as_deref(),
            Some("length"),
            "{answer}"
        );
    }
}

#[test]
fn an_engine_stream_cut_at_token_5_gives_one_error_and_the_worker_serves_the_next() {
    let s = Setup::start("dyn-cut", 1, false, "5ms");
    let (prompt, text) = prompt_where(200, 20, |_, _| true);
    let tokens = mock_tokens(&prompt, 20);
    s.engines[0].control("/fault?action=cut&at=5&code=13&message=mock%20engine%20cut");
    let (status, body) = s
        .frontend
        .post("/v1/chat/completions", &chat(&s.model, &text, 20, true));
    assert_eq!(status, 200, "a stream already started: {body}");
    let (events, done) = sse_events(&body);
    let errors: Vec<_> = events.iter().filter(|e| is_error_event(e)).collect();
    assert_eq!(errors.len(), 1, "exactly one error event: {body}");
    assert!(
        errors[0].to_string().contains("mock engine cut"),
        "the engine's message: {body}"
    );
    assert!(done, "then [DONE]: {body}");
    assert!(
        is_error_event(events.last().expect("events")),
        "the error is the last event: {body}"
    );
    assert_eq!(
        answer_text(&body.replace(&errors[0].to_string(), "{}")),
        words(&tokens[..5])
    );
    // Not streamed: a 5xx with the engine's message.
    s.engines[0].control("/fault?action=cut&at=5&code=13&message=mock%20engine%20cut");
    let (status, body) = s
        .frontend
        .post("/v1/completions", &completion(&s.model, &text, 20, false));
    assert!((500..600).contains(&status), "HTTP {status}: {body}");
    assert!(
        body.contains("mock engine cut"),
        "the engine's message: {body}"
    );
    eprintln!("cut, not streamed: HTTP {status}: {body}");
    // The engine is alive: the worker stays and serves the next request.
    let (status, body) = s
        .frontend
        .post("/v1/completions", &completion(&s.model, &text, 4, false));
    assert_eq!(status, 200, "{body}");
    s.assert_registered(0);
}

#[test]
fn a_malformed_terminal_message_fails_that_request_only() {
    let mut s = Setup::start("dyn-malformed", 1, false, "2ms");
    let (_, text) = prompt_where(300, 8, |_, _| true);
    for stream in [true, false] {
        // Message 8 of an 8-token answer is its final one.
        s.engines[0].control("/fault?action=malformed&at=8");
        let (status, body) = s
            .frontend
            .post("/v1/completions", &completion(&s.model, &text, 8, stream));
        if stream {
            assert_eq!(status, 200, "{body}");
            let (events, done) = sse_events(&body);
            assert_eq!(
                events.iter().filter(|e| is_error_event(e)).count(),
                1,
                "one error event: {body}"
            );
            assert!(done, "{body}");
            assert_eq!(finish_reason(&body), None, "no finish: {body}");
        } else {
            assert!((500..600).contains(&status), "HTTP {status}: {body}");
            assert!(body.contains("no event this worker reads"), "{body}");
        }
    }
    assert!(
        s.workers[0]
            .proc
            .log_text()
            .contains("no event this worker reads"),
        "the worker says what it could not read"
    );
    let (status, body) = s
        .frontend
        .post("/v1/completions", &completion(&s.model, &text, 4, false));
    assert_eq!(status, 200, "the next request: {body}");
    assert!(s.workers[0].proc.running(), "the worker serves on");
    s.assert_registered(0);
}

#[test]
fn a_finished_generation_is_never_cancelled_and_a_message_after_it_is_ignored() {
    // The engine ends each stream one token's time (20 ms) after its final
    // message, as a real engine's trailers follow its last output.
    let s = Setup::start("dyn-finished", 1, false, "20ms");
    let (prompt, text) = prompt_where(400, 6, |_, _| true);
    let tokens = mock_tokens(&prompt, 6);
    for stream in [false, true] {
        let (status, body) = s
            .frontend
            .post("/v1/completions", &completion(&s.model, &text, 6, stream));
        assert_eq!(status, 200, "{body}");
        let (status, body) = s
            .frontend
            .post("/v1/chat/completions", &chat(&s.model, &text, 6, stream));
        assert_eq!(status, 200, "{body}");
    }
    // The engine sends its last token again after the final message.
    s.engines[0].control("/fault?action=replay");
    let (status, body) = s
        .frontend
        .post("/v1/completions", &completion(&s.model, &text, 6, true));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        answer_text(&body),
        words(&tokens),
        "nothing after the end: {body}"
    );
    wait_until(HANG, "the engine to complete all five", || {
        s.engines[0].stats()["generate_completed"] == 5
    });
    let stats = s.engines[0].stats();
    assert_eq!(
        stats["generate_cancelled"], 0,
        "no finished generation cancelled: {stats}"
    );
    assert_eq!(
        stats["aborted_ids"],
        serde_json::json!([]),
        "no abort: {stats}"
    );
}

/// Reads an SSE answer as it comes; each `data:` line with the time since
/// `from` it arrived.
fn timed_events(stream: std::net::TcpStream, from: Instant) -> Vec<(Duration, String)> {
    let mut lines = Vec::new();
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        if let Some(data) = line.strip_prefix("data: ") {
            lines.push((from.elapsed(), data.trim().to_string()));
        }
    }
    lines
}

#[test]
fn a_request_whose_engine_dies_at_token_5_migrates_with_nothing_lost() {
    let mut s = Setup::start_with(
        "dyn-migrate",
        2,
        false,
        "20ms",
        &[],
        &["--migration-limit", "1"],
    );
    // No special token among the first 5, nor among the 15 the second
    // engine makes of the prompt with those 5 appended.
    let (prompt, text) = prompt_where(500, 5, |p, first| {
        let moved: Vec<u32> = p.iter().chain(first).copied().collect();
        !any_special(&mock_tokens(&moved, 15))
    });
    let first = mock_tokens(&prompt, 5);
    let moved: Vec<u32> = prompt.iter().chain(&first).copied().collect();
    let rest = mock_tokens(&moved, 15);
    // Whichever engine gets it dies after its fifth token; the request that
    // migrates (its prompt now 7 tokens) takes no fault.
    for e in &s.engines {
        e.control("/fault?action=exit&at=5&max_prompt=2");
    }
    let sent = Instant::now();
    let stream = s
        .frontend
        .open_post("/v1/completions", &completion(&s.model, &text, 20, true));
    let events = timed_events(stream, sent);
    let text_events: Vec<&(Duration, String)> =
        events.iter().filter(|(_, d)| d != "[DONE]").collect();
    let body: String = events.iter().map(|(_, d)| format!("data: {d}\n")).collect();
    let (parsed, done) = sse_events(&body);
    assert!(done, "{body}");
    assert!(
        !parsed.iter().any(is_error_event),
        "no error reached the client: {body}"
    );
    let all: Vec<u32> = first.iter().chain(&rest).copied().collect();
    assert_eq!(
        answer_text(&body),
        words(&all),
        "20 tokens, in order, none twice: {body}"
    );
    let dead = (0..2)
        .find(|i| !s.engines[*i].proc.running())
        .expect("one engine died");
    let alive = 1 - dead;
    let asked = s.engines[alive].asked_for(&moved);
    assert_eq!(asked["max_tokens"], 15, "the rest of the budget: {asked}");
    let code = s.workers[dead].proc.wait_exit(HANG);
    assert_eq!(code, 1, "the dead engine's worker exits 1");
    // When the fifth and the sixth token arrived: the gap is the time to the
    // first token on the second worker.
    let token_times: Vec<Duration> = text_events
        .iter()
        .filter(|(_, d)| answer_text(&format!("data: {d}\n")).contains('w'))
        .map(|(t, _)| *t)
        .collect();
    if token_times.len() >= 6 {
        eprintln!(
            "migration: {} tokens, the sixth {:?} after the fifth (first token {:?})",
            token_times.len(),
            token_times[5] - token_times[4],
            token_times[0]
        );
    }
}

/// The engine serving a streamed request SIGKILLed after its fifth token,
/// 20 times in a row (the killed pair restarted each time), with the
/// frontend's `--migration-limit 1`: every time the stream moves to the
/// other worker and the client receives all 20 tokens, the first 5 as the
/// first engine made them, and no error. The broken stream reaches the
/// frontend typed `Disconnected`, which Dynamo's push router quarantines the
/// worker for (`dynamo-runtime` 1.6.1 `push_router.rs`, `is_inhibited`)
/// before its migration picks the retry's worker.
#[test]
fn a_stream_whose_engine_is_killed_mid_way_migrates_every_time() {
    const KILLS: usize = 20;
    let mut s = Setup::start_with(
        "dyn-migrate-kill",
        2,
        false,
        "20ms",
        &[],
        &["--migration-limit", "1"],
    );
    let model = std::path::PathBuf::from(&s.model);
    let started = |s: &Setup| -> Vec<u64> {
        s.engines
            .iter()
            .map(|e| e.stats()["generate_started"].as_u64().unwrap_or(0))
            .collect()
    };
    let mut gaps = Vec::new();
    for kill in 0..KILLS {
        // No special token among the first 20, nor in any continuation the
        // other engine makes after 5 to 15 of them.
        let (prompt, text) = prompt_where(600 + 700 * kill as u32, 20, |p, first| {
            (5..=15).all(|k| {
                let moved: Vec<u32> = p.iter().chain(&first[..k]).copied().collect();
                !any_special(&mock_tokens(&moved, 20 - k as u32))
            })
        });
        let before = started(&s);
        let sent = Instant::now();
        let stream = s
            .frontend
            .open_post("/v1/completions", &completion(&s.model, &text, 20, true));
        let mut body = String::new();
        let mut killed = None;
        let mut fifth_at = None;
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            body.push_str(&line);
            body.push('\n');
            if killed.is_none() && answer_text(&body).split_whitespace().count() >= 5 {
                let now = started(&s);
                let serving = (0..2)
                    .find(|i| now[*i] > before[*i])
                    .expect("an engine took the request");
                s.engines[serving].proc.signal("KILL");
                killed = Some(serving);
                fifth_at = Some(sent.elapsed());
            }
        }
        let dead = killed.unwrap_or_else(|| panic!("kill {kill}: 5 tokens never came: {body}"));
        let (events, done) = sse_events(&body);
        assert!(
            done && !events.iter().any(is_error_event),
            "kill {kill}: the stream migrated, no error reached the client: {body}"
        );
        let got = answer_text(&body);
        assert_eq!(
            got.split_whitespace().count(),
            20,
            "kill {kill}: 20 tokens: {body}"
        );
        assert!(
            got.starts_with(&words(&mock_tokens(&prompt, 5))),
            "kill {kill}: the first engine's 5 tokens first: {got}"
        );
        gaps.push(sent.elapsed() - fifth_at.unwrap_or_default());
        // The kubelet's part: the killed pair restarted, and the frontend
        // routing to it again before the next kill.
        assert_eq!(s.workers[dead].proc.wait_exit(HANG), 1, "kill {kill}");
        let (engine, worker, id) = start_pair(&s._dir.0, &s.store, &model, "20ms", &[]);
        s.ids[dead] = id;
        s.engines[dead] = engine;
        s.workers[dead] = worker;
        wait_until(
            HANG,
            "the frontend to route to the restarted worker",
            || {
                let (status, answer) = s
                    .frontend
                    .post("/v1/completions", &completion(&s.model, "w22", 1, false));
                assert_eq!(status, 200, "kill {kill}: {answer}");
                s.engines[dead].stats()["generate_started"].as_u64() > Some(0)
            },
        );
    }
    eprintln!("{KILLS} kills, {KILLS} migrations; fifth token to the end of the stream: {gaps:?}");
}
