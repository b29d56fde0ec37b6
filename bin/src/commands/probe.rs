//! `llm-sidecar probe`: one look at an engine or a running sidecar, for `exec`
//! probes and scripts. Exit 0 only when it serves.
//!
//! The exit codes follow grpc_health_probe's where they overlap (2 no
//! connection, 3 a call failed or timed out, 4 answered but not SERVING); its
//! 1 (bad arguments) is llm-sidecar's 2, as for every subcommand: in both
//! cases nothing answered.

use std::time::Duration;

use clap::Args;
use llm_sidecar_io::engine::check::{CheckError, Checked, check_engine, check_sidecar};
use llm_sidecar_io::parse_host_port;

use crate::shared::{EngineKindArg, Exit, duration};

/// Nothing accepted the connection (grpc_health_probe's 2).
pub const EXIT_NO_CONNECTION: Exit = Exit::Own(2);
/// A call failed or timed out, or the engine serves no API llm-sidecar
/// follows (grpc_health_probe's 3).
pub const EXIT_CALL_FAILED: Exit = Exit::Own(3);
/// It answered, but not SERVING (grpc_health_probe's 4).
pub const EXIT_NOT_SERVING: Exit = Exit::Own(4);

/// Flags of `llm-sidecar probe`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["engine", "sidecar"])))]
pub struct ProbeArgs {
    /// Look at the engine at this address (host:port): its kind found as
    /// `run` finds it, then its liveness service's grpc.health.v1 Check.
    #[arg(long, value_name = "HOST:PORT")]
    pub engine: Option<String>,
    /// Look at a running sidecar at this address (its --listen): its own
    /// grpc.health.v1, SERVING exactly while it serves.
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "engine")]
    pub sidecar: Option<String>,
    /// The engine's API (with --engine only); auto finds it with one call
    /// per kind. [default: auto]
    #[arg(long, value_enum)]
    pub engine_kind: Option<EngineKindArg>,
    /// Bound on the connect and on each call.
    #[arg(long, default_value = "1s", value_parser = duration)]
    pub timeout: Duration,
    /// Print nothing on success (failures still say why on stderr).
    #[arg(long, short)]
    pub quiet: bool,
}

/// `llm-sidecar probe`.
pub fn run(args: ProbeArgs) -> Exit {
    let (flag, address) = match (&args.engine, &args.sidecar) {
        (Some(a), _) => ("--engine", a.clone()),
        (None, Some(a)) => ("--sidecar", a.clone()),
        (None, None) => return Exit::Usage,
    };
    if let Err(e) = parse_host_port(flag, &address) {
        eprintln!("error: {e}");
        return Exit::Usage;
    }
    if args.sidecar.is_some() && args.engine_kind.is_some() {
        eprintln!(
            "error: --engine-kind goes with --engine; a sidecar is looked at through its own health service"
        );
        return Exit::Usage;
    }
    if args.timeout.is_zero() {
        eprintln!("error: --timeout must be more than 0");
        return Exit::Usage;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return Exit::Runtime;
        }
    };
    let what = if args.engine.is_some() {
        "engine"
    } else {
        "sidecar"
    };
    let looked = runtime.block_on(async {
        match &args.engine {
            Some(_) => {
                let kind = args.engine_kind.unwrap_or(EngineKindArg::Auto);
                check_engine(&address, kind.choice(), args.timeout).await
            }
            None => check_sidecar(&address, args.timeout).await,
        }
    });
    match looked {
        Ok(Checked::Serving { kind, service }) => {
            if !args.quiet {
                let kind = kind.map(|k| format!(" ({})", k.profile().name));
                let health = match service {
                    Some(s) if s.is_empty() => "grpc.health.v1 SERVING".to_string(),
                    Some(s) => format!("grpc.health.v1 \"{s}\" SERVING"),
                    None => "its API answers; it has no grpc.health.v1 service".to_string(),
                };
                outln!(
                    "serving: {what} at {address}{}: {health}",
                    kind.unwrap_or_default()
                );
            }
            Exit::SUCCESS
        }
        Ok(Checked::NotServing {
            kind,
            service,
            status,
        }) => {
            let kind = kind.map(|k| format!(" ({})", k.profile().name));
            eprintln!(
                "not serving: {what} at {address}{}: grpc.health.v1 \"{service}\" {status}",
                kind.unwrap_or_default()
            );
            EXIT_NOT_SERVING
        }
        Err(e @ CheckError::Connect(_)) => {
            eprintln!("no connection: {what} at {address}: {e}");
            EXIT_NO_CONNECTION
        }
        Err(e @ (CheckError::Call(_) | CheckError::NoneServed)) => {
            eprintln!("call failed: {what} at {address}: {e}");
            EXIT_CALL_FAILED
        }
    }
}
