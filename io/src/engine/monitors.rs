//! The engine monitors started in Serving: the liveness Watch (or, for kinds
//! whose Watch ends after one message, a polled Check), the probe that checks
//! load freshness and re-reads the identity, and for kinds without an identity
//! the watch on their connection. Each reports raw observations; the core
//! decides what they mean.

use std::time::Duration;

use llm_sidecar_core::{EngineEvent, Event, LivenessObservation};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use tonic_health::pb::health_check_response::ServingStatus;

use super::{ConnectionWatch, EngineError, EngineKind, probe as probe_once};

/// A stream that ended without trailers surfaces in tonic ≥ 0.14.6 as Unknown
/// "missing grpc-status trailer": that is a stream end, not a failure.
pub(super) fn observe_status(status: &tonic::Status) -> LivenessObservation {
    if status.code() == tonic::Code::Unknown && status.message().contains("missing grpc-status") {
        LivenessObservation::StreamEnded
    } else {
        LivenessObservation::StreamFailed {
            code: status.code() as i32,
            message: status.message().to_string(),
        }
    }
}

/// Opens a server stream and reads its first message: what a liveness stream
/// says first is its answer to "are you there", bounded by the caller.
pub(super) async fn open_stream<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>>,
) -> Result<(tonic::Streaming<T>, Result<Option<T>, tonic::Status>), tonic::Status> {
    let mut stream = call.await?.into_inner();
    let first = stream.message().await;
    Ok((stream, first))
}

/// Watches `service` until the stream ends, fails, or `cancel` fires.
///
/// An engine without the service (UNIMPLEMENTED or NOT_FOUND before any
/// message: an older image) gives nothing to watch; `connection`, when
/// given, is then followed instead, so that the engine's process going away
/// is a loss within the keepalive bound rather than at the stale-load window.
pub(crate) async fn watch_liveness(
    channel: Channel,
    service: String,
    first_message_within: Duration,
    connection: Option<ConnectionWatch>,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    let send = |o: LivenessObservation| {
        let events = events.clone();
        async move {
            let _ = events.send(Event::Engine(EngineEvent::Liveness(o))).await;
        }
    };
    let mut client = HealthClient::new(channel);
    let open = open_stream(client.watch(HealthCheckRequest { service }));
    let opened = tokio::select! {
        () = cancel.cancelled() => return,
        opened = tokio::time::timeout(first_message_within, open) => opened,
    };
    let mut stream = match opened {
        Err(_) => {
            return send(LivenessObservation::NotOpened {
                waited: first_message_within,
            })
            .await;
        }
        Ok(Err(status)) => {
            send(observe_status(&status)).await;
            let unsupported = matches!(
                status.code(),
                tonic::Code::Unimplemented | tonic::Code::NotFound
            );
            if let Some(connection) = connection.filter(|_| unsupported) {
                tracing::info!(
                    "without a liveness service, the engine's connection is followed instead: \
                     its closing is an engine loss"
                );
                watch_connection(connection, events.clone(), cancel).await;
            }
            return;
        }
        Ok(Ok((stream, first))) => match first {
            Ok(Some(message)) => {
                send(LivenessObservation::Status(message.status)).await;
                stream
            }
            Ok(None) => return send(LivenessObservation::StreamEnded).await,
            Err(status) => return send(observe_status(&status)).await,
        },
    };
    loop {
        let next = tokio::select! {
            () = cancel.cancelled() => return,
            next = stream.message() => next,
        };
        match next {
            Ok(Some(message)) => send(LivenessObservation::Status(message.status)).await,
            Ok(None) => return send(LivenessObservation::StreamEnded).await,
            Err(status) => return send(observe_status(&status)).await,
        }
    }
}

/// Polls `Check` on `service` every `every` until it fails or `cancel` fires
/// ([`poll`]).
pub(crate) async fn poll_health(
    channel: Channel,
    service: String,
    every: Duration,
    bound: Duration,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    let client = HealthClient::new(channel);
    let check = move || {
        let mut client = client.clone();
        let service = service.clone();
        async move {
            client
                .check(HealthCheckRequest { service })
                .await
                .map(|answer| answer.into_inner().status)
        }
    };
    poll(check, every, bound, events, cancel).await;
}

/// Asks `check` for the engine's raw serving status every `every` until it
/// fails or `cancel` fires: the first answer and every change are reported; a
/// failure (or no answer within `bound`) is reported once and ends the poll.
pub(super) async fn poll<F, Fut>(
    mut check: F,
    every: Duration,
    bound: Duration,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<i32, tonic::Status>>,
{
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<i32> = None;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let answer = tokio::select! {
            () = cancel.cancelled() => return,
            answer = tokio::time::timeout(bound, check()) => answer,
        };
        let observation = match answer {
            Ok(Ok(status)) => {
                if last == Some(status) {
                    continue;
                }
                last = Some(status);
                LivenessObservation::Status(status)
            }
            Ok(Err(status)) => LivenessObservation::CheckFailed {
                code: status.code() as i32,
                message: status.message().to_string(),
            },
            Err(_) => LivenessObservation::CheckFailed {
                code: tonic::Code::DeadlineExceeded as i32,
                message: format!(
                    "no answer within {}",
                    llm_sidecar_core::HumanDuration(bound)
                ),
            },
        };
        let keeps_going = matches!(
            observation,
            LivenessObservation::Status(s)
                if s == ServingStatus::Serving as i32 || s == ServingStatus::ServiceUnknown as i32
        );
        let ended = !keeps_going;
        if events
            .send(Event::Engine(EngineEvent::Liveness(observation)))
            .await
            .is_err()
            || ended
        {
            // After a failure or a departure from SERVING the core has its
            // answer; polling on would only repeat it.
            return;
        }
    }
}

/// Reports the monitors' connection ending, once.
pub(crate) async fn watch_connection(
    connection: ConnectionWatch,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    let end = tokio::select! {
        () = cancel.cancelled() => return,
        end = connection.wait() => end,
    };
    let _ = events
        .send(Event::Engine(EngineEvent::ConnectionLost { end }))
        .await;
}

/// Probes load freshness every `interval`, the first time at once, and
/// re-reads the identity.
///
/// An engine that does not serve its load RPC (UNIMPLEMENTED or NOT_FOUND:
/// an older servicer) is said to the core once, as such, and never again as
/// a probe failure; `connection`, when given (the kind does not follow it
/// already), is then followed instead, so that the engine going away is
/// still a loss. Its identity is still re-read every round.
pub(crate) async fn probe(
    kind: EngineKind,
    channel: Channel,
    interval: Duration,
    mut connection: Option<ConnectionWatch>,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut load_served = true;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let round = async {
            let probed = probe_once(kind, &channel, interval).await;
            let unserved = probed
                .fresh
                .as_ref()
                .err()
                .and_then(EngineError::unserved_call);
            let event = match (unserved, probed.fresh) {
                (Some(rpc), _) => {
                    let first = std::mem::replace(&mut load_served, false);
                    if let Some(connection) = connection.take() {
                        tokio::spawn(watch_connection(connection, events.clone(), cancel.clone()));
                    }
                    first.then(|| {
                        Event::Engine(EngineEvent::LoadUnsupported {
                            rpc: rpc.to_string(),
                        })
                    })
                }
                (None, _) if !load_served => None,
                (None, Ok(())) => Some(Event::Engine(EngineEvent::ProbeSucceeded)),
                (None, Err(e)) => Some(Event::Engine(EngineEvent::ProbeFailed {
                    error: e.to_string(),
                })),
            };
            if let Some(event) = event {
                let _ = events.send(event).await;
            }
            if let Some(identity) = probed.identity {
                let _ = events
                    .send(Event::Engine(EngineEvent::IdentityObserved { identity }))
                    .await;
            }
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = round => {}
        }
    }
}
