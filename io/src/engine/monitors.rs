//! The engine monitors started in Serving: the liveness Watch, and the probe
//! that checks load freshness and re-reads the identity. Each reports raw
//! observations; the core decides what they mean.

use std::time::Duration;

use llm_sidecar_core::{Event, LivenessObservation};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::{EngineProfile, probe as probe_once, read_info};

/// A stream that ended without trailers surfaces in tonic ≥ 0.14.6 as Unknown
/// "missing grpc-status trailer": that is a stream end, not a failure.
fn observe_status(status: &tonic::Status) -> LivenessObservation {
    if status.code() == tonic::Code::Unknown && status.message().contains("missing grpc-status") {
        LivenessObservation::StreamEnded
    } else {
        LivenessObservation::StreamFailed {
            code: status.code() as i32,
            message: status.message().to_string(),
        }
    }
}

/// Watches `service` until the stream ends, fails, or `cancel` fires.
pub(crate) async fn watch_liveness(
    channel: Channel,
    service: String,
    first_message_within: Duration,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    let send = |o: LivenessObservation| {
        let events = events.clone();
        async move {
            let _ = events.send(Event::Liveness(o)).await;
        }
    };
    let mut client = HealthClient::new(channel);
    let open = async {
        let mut stream = client
            .watch(HealthCheckRequest { service })
            .await?
            .into_inner();
        let first = stream.message().await;
        Ok::<_, tonic::Status>((stream, first))
    };
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
        Ok(Err(status)) => return send(observe_status(&status)).await,
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

/// Probes load freshness every `interval` and re-reads the identity.
pub(crate) async fn probe(
    profile: EngineProfile,
    channel: Channel,
    interval: Duration,
    events: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate; start-up just read the engine, so skip it.
    ticker.tick().await;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let round = async {
            let fresh = probe_once(&profile, &channel, interval).await;
            let event = match fresh {
                Ok(()) => Event::ProbeSucceeded,
                Err(e) => Event::ProbeFailed {
                    error: e.to_string(),
                },
            };
            let _ = events.send(event).await;
            if let Ok(info) = read_info(&profile, &channel, interval).await {
                let _ = events
                    .send(Event::IdentityObserved {
                        identity: info.identity,
                    })
                    .await;
            }
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = round => {}
        }
    }
}
