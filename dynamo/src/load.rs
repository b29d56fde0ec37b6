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

/// The largest KV block the worker registers, in tokens. Engines use 1 to 256
/// (SGLang's page size 1, vLLM's and TensorRT-LLM's 16 to 128); Dynamo's KV
/// router sizes its per-request work by the block size, and one engine
/// reporting 4,294,967,295 made the frontend allocate 16 GiB and abort.
pub const MAX_KV_BLOCK_SIZE: u32 = 4_096;

/// The largest KV cache the worker registers, in tokens (blocks × block
/// size): 2^36, some 400 times what 141 GB of H200 memory holds for a model
/// with one byte of KV state per token.
pub const MAX_KV_TOKENS: u64 = 1 << 36;

/// The most data-parallel ranks one worker speaks for. The widest deployments
/// run a few hundred attention-DP ranks; the worker keeps one load entry and
/// one KV relay per rank, so the size bounds what it allocates.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1_024;

/// The highest data-parallel rank a worker may name (start rank + size − 1).
pub const MAX_DATA_PARALLEL_RANK: u32 = 65_535;

/// The largest `max_running_requests` / `max_batched_tokens` registered.
pub const MAX_SCHEDULER_LIMIT: u64 = 1 << 32;

/// What the engine's `GetServerInfo` says about its KV cache and ranks,
/// checked: every value here is within the bounds above.
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

/// What `GetServerInfo` reported, as it came: input to check, not to trust.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reported {
    pub kv_block_size: Option<u32>,
    pub total_kv_blocks: Option<u64>,
    pub max_running_requests: Option<u64>,
    pub max_batched_tokens: Option<u64>,
    pub data_parallel_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub kv_event_heartbeat: Option<Duration>,
}

/// Why the engine's report cannot be registered at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unregistrable {
    /// The data-parallel ranks are out of bounds: which ranks this worker
    /// serves decides every load entry and KV relay, so there is no safe
    /// default to register instead.
    #[error(
        "the engine reports data-parallel size {size} from start rank {start} \
         (GetServerInfo parallelism): a worker serves 1 to {MAX_DATA_PARALLEL_SIZE} ranks, \
         none above {MAX_DATA_PARALLEL_RANK}; not registered until the engine reports \
         ranks within them"
    )]
    Ranks {
        /// The reported size.
        size: u64,
        /// The reported start rank.
        start: u64,
    },
}

impl Reported {
    /// The capacity to register, with one line for each value left out for
    /// being out of bounds; an error where the ranks themselves are.
    pub fn check(self) -> Result<(Capacity, Vec<String>), Unregistrable> {
        let size = self.data_parallel_size.filter(|s| *s > 0).unwrap_or(1);
        let start = self.data_parallel_start_rank.unwrap_or(0);
        let last = u64::from(start) + u64::from(size) - 1;
        if size > MAX_DATA_PARALLEL_SIZE || last > u64::from(MAX_DATA_PARALLEL_RANK) {
            return Err(Unregistrable::Ranks {
                size: size.into(),
                start: start.into(),
            });
        }
        let mut left_out = Vec::new();
        // Zero is "not reported" (older servers fill the field with it).
        let mut block = self.kv_block_size.filter(|b| *b > 0);
        let mut total = self.total_kv_blocks.filter(|t| *t > 0);
        if let Some(b) = block.filter(|b| *b > MAX_KV_BLOCK_SIZE) {
            left_out.push(format!(
                "the engine reports a KV block size of {b} tokens (GetServerInfo capacity), \
                 above {MAX_KV_BLOCK_SIZE}"
            ));
        } else if let (Some(b), Some(t)) = (block, total)
            && u64::from(b).saturating_mul(t) > MAX_KV_TOKENS
        {
            left_out.push(format!(
                "the engine reports {t} KV blocks of {b} tokens (GetServerInfo capacity), \
                 more than {MAX_KV_TOKENS} tokens of cache"
            ));
        }
        if !left_out.is_empty() {
            // A total without its block size (or the reverse) places nothing.
            (block, total) = (None, None);
            left_out[0].push_str(
                ": registered without a KV block size and total, as for an engine that \
                 reports none; Dynamo's KV router routes this worker as one it knows nothing \
                 about, and no load or KV events are relayed",
            );
        }
        let mut limit = |name: &str, value: Option<u64>| match value {
            Some(v) if v > MAX_SCHEDULER_LIMIT => {
                left_out.push(format!(
                    "the engine reports {name} {v} (GetServerInfo capacity), above \
                     {MAX_SCHEDULER_LIMIT}: registered without it"
                ));
                None
            }
            Some(0) => None,
            v => v,
        };
        let max_running_requests = limit("max_running_requests", self.max_running_requests);
        let max_batched_tokens = limit("max_batched_tokens", self.max_batched_tokens);
        Ok((
            Capacity {
                kv_block_size: block,
                total_kv_blocks: total,
                max_running_requests,
                max_batched_tokens,
                data_parallel_size: size,
                data_parallel_start_rank: start,
                kv_event_heartbeat: self.kv_event_heartbeat,
            },
            left_out,
        ))
    }
}

impl Capacity {
    /// The ranks this worker publishes load for: none unless the engine
    /// reported a block size and a total (a load the router cannot size is
    /// no signal). At most [`MAX_DATA_PARALLEL_SIZE`], by [`Reported::check`].
    pub fn ranks(&self) -> Vec<u32> {
        if self.kv_block_size.is_none() || self.total_kv_blocks.is_none() {
            return Vec::new();
        }
        let start = self.data_parallel_start_rank;
        let size = self.data_parallel_size.clamp(1, MAX_DATA_PARALLEL_SIZE);
        (start..start.saturating_add(size)).collect()
    }
}

/// Reads what the engine reports of its capacity (unchecked).
pub async fn read_capacity(channel: Channel) -> Result<Reported, tonic::Status> {
    let info = ControlClient::new(channel)
        .get_server_info(GetServerInfoRequest {})
        .await?
        .into_inner();
    let capacity = info.capacity.unwrap_or_default();
    let parallelism = info.parallelism.unwrap_or_default();
    Ok(Reported {
        kv_block_size: capacity.kv_block_size,
        total_kv_blocks: capacity.total_kv_blocks,
        max_running_requests: capacity.max_running_requests,
        max_batched_tokens: capacity.max_batched_tokens,
        data_parallel_size: parallelism.data_parallel_size,
        data_parallel_start_rank: parallelism.data_parallel_start_rank,
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
    fn values_out_of_bounds_are_left_out_each_with_a_line_and_absurd_ranks_refuse_registration() {
        let sane = Reported {
            kv_block_size: Some(32),
            total_kv_blocks: Some(8192),
            max_running_requests: Some(256),
            data_parallel_size: Some(2),
            data_parallel_start_rank: Some(4),
            ..Default::default()
        };
        let (c, lines) = sane.check().expect("sane");
        assert!(lines.is_empty(), "{lines:?}");
        assert_eq!(
            (c.kv_block_size, c.total_kv_blocks, c.ranks()),
            (Some(32), Some(8192), vec![4, 5])
        );
        for (block, total, why) in [
            (u32::MAX, 8192, "block size of 4294967295"),
            (4_097, 1, "block size of 4097"),
            (4_096, 1 << 25, "more than 68719476736 tokens"),
        ] {
            let (c, lines) = Reported {
                kv_block_size: Some(block),
                total_kv_blocks: Some(total),
                ..sane
            }
            .check()
            .expect("registrable");
            assert_eq!((c.kv_block_size, c.total_kv_blocks), (None, None), "{why}");
            assert!(c.ranks().is_empty(), "no load without a block size");
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert!(
                lines[0].contains(why) && lines[0].contains("without"),
                "{lines:?}"
            );
        }
        let (c, lines) = Reported {
            max_batched_tokens: Some(u64::MAX),
            ..sane
        }
        .check()
        .expect("registrable");
        assert_eq!((c.max_batched_tokens, c.kv_block_size), (None, Some(32)));
        assert!(lines[0].contains("max_batched_tokens 18446744073709551615"));
        for (size, start) in [
            (u32::MAX, 0),
            (1_000_000, 0),
            (1_025, 0),
            (1, u32::MAX),
            (2, 65_535),
        ] {
            let got = Reported {
                data_parallel_size: Some(size),
                data_parallel_start_rank: Some(start),
                ..sane
            }
            .check();
            assert_eq!(
                got,
                Err(Unregistrable::Ranks {
                    size: size.into(),
                    start: start.into()
                })
            );
        }
        let widest = Reported {
            data_parallel_size: Some(1_024),
            data_parallel_start_rank: Some(64_512),
            ..sane
        };
        assert_eq!(
            widest.check().expect("at the bounds").0.ranks().len(),
            1_024
        );
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
