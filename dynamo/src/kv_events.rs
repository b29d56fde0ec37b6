//! The engine's KV-cache events, relayed to Dynamo's KV router, so that
//! `--router-mode kv` sends a request to the worker whose engine already
//! holds its prefix.
//!
//! The engine lists its publishers with `Control.GetKvEventSources` (one ZMQ
//! PUB socket per data-parallel rank, msgpack payloads, as TensorRT-LLM's
//! newer OpenEngine server does) and says in `GetServerInfo.extra` how often
//! each sends a heartbeat (`kv_event_heartbeat_interval_ms`, an empty batch
//! when there is nothing else to say). For each rank this worker subscribes
//! itself, decodes each batch with Dynamo's own decoder (`zmq_wire`) and
//! hands the events to the rank's `KvEventPublisher`, which Dynamo's worker
//! built and which feeds the router's index.
//!
//! Relaying rather than letting Dynamo 1.6.1 subscribe (its ZMQ source knows
//! no heartbeat) is what lets the worker stop the router trusting a
//! publisher that fell silent: after three heartbeat intervals without a
//! message it publishes `Cleared` for that rank, the router forgets every
//! block it credited to it, and routes the worker as one it knows nothing
//! about until events flow again. An engine that advertises no heartbeat is
//! never judged by its silence: an idle engine has nothing to say.

use std::sync::Arc;
use std::time::Duration;

use dynamo_backend_common::KvEventPublisher;
use dynamo_kv_router::protocols::{KvCacheEvent, KvCacheEventData, WorkerWithDpRank};
use dynamo_kv_router::zmq_wire::{ZmqEventNormalizer, decode_event_batch};
use futures::StreamExt;
use llm_sidecar_engine_api::openengine::control_client::ControlClient;
use llm_sidecar_engine_api::openengine::{GetKvEventSourcesRequest, KvEventSource};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// How many heartbeat intervals of silence make a publisher untrusted, as
/// Dynamo's current OpenEngine sidecar counts them.
pub const SILENT_INTERVALS: u32 = 3;

/// One engine publisher this worker relays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// `tcp://host:port`.
    pub endpoint: String,
    pub topic: String,
    pub rank: u32,
}

/// Why the engine's KV events are not relayed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoEvents {
    /// The engine has no `GetKvEventSources` (older servers).
    #[error("the engine has no Control.GetKvEventSources (an older server)")]
    Unimplemented,
    /// The engine publishes none.
    #[error("the engine publishes no KV events (GetKvEventSources listed no source)")]
    NoneListed,
    /// The registration carries no block size, without which the router
    /// cannot place a block.
    #[error("the engine reports no KV block size, without which the router cannot place blocks")]
    NoBlockSize,
    /// The call failed.
    #[error("GetKvEventSources failed: {0}")]
    Failed(String),
    /// What the engine listed cannot be relayed.
    #[error("{0}")]
    Unusable(String),
}

/// The sources to relay, one per rank in `ranks`.
pub async fn discover(channel: Channel, ranks: &[u32]) -> Result<Vec<Source>, NoEvents> {
    let answer = ControlClient::new(channel)
        .get_kv_event_sources(GetKvEventSourcesRequest {
            data_parallel_ranks: Vec::new(),
        })
        .await;
    let listed = match answer {
        Ok(a) => a.into_inner().sources,
        Err(s) if matches!(s.code(), tonic::Code::Unimplemented | tonic::Code::NotFound) => {
            return Err(NoEvents::Unimplemented);
        }
        Err(s) => return Err(NoEvents::Failed(format!("{}: {}", s.code(), s.message()))),
    };
    if listed.is_empty() {
        return Err(NoEvents::NoneListed);
    }
    sources(listed, ranks)
}

/// Checks what the engine listed: ZMQ with msgpack, a connectable endpoint,
/// one source per declared rank and none outside them.
pub fn sources(listed: Vec<KvEventSource>, ranks: &[u32]) -> Result<Vec<Source>, NoEvents> {
    let unusable = |why: String| Err(NoEvents::Unusable(why));
    let mut out: Vec<Source> = Vec::new();
    for s in listed {
        let Some(rank) = s
            .data_parallel_rank
            .or((ranks.len() == 1).then(|| ranks[0]))
        else {
            return unusable("a KV event source names no data-parallel rank".into());
        };
        if !ranks.contains(&rank) {
            return unusable(format!(
                "a KV event source for rank {rank}, outside the engine's ranks {ranks:?}"
            ));
        }
        if out.iter().any(|o| o.rank == rank) {
            return unusable(format!("two KV event sources for rank {rank}"));
        }
        if s.transport != "zmq" || s.encoding != "msgpack" {
            return unusable(format!(
                "rank {rank}'s KV events come over {:?} as {:?}; this worker reads ZMQ with msgpack",
                s.transport, s.encoding
            ));
        }
        if let Some(v) = s.schema_version.filter(|v| *v != 1) {
            return unusable(format!(
                "rank {rank}'s KV events use schema version {v}; this worker reads version 1"
            ));
        }
        let endpoint = s.endpoint_addr.unwrap_or_default();
        let wildcard = matches!(endpoint.host.as_str(), "" | "*" | "0.0.0.0" | "::" | "[::]");
        if wildcard || endpoint.port == 0 || endpoint.port > u32::from(u16::MAX) {
            return unusable(format!(
                "rank {rank}'s KV event source has no address to connect to ({}:{})",
                endpoint.host, endpoint.port
            ));
        }
        let protocol = if endpoint.protocol.is_empty() {
            "tcp"
        } else {
            endpoint.protocol.as_str()
        };
        let host = if endpoint.host.contains(':') && !endpoint.host.starts_with('[') {
            format!("[{}]", endpoint.host)
        } else {
            endpoint.host.clone()
        };
        out.push(Source {
            endpoint: format!("{protocol}://{host}:{}", endpoint.port),
            topic: s.topic,
            rank,
        });
    }
    let missing: Vec<u32> = ranks
        .iter()
        .filter(|r| !out.iter().any(|o| o.rank == **r))
        .copied()
        .collect();
    if !missing.is_empty() {
        return unusable(format!("no KV event source for ranks {missing:?}"));
    }
    Ok(out)
}

/// What relaying one source needs.
pub struct Relay {
    pub source: Source,
    pub publisher: Arc<KvEventPublisher>,
    pub worker_id: u64,
    pub block_size: u32,
    /// The engine's heartbeat interval, if it advertises one.
    pub heartbeat: Option<Duration>,
    /// Ends the relay with the worker.
    pub stop: CancellationToken,
}

impl Relay {
    /// Runs the relay until `stop`.
    pub async fn run(self) {
        let Relay {
            source,
            publisher,
            worker_id,
            block_size,
            heartbeat,
            stop,
        } = self;
        let rank = source.rank;
        let subscribed = tmq::subscribe(&tmq::Context::new())
            .set_reconnect_ivl(100)
            .set_reconnect_ivl_max(5_000)
            .set_linger(0)
            .connect(&source.endpoint)
            .and_then(|s| s.subscribe(source.topic.as_bytes()));
        let mut socket = match subscribed {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(
                    rank,
                    endpoint = source.endpoint,
                    "cannot subscribe to the engine's KV events: {e}; Dynamo's router gets \
                     none from this worker"
                );
                return;
            }
        };
        tracing::info!(
            rank,
            endpoint = source.endpoint,
            topic = source.topic,
            "relaying the engine's KV events to Dynamo's router"
        );
        let worker = WorkerWithDpRank::new(worker_id, rank);
        let mut normalizer = ZmqEventNormalizer::new(block_size);
        let silent_after = heartbeat.map(|h| h * SILENT_INTERVALS);
        let mut last_heard = Instant::now();
        let mut trusted = true;
        let mut undecodable = 0u64;
        loop {
            let deadline = silent_after.map(|s| last_heard + s);
            let silence = async {
                match deadline {
                    Some(d) if trusted => tokio::time::sleep_until(d).await,
                    _ => std::future::pending().await,
                }
            };
            let frames = tokio::select! {
                () = stop.cancelled() => return,
                () = silence => {
                    trusted = false;
                    let cleared = KvCacheEvent {
                        event_id: publisher.next_event_id(),
                        data: KvCacheEventData::Cleared,
                        dp_rank: rank,
                    };
                    if publisher.publish(cleared).is_err() {
                        return;
                    }
                    tracing::warn!(
                        rank,
                        "the engine's KV events have been silent for {:?} ({SILENT_INTERVALS} \
                         heartbeat intervals): Dynamo's router now forgets every block it \
                         credited to this worker's rank {rank} and routes it as a worker \
                         without events until they resume",
                        last_heard.elapsed()
                    );
                    continue;
                }
                next = socket.next() => match next {
                    Some(Ok(m)) => m.into_iter().map(|f| f.to_vec()).collect::<Vec<_>>(),
                    Some(Err(e)) => {
                        tracing::debug!(rank, "KV events: receive failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    None => return,
                },
            };
            last_heard = Instant::now();
            if !trusted {
                trusted = true;
                tracing::info!(
                    rank,
                    "the engine's KV events resumed: Dynamo's router learns this worker's \
                     blocks again as they are stored"
                );
            }
            let Some(payload) = frames.get(2).filter(|_| frames.len() == 3) else {
                undecodable += 1;
                if undecodable == 1 {
                    tracing::warn!(
                        rank,
                        "a KV event message of {} frames, not 3 (topic, sequence, payload): \
                         dropped (said once)",
                        frames.len()
                    );
                }
                continue;
            };
            let batch = match decode_event_batch(payload) {
                Ok(b) => b,
                Err(e) => {
                    undecodable += 1;
                    if undecodable == 1 {
                        tracing::warn!(rank, "a KV event batch did not decode: {e} (said once)");
                    }
                    continue;
                }
            };
            let mut events = Vec::with_capacity(batch.events.len());
            for raw in batch.events {
                let Ok(raw) = normalizer.preprocess_with_reason(raw, worker) else {
                    continue;
                };
                if let Some(e) =
                    normalizer.normalize_preprocessed(raw, publisher.next_event_id(), worker)
                {
                    events.push(e.event);
                }
            }
            if !events.is_empty() && publisher.publish_batch(events).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_sidecar_engine_api::openengine::KvEndpoint;

    fn source(rank: Option<u32>, host: &str, port: u32) -> KvEventSource {
        KvEventSource {
            transport: "zmq".into(),
            endpoint_addr: Some(KvEndpoint {
                host: host.into(),
                port,
                protocol: String::new(),
            }),
            topic: "kv".into(),
            data_parallel_rank: rank,
            encoding: "msgpack".into(),
            schema_version: Some(1),
            ..Default::default()
        }
    }

    #[test]
    fn one_zmq_source_per_rank_is_taken_with_its_endpoint() {
        let got = sources(
            vec![
                source(Some(1), "10.0.0.2", 5557),
                source(Some(0), "::1", 5558),
            ],
            &[0, 1],
        )
        .expect("usable");
        assert_eq!(got[0].endpoint, "tcp://10.0.0.2:5557");
        assert_eq!(got[1].endpoint, "tcp://[::1]:5558");
        assert_eq!((got[0].rank, got[1].rank), (1, 0));
        // One rank: a source without a rank is that rank's.
        assert_eq!(
            sources(vec![source(None, "h", 1)], &[0]).expect("usable")[0].rank,
            0
        );
    }

    #[test]
    fn sources_that_cannot_be_relayed_are_refused_by_name() {
        let cases = [
            (vec![source(Some(0), "0.0.0.0", 5557)], "no address"),
            (vec![source(Some(0), "h", 0)], "no address"),
            (vec![source(Some(2), "h", 1)], "outside"),
            (
                vec![source(Some(0), "h", 1), source(Some(0), "h", 2)],
                "two KV event sources",
            ),
            (
                vec![source(Some(0), "h", 1)],
                "no KV event source for ranks [1]",
            ),
            (
                vec![KvEventSource {
                    encoding: "protobuf".into(),
                    ..source(Some(0), "h", 1)
                }],
                "ZMQ with msgpack",
            ),
        ];
        for (listed, why) in cases {
            let ranks: &[u32] = if why.contains("[1]") { &[0, 1] } else { &[0] };
            let got = sources(listed, ranks);
            assert!(
                matches!(&got, Err(NoEvents::Unusable(m)) if m.contains(why)),
                "{why}: {got:?}"
            );
        }
    }
}
