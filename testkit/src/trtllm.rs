//! Calls on the trtllm API (`trtllm.TrtllmService`, the mock engine's
//! default kind) as the suites make them: a client, a Generate request, and
//! what a whole Generate stream gave back.

use std::net::SocketAddr;

use llm_sidecar_engine_api::trtllm::generate_response::Response as GenResponse;
use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_engine_api::trtllm::{GenerateRequest, TokenizedInput};
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

use crate::raw_h2::{self, RawH2};

/// A client on a connection of its own to `addr`.
pub async fn client(addr: SocketAddr) -> TrtllmServiceClient<Channel> {
    TrtllmServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect")
}

/// A streaming Generate of `tokens` tokens for a prompt of `prompt` tokens.
pub fn generate(id: &str, prompt: u32, tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_string(),
        tokenized: Some(TokenizedInput {
            original_text: String::new(),
            input_token_ids: (0..prompt).map(|i| 10 + i).collect(),
        }),
        max_tokens: tokens,
        streaming: true,
    }
}

/// Streamed token ids, the final complete's ids, and how the stream ended.
#[derive(Debug, PartialEq)]
pub struct Outcome {
    /// The chunks' token ids, in order.
    pub streamed: Vec<u32>,
    /// The final message's token ids.
    pub complete: Vec<u32>,
    /// OK, or the status it ended with.
    pub end: Result<(), (Code, String)>,
}

/// One Generate on `c`, read to its end.
pub async fn run_generate(mut c: TrtllmServiceClient<Channel>, req: GenerateRequest) -> Outcome {
    let mut out = Outcome {
        streamed: vec![],
        complete: vec![],
        end: Ok(()),
    };
    let mut stream = match c.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => {
            out.end = Err((s.code(), s.message().to_string()));
            return out;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(m)) => match m.response {
                Some(GenResponse::Chunk(c)) => out.streamed.extend(c.token_ids),
                Some(GenResponse::Complete(c)) => out.complete = c.output_token_ids,
                None => {}
            },
            Ok(None) => return out,
            Err(s) => {
                out.end = Err((s.code(), s.message().to_string()));
                return out;
            }
        }
    }
}

/// One Generate of `tokens` tokens through `target`, on a connection of its
/// own, as the load generator sends it: the messages streamed (the tokens
/// and the final one).
pub async fn generate_through(
    target: SocketAddr,
    id: &str,
    tokens: u32,
) -> Result<usize, tonic::Status> {
    use tokio_stream::StreamExt;
    let channel = llm_sidecar_loadgen::connect(&target.to_string())
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut pieces = llm_sidecar_loadgen::generate::generate(
        llm_sidecar_io::engine::EngineKind::Trtllm,
        channel,
        id.to_string(),
        8,
        tokens,
    )
    .await?;
    let mut n = 0;
    while let Some(piece) = pieces.next().await {
        piece?;
        n += 1;
    }
    Ok(n)
}

/// One Generate of `tokens` through `target`, as [`generate_through`], given
/// up after 240 s: a hang guard only, for calls that stand beside an attack
/// (the attacks failed such calls with an error, never by slowing them; a
/// 4,000-token stream took over 60 s once in CI beside 4,096 stalled calls).
pub async fn generate_or_give_up(
    target: SocketAddr,
    id: &str,
    tokens: u32,
) -> Result<usize, (Code, String)> {
    const GIVE_UP: std::time::Duration = std::time::Duration::from_secs(240);
    tokio::time::timeout(GIVE_UP, generate_through(target, id, tokens))
        .await
        .map_err(|_| {
            (
                Code::DeadlineExceeded,
                format!("no end within {GIVE_UP:?} (test)"),
            )
        })?
        .map_err(|s| (s.code(), s.message().to_string()))
}

/// One raw connection from `source` to `listen` that sends its preface with
/// `settings`, then `calls` Generate calls of `tokens` tokens at once, call
/// `n` with the id `id(n)`; nothing is read.
pub fn raw_calls(
    listen: SocketAddr,
    source: std::net::IpAddr,
    settings: &[(u16, u32)],
    calls: u32,
    tokens: u32,
    id: impl Fn(u32) -> String,
) -> RawH2 {
    let block = raw_h2::grpc_headers_block(&listen.to_string(), "/trtllm.TrtllmService/Generate");
    let mut raw = RawH2::connect_from(source, listen);
    let mut out = raw_h2::preface(settings);
    for n in 0..calls {
        let message = generate(&id(n), 3, tokens).encode_to_vec();
        out.extend(raw_h2::call(1 + 2 * n, &block, &message));
    }
    raw.send(&out).expect("the calls");
    raw
}

/// Two connections (from 127.0.0.2 and 127.0.0.3) that set their stream
/// window to zero and never open it, each with `calls` Generate calls of
/// 100,000 tokens: no answer byte may be sent to them, so every one of their
/// answers waits in the sidecar.
pub fn zero_window_callers(listen: SocketAddr, calls: u32) -> Vec<RawH2> {
    (0..2u8)
        .map(|c| {
            // Each from an address of its own, so that both have a full
            // budget of engine streams; SETTINGS_INITIAL_WINDOW_SIZE 0.
            let source = std::net::IpAddr::from([127, 0, 0, 2 + c]);
            raw_calls(listen, source, &[(0x4, 0)], calls, 100_000, |n| {
                format!("stalled-{c}-{n}")
            })
        })
        .collect()
}
