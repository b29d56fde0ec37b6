//! `llm-sidecar-dynamo`: llm-sidecar as a drop-in Dynamo worker.
//!
//! Dynamo's side is Dynamo's own code: `dynamo-backend-common`'s `Worker`
//! writes the instance record and the model card and serves Dynamo's request
//! plane, on a `DistributedRuntime` this process owns, with a shutdown token
//! the core's decision cancels. llm-sidecar's side is the same core and IO
//! layer as `llm-sidecar run` with the OpenEngine profile: the start-up wait,
//! the liveness Watch, the stale `GetLoad`, the identity, keepalive, and the
//! lifecycle that withdraws, drains and exits. This crate holds only the glue:
//! the flags ([`args`]), the request translation ([`bridge`]), the engine's
//! KV capacity and load for Dynamo's router ([`load`]) and Dynamo's discovery
//! as the core's registry ([`registry`]).

mod answer;
mod args;
mod bridge;
#[cfg(test)]
mod conformance;
mod kube;
mod kv_events;
mod load;
mod own_channels;
mod registry;
mod request;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use dynamo_backend_common::WorkerConfig;
use dynamo_runtime::{DistributedRuntime, Runtime};
use llm_sidecar_io::process::{Exit, Throttle, init_logging_throttled, runtime, shutdown_signals};
use llm_sidecar_io::{Front, engine};

use crate::args::{Args, Settings};
use crate::kube::{Mode, OwnObject};
use crate::registry::{DynamoRegistry, ReadBack};

/// After the last request ended, how long Dynamo's response plane has to
/// send what the bridge yielded last before the process goes. The bridge
/// holds each request's admission until its stream was read to the end, so
/// what is left is the end-of-stream frame.
const RESPONSE_FLUSH: Duration = Duration::from_millis(100);

fn main() {
    std::process::exit(i32::from(run().code()));
}

fn run() -> Exit {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let code = if e.use_stderr() {
                Exit::Usage
            } else {
                Exit::SUCCESS
            };
            let _ = e.print();
            return code;
        }
    };
    let settings = match args.into_settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::Usage;
        }
    };
    let accept_failures = Throttle::new(ACCEPT_TARGET, ACCEPT_FAILED, ACCEPT_LOG_EVERY);
    init_logging_throttled(settings.json_logs, vec![accept_failures.clone()]);
    if let Some(limit) = llm_sidecar_io::net::raise_open_file_limit() {
        tracing::debug!("open-file limit {limit}");
    }
    runtime(Some(settings.worker_threads)).block_on(serve(settings, accept_failures))
}

/// Where Dynamo 1.6.1's request-plane server says an accept failed, and how
/// it says it. It retries at once, so with its file descriptors used up it
/// writes the line as fast as the CPU allows (0.9 GB of log in 15 s).
const ACCEPT_TARGET: &str = "dynamo_runtime::pipeline::network::ingress::shared_tcp_endpoint";
const ACCEPT_FAILED: &str = "Failed to accept TCP connection";

/// At most one such line per this long; `/metrics` counts them all.
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

/// The worker's settings for Dynamo, from Dynamo's own flags.
fn worker_config(s: &Settings) -> WorkerConfig {
    let c = &s.common;
    WorkerConfig {
        namespace: c.namespace.clone(),
        component: c.component.clone(),
        endpoint: c.endpoint.clone(),
        model_name: s.model_path.clone(),
        endpoint_types: c.endpoint_types.clone(),
        custom_jinja_template: c.custom_jinja_template.clone(),
        tool_call_parser: c.dyn_tool_call_parser.clone(),
        reasoning_parser: c.dyn_reasoning_parser.clone(),
        exclude_tools_when_tool_choice_none: c.exclude_tools_when_tool_choice_none,
        disaggregation_mode: c.disaggregation_mode,
        runtime: c.runtime.clone(),
        default_thinking_mode: s.default_thinking_mode.clone(),
        ..WorkerConfig::default()
    }
}

async fn serve(settings: Settings, accept_failures: Throttle) -> Exit {
    let timings = settings.run.timings.clone();
    let channel_settings = timings.engine_channel();
    let channels: Result<Vec<_>, _> = (0..settings.run.limits.engine_connections.unwrap_or(1))
        .map(|_| {
            engine::endpoint(&settings.run.engine_endpoint, channel_settings)
                .map(|e| e.connect_lazy())
        })
        .collect();
    let channels = match channels {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("--grpc-endpoint {}: {e}", settings.run.engine_endpoint);
            return Exit::Usage;
        }
    };
    let deadline = tokio::time::Instant::now() + timings.startup_deadline;
    let read_back = match &settings.kube {
        None => ReadBack::Listing,
        Some(pod) => match connect_kube(pod.clone(), &settings, deadline).await {
            Some(object) => ReadBack::OwnObject(Box::new(object)),
            None => return Exit::STARTUP_FAILED,
        },
    };
    let Some(drt) = connect_dynamo(&settings, deadline).await else {
        return Exit::STARTUP_FAILED;
    };
    let registry = Arc::new(DynamoRegistry::new(
        drt.clone(),
        read_back,
        worker_config(&settings),
        settings.context_length,
        channels,
    ));
    let front = Front::Hosted {
        instance_id: drt.connection_id(),
    };
    let started = match llm_sidecar_io::start(
        settings.run,
        registry.clone(),
        front,
        shutdown_signals(),
    )
    .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("{e}");
            return Exit::Usage;
        }
    };
    let calls = started.calls();
    calls.expose_counter(
        "llm_sidecar_dynamo_accept_failures",
        "Connections Dynamo's request-plane server failed to accept (out of file descriptors, \
         most often); its log line is written at most once every 10 s.",
        accept_failures.count.clone(),
    );
    registry.set_calls(calls);
    let reason = started.drive().await;
    tokio::time::sleep(RESPONSE_FLUSH).await;
    // Dynamo's teardown: stop its request plane, delete what this process
    // still owns in discovery (nothing, after a confirmed withdrawal).
    drt.shutdown();
    reason.into()
}

/// Runs `attempt` every retry interval, each bounded by the connect-attempt
/// timeout, until it succeeds or the start-up deadline passes (`None`, with
/// an ERROR line). Each failure is one WARN: "`what` is not usable yet".
async fn retry_until_deadline<T, F, Fut>(
    settings: &Settings,
    deadline: tokio::time::Instant,
    what: &str,
    mut attempt: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let timings = &settings.run.timings;
    loop {
        let why = match tokio::time::timeout(timings.connect_attempt_timeout, attempt()).await {
            Ok(Ok(done)) => return Some(done),
            Ok(Err(e)) => e,
            Err(_) => "no answer within the connect-attempt timeout".to_string(),
        };
        if tokio::time::Instant::now() + timings.retry_interval >= deadline {
            tracing::error!(
                "start-up deadline passed: {what} ({}) never became usable: {why}",
                settings.run.discovery
            );
            return None;
        }
        tracing::warn!(
            "{what} ({}) is not usable yet, retrying: {why}",
            settings.run.discovery
        );
        tokio::time::sleep(timings.retry_interval).await;
    }
}

/// The Kubernetes API server, before Dynamo's runtime uses it: answers, lets
/// this pod's ServiceAccount list `DynamoWorkerMetadata` objects, knows the
/// CRD; in container mode, an earlier incarnation's object removed (Dynamo's
/// runtime panics if that fails). Retried until the start-up deadline.
async fn connect_kube(
    pod: kube::PodIdentity,
    settings: &Settings,
    deadline: tokio::time::Instant,
) -> Option<OwnObject> {
    let object = match OwnObject::new(pod).await {
        Ok(o) => o,
        Err(e) => {
            tracing::error!("Dynamo's kubernetes discovery: {e}");
            return None;
        }
    };
    let check = || async {
        object.check().await.map_err(|e| e.to_string())?;
        if object.identity().mode == Mode::Container {
            object.remove_stale().await.map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    retry_until_deadline(settings, deadline, "Dynamo's kubernetes discovery", check).await?;
    Some(object)
}

/// Dynamo's runtime on this process's tokio runtime, connected to its
/// discovery; retried until the start-up deadline (an etcd that is not up
/// yet).
async fn connect_dynamo(
    settings: &Settings,
    deadline: tokio::time::Instant,
) -> Option<DistributedRuntime> {
    let runtime = match Runtime::from_current() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("cannot start Dynamo's runtime: {e:#}");
            return None;
        }
    };
    // Settings were checked with the flags; a config is built per attempt
    // (Dynamo's is not Clone).
    let connect = || async {
        let config = settings
            .common
            .runtime
            .to_distributed_config()
            .map_err(|e| format!("Dynamo runtime settings: {e:#}"))?;
        DistributedRuntime::new(runtime.clone(), config)
            .await
            .map_err(|e| format!("{e:#}"))
    };
    retry_until_deadline(settings, deadline, "Dynamo's discovery", connect).await
}
