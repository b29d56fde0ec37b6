//! SGLang's native gRPC server (`sglang.runtime.v1.SglangService`, v0.5.16 and
//! later). Its info RPCs answer JSON documents: `GetModelInfo` the model path,
//! `GetServerInfo` the served name and the context length (SGLang 0.5.23's
//! document has no `version`: its HTTP `/server_info` adds one, its gRPC
//! server does not, so the version is "unknown" unless a server sends it).
//!
//! It serves no grpc.health.v1: its health is `HealthCheck` and the server
//! stream `WatchEngineState` (the current state, then one message per change:
//! `healthy`, `is_pause`, the per-process `instance_id`). That stream is what
//! is followed ([`follow_state`]); its `instance_id` is the identity. A server
//! without the stream has its `HealthCheck` polled and its connection stands
//! for its identity; one without either is followed by its connection alone.
//! `GetLoad` answering at all is the fresh-load signal.

use std::time::Duration;

use llm_sidecar_core::{EngineEvent, Event, HumanDuration, LivenessObservation};
use llm_sidecar_engine_api::sglang_runtime::sglang_service_client::SglangServiceClient;
use llm_sidecar_engine_api::sglang_runtime::{
    EngineState, GetLoadRequest, GetModelInfoRequest, GetServerInfoRequest, HealthCheckRequest,
    WatchEngineStateRequest,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

use super::monitors::{open_stream, poll, watch_connection};
use super::{
    ConnectionWatch, EngineError, EngineInfo, EngineKind, Probed, UNKNOWN_VERSION, bounded,
};
use crate::discovery::ModelRecord;

/// A JSON document the server sent, as an object; anything else reads as empty
/// (every field the sidecar takes from it has a fallback).
fn document(text: &str) -> serde_json::Map<String, Value> {
    match serde_json::from_str(text) {
        Ok(Value::Object(map)) => map,
        Ok(_) | Err(_) => serde_json::Map::new(),
    }
}

fn text(doc: &serde_json::Map<String, Value>, key: &str) -> Option<String> {
    doc.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A count, given as a number or as a string of one.
fn count(doc: &serde_json::Map<String, Value>, key: &str) -> Option<i64> {
    doc.get(key).and_then(|v| {
        v.as_i64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .filter(|n| *n > 0)
    })
}

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = SglangServiceClient::new(channel.clone());
    let model = bounded(
        "GetModelInfo",
        bound,
        client.get_model_info(GetModelInfoRequest {}),
    )
    .await?;
    let server = bounded(
        "GetServerInfo",
        bound,
        client.get_server_info(GetServerInfoRequest {}),
    )
    .await?;
    let model_doc = document(&model.json_info);
    let server_doc = document(&server.json_info);
    let path = if model.model_path.is_empty() {
        text(&model_doc, "model_path").unwrap_or_default()
    } else {
        model.model_path
    };
    let name = text(&server_doc, "served_model_name").unwrap_or(path);
    let context = count(&server_doc, "context_length").unwrap_or(0);
    let max_input = count(&server_doc, "max_req_input_len").unwrap_or(context);
    let version = text(&server_doc, "version").unwrap_or_else(|| UNKNOWN_VERSION.to_string());
    let mut unserved = Vec::new();
    let instance_id = super::optional(first_state(channel, bound).await, &mut unserved)?
        .map(|state| state.instance_id.to_string());
    Ok(EngineInfo {
        kind: EngineKind::SglangNative,
        display_name: EngineKind::SglangNative.profile().display_name.to_string(),
        identity: instance_id
            .clone()
            .unwrap_or_else(|| format!("sglang {version} model={name} context_length={context}")),
        version,
        instance_id,
        unserved,
        model: ModelRecord {
            name,
            max_input_len: max_input,
            max_seq_len: context,
            // The scheduler's info, merged into the server's document.
            kv_cache_tokens: count(&server_doc, "max_total_num_tokens"),
        },
    })
}

/// `GetLoad` answering is fresh; there is no identity to re-read.
pub(super) async fn probe(channel: &Channel, bound: Duration) -> Probed {
    let mut client = SglangServiceClient::new(channel.clone());
    let fresh = bounded(
        "GetLoad",
        bound,
        client.get_load(GetLoadRequest { dp_rank: None }),
    )
    .await
    .map(|_| ());
    Probed {
        fresh,
        identity: None,
    }
}

/// The first message of `WatchEngineState`: the state now.
async fn first_state(channel: &Channel, bound: Duration) -> Result<EngineState, EngineError> {
    const CALL: &str = "WatchEngineState";
    let mut client = SglangServiceClient::new(channel.clone());
    let first = open_stream(client.watch_engine_state(WatchEngineStateRequest {}));
    match tokio::time::timeout(bound, first).await {
        Ok(Ok((_, Ok(Some(state))))) => Ok(state),
        Ok(Ok((_, Ok(None)))) => Err(EngineError::Call {
            call: CALL,
            code: tonic::Code::Unavailable,
            message: "the stream ended before its first message".into(),
        }),
        Ok(Err(status) | Ok((_, Err(status)))) => Err(EngineError::Call {
            call: CALL,
            code: status.code(),
            message: status.message().to_string(),
        }),
        Err(_) => Err(EngineError::Timeout {
            call: CALL,
            after: HumanDuration(bound).to_string(),
        }),
    }
}

/// Whether the server says it is healthy now (`HealthCheck`): start-up waits
/// for it, as SGLang answers unhealthy through its warm-up.
pub(super) async fn healthy(channel: &Channel, bound: Duration) -> Result<bool, EngineError> {
    let mut client = SglangServiceClient::new(channel.clone());
    bounded(
        "HealthCheck",
        bound,
        client.health_check(HealthCheckRequest {}),
    )
    .await
    .map(|answer| answer.healthy)
}

/// `healthy` as the core reads liveness: SERVING or NOT_SERVING.
fn serving_status(healthy: bool) -> i32 {
    if healthy {
        ServingStatus::Serving as i32
    } else {
        ServingStatus::NotServing as i32
    }
}

/// Where the followed state stands, for the lines said on a change.
struct Seen {
    healthy: Option<bool>,
    paused: bool,
}

impl Seen {
    /// Says what one message changed, and hands the core its observations:
    /// health as liveness, the instance id as the identity now answering. A
    /// pause is an operator's action (PauseGeneration), not a failure: it is
    /// said, and the worker stays registered (calls wait for
    /// ContinueGeneration, as they would behind any router).
    fn observe(&mut self, state: &EngineState) -> [Event; 2] {
        if self.healthy == Some(true) && !state.healthy {
            tracing::info!(
                revision = state.revision,
                "the SGLang engine reports itself unhealthy (WatchEngineState)"
            );
        }
        self.healthy = Some(state.healthy);
        if state.is_pause != self.paused {
            self.paused = state.is_pause;
            if state.is_pause {
                tracing::warn!(
                    revision = state.revision,
                    "the SGLang engine's generation is paused (PauseGeneration): calls wait \
                     until it continues; the worker stays registered"
                );
            } else {
                tracing::info!(
                    revision = state.revision,
                    "the SGLang engine's generation continues"
                );
            }
        }
        [
            Event::Engine(EngineEvent::Liveness(LivenessObservation::Status(
                serving_status(state.healthy),
            ))),
            Event::Engine(EngineEvent::IdentityObserved {
                identity: state.instance_id.to_string(),
            }),
        ]
    }
}

/// Follows the server's liveness until it is lost or `cancel` fires:
/// `WatchEngineState` where it is served (healthy to unhealthy, the stream's
/// end and its failure are the core's to judge, as a Watch's are); else
/// `HealthCheck` every `every` and the connection; else the connection alone.
pub(crate) async fn follow_state(
    channel: Channel,
    every: Duration,
    bound: Duration,
    connection: ConnectionWatch,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    let mut client = SglangServiceClient::new(channel.clone());
    let open = open_stream(client.watch_engine_state(WatchEngineStateRequest {}));
    let opened = tokio::select! {
        () = cancel.cancelled() => return,
        opened = tokio::time::timeout(bound, open) => opened,
    };
    let send = |event: Event| {
        let events = events.clone();
        async move { events.send(event).await.is_ok() }
    };
    let mut seen = Seen {
        healthy: None,
        paused: false,
    };
    let (mut stream, first) = match opened {
        Err(_) => {
            send(Event::Engine(EngineEvent::Liveness(
                LivenessObservation::NotOpened { waited: bound },
            )))
            .await;
            return;
        }
        Ok(Err(status))
            if matches!(
                status.code(),
                tonic::Code::Unimplemented | tonic::Code::NotFound
            ) =>
        {
            return poll_health_check(channel, every, bound, connection, events, cancel).await;
        }
        Ok(Err(status)) => {
            send(Event::Engine(EngineEvent::Liveness(
                super::monitors::observe_status(&status),
            )))
            .await;
            return;
        }
        Ok(Ok(opened)) => opened,
    };
    let mut next = first;
    loop {
        match next {
            Ok(Some(state)) => {
                for event in seen.observe(&state) {
                    if !send(event).await {
                        return;
                    }
                }
            }
            Ok(None) => {
                send(Event::Engine(EngineEvent::Liveness(
                    LivenessObservation::StreamEnded,
                )))
                .await;
                return;
            }
            Err(status) => {
                send(Event::Engine(EngineEvent::Liveness(
                    super::monitors::observe_status(&status),
                )))
                .await;
                return;
            }
        }
        next = tokio::select! {
            () = cancel.cancelled() => return,
            next = stream.message() => next,
        };
    }
}

/// A server without `WatchEngineState`: its `HealthCheck` polled as a
/// grpc.health.v1 Check is ([`poll`]: healthy is SERVING; UNIMPLEMENTED on
/// the first poll is the core's "engine without the service", one WARN) and
/// its connection followed, which stands for its identity.
async fn poll_health_check(
    channel: Channel,
    every: Duration,
    bound: Duration,
    connection: ConnectionWatch,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    tracing::info!(
        "the SGLang server does not serve WatchEngineState (older than 0.5.23): its \
         HealthCheck is polled every {} and its connection followed",
        HumanDuration(every)
    );
    tokio::spawn(watch_connection(connection, events.clone(), cancel.clone()));
    let client = SglangServiceClient::new(channel);
    let check = move || {
        let mut client = client.clone();
        async move {
            client
                .health_check(HealthCheckRequest {})
                .await
                .map(|answer| serving_status(answer.into_inner().healthy))
        }
    };
    poll(check, every, bound, events, cancel).await;
}
