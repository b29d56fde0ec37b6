//! One Generate, whatever the API: deterministic tokens at the configured
//! pace, the engine's side of the call account (counters, seen and cancelled
//! ids, the journal), and the test hooks carried in the request id
//! (`error:<code>:<message>`, `big-headers:<bytes>`). Each kind's service only
//! translates its request and its messages.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Response, Status};

use crate::{Fault, FaultAction, State, lock};

/// What one Generate asks for, in any API.
pub(crate) struct Ask {
    pub(crate) request_id: String,
    pub(crate) prompt: Vec<u32>,
    pub(crate) max_tokens: u32,
    pub(crate) streaming: bool,
}

/// The `i`-th token of a request: deterministic, so direct and proxied runs compare.
pub(crate) fn token(seed: u64, i: u32) -> u32 {
    ((seed
        .wrapping_mul(2_654_435_761)
        .wrapping_add(u64::from(i) * 7_919))
        % 32_000) as u32
}

fn seed_of(ask: &Ask, by_prompt: bool) -> u64 {
    let mut seed: u64 = 17;
    let id = if by_prompt {
        ""
    } else {
        ask.request_id.as_str()
    };
    for b in id.bytes() {
        seed = seed.wrapping_mul(31).wrapping_add(u64::from(b));
    }
    for id in &ask.prompt {
        seed = seed.wrapping_mul(31).wrapping_add(u64::from(*id));
    }
    seed
}

/// `error:<code>:<message>` as a request id makes Generate fail with that status
/// and an `x-engine-error` trailer, so tests can check that errors pass unchanged.
fn requested_error(request_id: &str) -> Option<Status> {
    let rest = request_id.strip_prefix("error:")?;
    let (code, message) = rest.split_once(':').unwrap_or((rest, ""));
    let code = tonic::Code::from_i32(code.parse().unwrap_or(13));
    let mut status = Status::new(code, message.to_string());
    if let Ok(v) = MetadataValue::try_from(format!("mock-{request_id}")) {
        status.metadata_mut().insert("x-engine-error", v);
    }
    Some(status)
}

/// `big-headers:<bytes>` as a request id makes Generate answer with response
/// headers of about that size (one `x-big` header) before its tokens.
fn requested_header_bytes(request_id: &str) -> Option<usize> {
    request_id.strip_prefix("big-headers:")?.parse().ok()
}

/// Starts one Generate: `chunk(token, i, prompt_len)` builds each streamed
/// message, `complete(tokens, prompt_len)` the last one.
pub(crate) fn start<M: Send + 'static>(
    state: Arc<State>,
    ask: Ask,
    chunk: impl Fn(u32, u32, u32) -> M + Send + 'static,
    complete: impl Fn(Vec<u32>, u32) -> M + Send + 'static,
) -> Result<Response<ReceiverStream<Result<M, Status>>>, Status> {
    state
        .counters
        .generate_started
        .fetch_add(1, Ordering::Relaxed);
    lock(&state.seen_ids).push(ask.request_id.clone());
    state.journal("seen", &ask.request_id);
    if let Some(status) = requested_error(&ask.request_id) {
        state.journal("error", &ask.request_id);
        return Err(status);
    }
    let big_headers = requested_header_bytes(&ask.request_id);
    let fault = take_fault(&state, ask.prompt.len());
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let (delay, end_delay) = (state.config.token_delay, state.config.end_delay);
    let by_prompt = state.config.seed_by_prompt;
    tokio::spawn(async move {
        let seed = seed_of(&ask, by_prompt);
        let prompt = ask.prompt.len() as u32;
        let id = ask.request_id.clone();
        let mut all = Vec::with_capacity(ask.max_tokens as usize);
        let cancelled = |state: &State, id: &str| {
            state
                .counters
                .generate_cancelled
                .fetch_add(1, Ordering::Relaxed);
            lock(&state.cancelled_ids).push(id.to_string());
            state.journal("cancelled", id);
        };
        for i in 0..=ask.max_tokens {
            if let Some(Fault { at, action, .. }) = &fault
                && *at == i
                && strike(&state, &tx, action, &id).await
            {
                return;
            }
            if i == ask.max_tokens {
                break;
            }
            if !delay.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = tx.closed() => return cancelled(&state, &id),
                    () = state.cancel_calls.cancelled() => {
                        state.journal("aborted", &id);
                        let _ = tx.send(Err(Status::unavailable("Cancelling all calls"))).await;
                        return;
                    }
                }
            }
            let t = token(seed, i);
            all.push(t);
            if ask.streaming && tx.send(Ok(chunk(t, i, prompt))).await.is_err() {
                return cancelled(&state, &id);
            }
        }
        let last = all.last().copied();
        if tx.send(Ok(complete(all, prompt))).await.is_err() {
            return cancelled(&state, &id);
        }
        if let (
            Some(Fault {
                action: FaultAction::Replay,
                ..
            }),
            Some(t),
        ) = (&fault, last)
        {
            state.journal("replay", &id);
            let _ = tx.send(Ok(chunk(t, ask.max_tokens - 1, prompt))).await;
        }
        // The stream ends a moment after its final message, as a real
        // engine's does; a client that resets it in between cancels a
        // generation that had finished.
        if !end_delay.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(end_delay) => {}
                () = tx.closed() => return cancelled(&state, &id),
            }
        }
        state.journal("done", &id);
        state
            .counters
            .generate_completed
            .fetch_add(1, Ordering::Relaxed);
    });
    let mut response = Response::new(ReceiverStream::new(rx));
    if let Some(bytes) = big_headers
        && let Ok(value) = MetadataValue::try_from("a".repeat(bytes))
    {
        response.metadata_mut().insert("x-big", value);
    }
    Ok(response)
}

/// The planted fault, if it is for a Generate with this prompt.
pub(crate) fn take_fault(state: &State, prompt_len: usize) -> Option<Fault> {
    let mut fault = lock(&state.fault);
    if fault.as_ref().is_some_and(|f| f.applies_to(prompt_len)) {
        fault.take()
    } else {
        None
    }
}

/// Carries out a planted fault where its message would go; whether the
/// stream is over. A malformed message is the kind's to build (its
/// `chunk` and `complete` see the fault), and a replay comes after the end.
async fn strike<M>(
    state: &State,
    tx: &tokio::sync::mpsc::Sender<Result<M, Status>>,
    action: &FaultAction,
    id: &str,
) -> bool {
    match action {
        FaultAction::Cut { code, message } => {
            state.journal("cut", id);
            let status = Status::new(tonic::Code::from_i32(*code), message.clone());
            let _ = tx.send(Err(status)).await;
            true
        }
        FaultAction::Exit => {
            state.journal("exit", id);
            // The tokens before are in the channel: give them time to reach
            // the wire, as a process killed between two tokens has sent them.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            std::process::exit(137);
        }
        FaultAction::Malformed | FaultAction::Replay => false,
    }
}
