//! `llm-sidecar bench`: N concurrent Generate streams of M tokens, in any
//! engine kind's API, against any address that speaks it (the engine itself,
//! the sidecar, another proxy), for a duration or a number of calls. Reports
//! calls/s, tokens/s, time to first token and inter-token latency
//! percentiles, and errors by code.

#![warn(missing_docs, unreachable_pub)]

pub mod generate;
pub mod local;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use llm_sidecar_io::engine::EngineKind;
use serde::Serialize;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// `host:port` to call.
    pub target: String,
    /// Which API the target speaks.
    pub kind: EngineKind,
    /// Concurrent streams.
    pub concurrency: usize,
    /// Tokens per call (`max_tokens`).
    pub tokens: u32,
    /// Stop after this long (unless `calls` is reached first).
    pub duration: Option<Duration>,
    /// Stop after this many calls in total.
    pub calls: Option<u64>,
    /// HTTP/2 connections to spread the streams over.
    pub connections: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
}

/// Latency summary in microseconds.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Percentiles {
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Samples.
    pub samples: usize,
}

fn percentiles(mut v: Vec<u32>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_unstable();
    let at = |p: f64| u64::from(v[((v.len() - 1) as f64 * p).round() as usize]);
    Percentiles {
        p50_us: at(0.50),
        p99_us: at(0.99),
        samples: v.len(),
    }
}

/// The outcome of a run.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Where the load went.
    pub target: String,
    /// Concurrent streams.
    pub concurrency: usize,
    /// Tokens per call.
    pub tokens_per_call: u32,
    /// Wall time of the run, seconds.
    pub elapsed_s: f64,
    /// Calls that completed with OK.
    pub calls_ok: u64,
    /// Completed calls per second.
    pub calls_per_s: f64,
    /// Streamed tokens per second (all calls).
    pub tokens_per_s: f64,
    /// Time to first token.
    pub ttft: Percentiles,
    /// Inter-token latency.
    pub itl: Percentiles,
    /// Failed calls by gRPC status code name.
    pub errors: BTreeMap<String, u64>,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "target {}  concurrency {}  tokens/call {}  {:.2}s",
            self.target, self.concurrency, self.tokens_per_call, self.elapsed_s
        )?;
        writeln!(
            f,
            "calls ok      {} ({:.1}/s)",
            self.calls_ok, self.calls_per_s
        )?;
        writeln!(f, "tokens/s      {:.0}", self.tokens_per_s)?;
        writeln!(
            f,
            "TTFT          p50 {}us  p99 {}us",
            self.ttft.p50_us, self.ttft.p99_us
        )?;
        writeln!(
            f,
            "inter-token   p50 {}us  p99 {}us  ({} samples)",
            self.itl.p50_us, self.itl.p99_us, self.itl.samples
        )?;
        if self.errors.is_empty() {
            writeln!(f, "errors        none")
        } else {
            writeln!(f, "errors        {:?}", self.errors)
        }
    }
}

/// Why a run could not start.
#[derive(Debug)]
pub struct BenchError(pub String);

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BenchError {}

#[derive(Default)]
struct WorkerStats {
    ok: u64,
    tokens: u64,
    ttft: Vec<u32>,
    itl: Vec<u32>,
    errors: BTreeMap<String, u64>,
}

/// Connects to `target` (one HTTP/2 connection, no Nagle).
pub async fn connect(target: &str) -> Result<Channel, BenchError> {
    Endpoint::from_shared(format!("http://{target}"))
        .map_err(|e| BenchError(format!("{target}: {e}")))?
        .tcp_nodelay(true)
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(8 << 20)
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| BenchError(format!("cannot connect to {target}: {e}")))
}

/// Runs the benchmark.
pub async fn run(config: BenchConfig) -> Result<BenchReport, BenchError> {
    let mut channels = Vec::new();
    for _ in 0..config.connections.max(1) {
        channels.push(connect(&config.target).await?);
    }
    let issued = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let start = Instant::now();
    let stop_at = config.duration.map(|d| start + d);
    let mut workers = Vec::new();
    for w in 0..config.concurrency.max(1) {
        let channel = channels[w % channels.len()].clone();
        let config = config.clone();
        let issued = issued.clone();
        workers.push(tokio::spawn(async move {
            let mut stats = WorkerStats::default();
            loop {
                if stop_at.is_some_and(|t| Instant::now() >= t) {
                    break;
                }
                let n = issued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if config.calls.is_some_and(|max| n >= max) {
                    break;
                }
                let sent = Instant::now();
                let outcome = async {
                    let mut stream = generate::generate(
                        config.kind,
                        channel.clone(),
                        format!("bench-{w}-{n}"),
                        config.prompt_tokens,
                        config.tokens,
                    )
                    .await?;
                    let mut last = sent;
                    let mut first = true;
                    let mut tokens = 0u64;
                    while let Some(piece) = stream.next().await {
                        if let generate::Piece::Tokens(chunk) = piece? {
                            let now = Instant::now();
                            let gap = now
                                .duration_since(last)
                                .as_micros()
                                .min(u128::from(u32::MAX))
                                as u32;
                            if first {
                                stats.ttft.push(gap);
                                first = false;
                            } else {
                                stats.itl.push(gap);
                            }
                            last = now;
                            tokens += chunk.len() as u64;
                        }
                    }
                    Ok::<u64, tonic::Status>(tokens)
                }
                .await;
                match outcome {
                    Ok(tokens) => {
                        stats.ok += 1;
                        stats.tokens += tokens;
                    }
                    Err(status) => {
                        *stats
                            .errors
                            .entry(format!("{:?}", status.code()))
                            .or_default() += 1;
                    }
                }
            }
            stats
        }));
    }
    let mut total = WorkerStats::default();
    for w in workers {
        let s = w
            .await
            .map_err(|e| BenchError(format!("worker failed: {e}")))?;
        total.ok += s.ok;
        total.tokens += s.tokens;
        total.ttft.extend(s.ttft);
        total.itl.extend(s.itl);
        for (k, v) in s.errors {
            *total.errors.entry(k).or_default() += v;
        }
    }
    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    Ok(BenchReport {
        target: config.target,
        concurrency: config.concurrency,
        tokens_per_call: config.tokens,
        elapsed_s: elapsed,
        calls_ok: total.ok,
        calls_per_s: total.ok as f64 / elapsed,
        tokens_per_s: total.tokens as f64 / elapsed,
        ttft: percentiles(total.ttft),
        itl: percentiles(total.itl),
        errors: total.errors,
    })
}
