//! `llm-sidecar bench`: load any address with Generate streams.

use std::time::Duration;

use clap::Args;
use llm_sidecar_io::parse_host_port;

use crate::runtime::runtime;
use crate::shared::{Exit, duration, engine_kind};

/// Flags of `llm-sidecar bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Address to load (host:port): the sidecar's --listen, or the engine directly.
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub target: String,
    /// Which engine API the target speaks: trtllm, openengine, vllm, sglang, vllm-native or sglang-native
    /// (each kind's own Generate).
    #[arg(long, default_value = "trtllm", value_parser = engine_kind)]
    pub kind: llm_sidecar_io::engine::EngineKind,
    /// Concurrent streams.
    #[arg(long, short = 'c', default_value_t = 16)]
    pub concurrency: usize,
    /// Tokens per call (max_tokens).
    #[arg(long, short = 'n', default_value_t = 256)]
    pub tokens: u32,
    /// How long to run (ignored if --calls is reached first).
    #[arg(long, short = 'd', default_value = "10s", value_parser = duration)]
    pub duration: Duration,
    /// Stop after this many calls in total.
    #[arg(long)]
    pub calls: Option<u64>,
    /// HTTP/2 connections to spread the streams over.
    #[arg(long, default_value_t = 1)]
    pub connections: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: u32,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `llm-sidecar bench`.
pub fn run(args: BenchArgs) -> Exit {
    if let Err(e) = parse_host_port("--target", &args.target) {
        eprintln!("error: {e}");
        return Exit::Usage;
    }
    let config = llm_sidecar_loadgen::BenchConfig {
        target: args.target,
        kind: args.kind,
        concurrency: args.concurrency.max(1),
        tokens: args.tokens,
        duration: Some(args.duration),
        calls: args.calls,
        connections: args.connections.max(1),
        prompt_tokens: args.prompt_tokens,
    };
    match runtime(None).block_on(llm_sidecar_loadgen::run(config)) {
        Ok(report) => {
            if args.json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&report).unwrap_or_default()
                );
            } else {
                out!("{report}");
            }
            if report.errors.is_empty() {
                Exit::SUCCESS
            } else {
                Exit::Own(1)
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            Exit::Own(1)
        }
    }
}
