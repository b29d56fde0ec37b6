//! The engine's KV capacity and load, for Dynamo's router: the block size and
//! total blocks go into the registration (`GetServerInfo`'s capacity), and
//! `GetLoad` is polled every [`POLL`] and published per data-parallel rank
//! through Dynamo's snapshot publisher, which sets the worker's
//! `dynamo_component_*` gauges and sends the router its `kv_used_blocks`.
//!
//! This is the router's signal only. Whether the engine is lost is decided by
//! the core's own monitors (the liveness Watch, the stale-load rule on the
//! same RPC, keepalive), so a failed poll here is skipped, never judged.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dynamo_backend_common::{ComponentSnapshot, SnapshotPublisher};
use llm_sidecar_engine_api::openengine::control_client::ControlClient;
use llm_sidecar_engine_api::openengine::{GetLoadRequest, GetServerInfoRequest, LoadInfo};
use llm_sidecar_engine_api::prost_types;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// How often the engine's load is read: what Dynamo's own OpenEngine
/// sidecar polls at, and what its router expects of a worker.
pub const POLL: Duration = Duration::from_millis(100);

/// One `GetLoad` may take this long before the poll is skipped.
const CALL_BOUND: Duration = Duration::from_secs(1);

/// A load sample older than this (by the engine's clock) is not published,
/// as in Dynamo's sidecar.
const TOO_OLD: Duration = Duration::from_secs(5);

/// A load sample this far in the future is not published either.
const TOO_NEW: Duration = Duration::from_secs(1);

/// What the engine's `GetServerInfo` says about its KV cache and ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capacity {
    pub kv_block_size: Option<u32>,
    pub total_kv_blocks: Option<u64>,
    pub max_running_requests: Option<u64>,
    pub max_batched_tokens: Option<u64>,
    pub data_parallel_size: u32,
    pub data_parallel_start_rank: u32,
    /// How often the engine's KV event publishers send a heartbeat
    /// (`ServerInfo.extra.kv_event_heartbeat_interval_ms`), if it says.
    pub kv_event_heartbeat: Option<Duration>,
}

impl Capacity {
    /// The ranks this worker publishes load for: none unless the engine
    /// reported a block size and a total (a load the router cannot size is
    /// no signal).
    pub fn ranks(&self) -> Vec<u32> {
        if self.kv_block_size.is_none() || self.total_kv_blocks.is_none() {
            return Vec::new();
        }
        let start = self.data_parallel_start_rank;
        (start..start.saturating_add(self.data_parallel_size.max(1))).collect()
    }
}

/// Reads the engine's capacity.
pub async fn read_capacity(channel: Channel) -> Result<Capacity, tonic::Status> {
    let info = ControlClient::new(channel)
        .get_server_info(GetServerInfoRequest {})
        .await?
        .into_inner();
    let capacity = info.capacity.unwrap_or_default();
    let parallelism = info.parallelism.unwrap_or_default();
    Ok(Capacity {
        kv_block_size: capacity.kv_block_size.filter(|b| *b > 0),
        total_kv_blocks: capacity.total_kv_blocks.filter(|t| *t > 0),
        max_running_requests: capacity.max_running_requests,
        max_batched_tokens: capacity.max_batched_tokens,
        data_parallel_size: parallelism.data_parallel_size.unwrap_or(1).max(1),
        data_parallel_start_rank: parallelism.data_parallel_start_rank.unwrap_or(0),
        kv_event_heartbeat: info.extra.as_ref().and_then(heartbeat_interval),
    })
}

/// `kv_event_heartbeat_interval_ms` from `ServerInfo.extra`: a positive
/// number of milliseconds, anything else ignored.
fn heartbeat_interval(extra: &prost_types::Struct) -> Option<Duration> {
    match extra.fields.get("kv_event_heartbeat_interval_ms")?.kind {
        Some(prost_types::value::Kind::NumberValue(ms))
            if ms.is_finite() && ms >= 1.0 && ms <= f64::from(u32::MAX) =>
        {
            Some(Duration::from_millis(ms as u64))
        }
        _ => None,
    }
}

/// The snapshots one `GetLoad` answer makes: one per rank it reports, or,
/// from an engine that reports no ranks, its totals as the first rank's.
pub fn snapshots(load: &LoadInfo, ranks: &[u32]) -> Vec<ComponentSnapshot> {
    let snapshot = |rank: u32, used: Option<u64>, total: Option<u64>| {
        let (used, total) = (used?, total.filter(|t| *t > 0)?);
        Some(ComponentSnapshot {
            kv_used_blocks: used,
            kv_total_blocks: total,
            gpu_cache_usage: (used as f64 / total as f64).clamp(0.0, 1.0) as f32,
            kv_cache_hit_rate: None,
            dp_rank: rank,
        })
    };
    if load.ranks.is_empty() {
        return ranks
            .first()
            .and_then(|r| snapshot(*r, load.used_kv_blocks, load.total_kv_blocks))
            .into_iter()
            .collect();
    }
    load.ranks
        .iter()
        .filter_map(|r| {
            let rank = r.data_parallel_rank?;
            ranks.contains(&rank).then_some(())?;
            snapshot(rank, r.used_kv_blocks, r.total_kv_blocks)
        })
        .collect()
}

/// Whether a sample stamped `at` (Unix nanoseconds, the engine's clock) may
/// be published `now`: not older than [`TOO_OLD`], not further ahead than
/// [`TOO_NEW`]. A sample without a stamp is taken as fresh.
fn fresh(at: Option<u64>, now: SystemTime) -> bool {
    let Some(at) = at else { return true };
    let at = UNIX_EPOCH + Duration::from_nanos(at);
    match now.duration_since(at) {
        Ok(age) => age <= TOO_OLD,
        Err(ahead) => ahead.duration() <= TOO_NEW,
    }
}

/// Polls `GetLoad` every [`POLL`] and publishes it until `stop`.
pub fn spawn_poller(
    channel: Channel,
    publisher: Arc<SnapshotPublisher>,
    ranks: Vec<u32>,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        let mut client = ControlClient::new(channel);
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut warned_stale = false;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let request = GetLoadRequest {
                include_per_rank: true,
            };
            let load = match tokio::time::timeout(CALL_BOUND, client.get_load(request)).await {
                Ok(Ok(load)) => load.into_inner(),
                Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => {
                    // The core's monitor says this once, at WARN.
                    tracing::debug!("the engine has no GetLoad: no load for Dynamo's router");
                    return;
                }
                Ok(Err(status)) => {
                    tracing::debug!(%status, "GetLoad failed; this poll is skipped");
                    continue;
                }
                Err(_) => continue,
            };
            if !fresh(load.timestamp_unix_nanos, SystemTime::now()) {
                if !warned_stale {
                    tracing::warn!(
                        "the engine's GetLoad is stamped more than {TOO_OLD:?} ago or \
                         {TOO_NEW:?} ahead (clock skew?): such samples are not published; \
                         the router keeps the last load it had"
                    );
                    warned_stale = true;
                }
                continue;
            }
            for snapshot in snapshots(&load, &ranks) {
                publisher.publish(snapshot.dp_rank, snapshot);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use llm_sidecar_engine_api::openengine::RankLoadInfo;

    use super::*;

    #[test]
    fn an_engine_without_ranks_is_its_first_rank_and_one_without_totals_publishes_nothing() {
        let load = LoadInfo {
            used_kv_blocks: Some(512),
            total_kv_blocks: Some(8192),
            ..Default::default()
        };
        let s = snapshots(&load, &[3]);
        assert_eq!(s.len(), 1);
        assert_eq!(
            (s[0].dp_rank, s[0].kv_used_blocks, s[0].kv_total_blocks),
            (3, 512, 8192)
        );
        assert!((s[0].gpu_cache_usage - 0.0625).abs() < 1e-6);
        let without_total = LoadInfo {
            used_kv_blocks: Some(1),
            ..Default::default()
        };
        assert!(snapshots(&without_total, &[0]).is_empty());
    }

    #[test]
    fn ranks_are_published_each_and_only_the_declared_ones() {
        let rank = |r, used| RankLoadInfo {
            data_parallel_rank: Some(r),
            used_kv_blocks: Some(used),
            total_kv_blocks: Some(100),
            ..Default::default()
        };
        let load = LoadInfo {
            ranks: vec![rank(0, 10), rank(1, 20), rank(7, 70)],
            ..Default::default()
        };
        let s = snapshots(&load, &[0, 1]);
        assert_eq!(
            s.iter()
                .map(|s| (s.dp_rank, s.kv_used_blocks))
                .collect::<Vec<_>>(),
            [(0, 10), (1, 20)]
        );
    }

    #[test]
    fn samples_older_than_five_seconds_or_ahead_by_more_than_one_are_not_fresh() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        let at = |secs: u64| Some(secs * 1_000_000_000);
        assert!(fresh(None, now));
        assert!(fresh(at(1_000), now));
        assert!(fresh(at(995), now));
        assert!(!fresh(at(994), now));
        assert!(fresh(at(1_001), now));
        assert!(!fresh(at(1_002), now));
    }

    #[test]
    fn ranks_need_a_block_size_and_a_total() {
        let mut c = Capacity {
            data_parallel_size: 2,
            data_parallel_start_rank: 4,
            ..Default::default()
        };
        assert!(c.ranks().is_empty());
        c.kv_block_size = Some(16);
        c.total_kv_blocks = Some(10);
        assert_eq!(c.ranks(), [4, 5]);
    }
}
