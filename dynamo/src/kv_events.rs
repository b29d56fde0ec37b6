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
use std::sync::atomic::{AtomicU64, Ordering};
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

/// How many KV blocks per second one rank may store or remove at the router,
/// sustained. Dynamo's publisher queues every event it is handed without a
/// bound and cannot say how far behind it is, so a publisher faster than it
/// grows this process without limit (6 to 9 million events in 10 s grew it by
/// 1 GB; 240,000 a second grew a debug build by 300 MB in 10 s). A busy
/// engine stores a block per `block size` tokens it prefills or decodes and
/// removes as many: 200,000 tokens a second in 16-token blocks is 12,500
/// blocks stored and as many removed.
pub const BLOCKS_PER_SECOND: u64 = 50_000;

/// How far one rank may run ahead of [`BLOCKS_PER_SECOND`] at once (an
/// engine's burst after a long prefill batch).
pub const BURST_BLOCKS: u64 = 100_000;

/// The largest KV event message taken from an engine's publisher (a larger
/// one closes the connection, which ZMQ then opens again): a batch of 100,000
/// stored blocks of 16 tokens each is about 5 MB.
pub const MAX_MESSAGE_BYTES: i64 = 16 << 20;

/// How many messages ZMQ may hold for the relay before the publisher's side
/// drops them (its default, 1,000, holds 100 MB of a flood's batches).
pub const QUEUED_MESSAGES: i32 = 16;

/// What one rank's events may still put into the router's index: a token
/// bucket of blocks per second (an event costs its blocks, at least one), and
/// the engine's total: blocks the router holds for the rank are never more
/// than the engine has. Time is an input.
#[derive(Debug, Clone)]
pub struct Budget {
    /// Blocks the bucket holds now.
    tokens: u64,
    /// When the bucket was last refilled.
    refilled: Instant,
    /// The engine's total KV blocks for this rank.
    total: u64,
    /// Blocks credited to this rank at the router (stored less removed, as
    /// relayed; an estimate that errs low when the engine removes blocks the
    /// router never had).
    credited: u64,
    /// Events dropped since the last `Cleared`: the router's view of the
    /// rank is wrong until it is cleared again.
    diverged: u64,
}

/// What the budget made of one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Pass it on; `cut` blocks of a stored event were left out, beyond the
    /// engine's total.
    Pass { cut: u64 },
    /// Dropped: the rank is over its rate.
    Dropped,
}

impl Budget {
    /// A full bucket, for a rank of `total` blocks, at `now`.
    pub fn new(total: u64, now: Instant) -> Self {
        Budget {
            tokens: BURST_BLOCKS,
            refilled: now,
            total,
            credited: 0,
            diverged: 0,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled);
        let earned = (elapsed.as_micros() as u64).saturating_mul(BLOCKS_PER_SECOND) / 1_000_000;
        if earned > 0 {
            self.tokens = self.tokens.saturating_add(earned).min(BURST_BLOCKS);
            self.refilled = now;
        }
    }

    /// Whether the events dropped since the last `Cleared` must be made good
    /// by a `Cleared` now: some were dropped and the bucket is half full
    /// again (not at its first refill, so a steady flood clears the rank
    /// about once a second, not at every message).
    pub fn must_clear(&mut self, now: Instant) -> Option<u64> {
        self.refill(now);
        (self.diverged > 0 && self.short_of_half() == 0).then_some(self.diverged)
    }

    /// Blocks the bucket lacks to be half full: the level at which a
    /// dropping rank is cleared and read again.
    fn short_of_half(&self) -> u64 {
        (BURST_BLOCKS / 2).saturating_sub(self.tokens)
    }

    /// How long the relay should stop reading, at `now`: while the rank is
    /// dropping, until the bucket is half full again. Reading on would only
    /// decode messages to drop them: a flood at any rate then costs this
    /// process what the budget lets through, not what the engine sends (ZMQ
    /// drops the rest at the publisher, and the sequence gap says how many).
    pub fn pause(&mut self, now: Instant) -> Option<Duration> {
        self.refill(now);
        let short = self.short_of_half();
        (self.diverged > 0 && short > 0)
            .then(|| Duration::from_micros(short.saturating_mul(1_000_000) / BLOCKS_PER_SECOND + 1))
    }

    /// Messages of the rank were lost before they reached the relay: the
    /// router's view of the rank is wrong until it is cleared.
    pub fn lost(&mut self, messages: u64) {
        self.diverged = self.diverged.saturating_add(messages);
    }

    /// A `Cleared` reached the router: it holds nothing of this rank.
    pub fn cleared(&mut self) {
        self.credited = 0;
        self.diverged = 0;
    }

    /// Takes `event` through the budget, cutting a stored event's blocks to
    /// what the engine's total leaves.
    pub fn admit(&mut self, event: &mut KvCacheEventData, now: Instant) -> Verdict {
        self.refill(now);
        let cost = match event {
            KvCacheEventData::Stored(s) => s.blocks.len() as u64,
            KvCacheEventData::Removed(r) => r.block_hashes.len() as u64,
            KvCacheEventData::Cleared => 0,
        }
        .max(1);
        // Once events were dropped, the rank is cleared before anything else
        // passes: the router's view restarts from nothing.
        if self.diverged > 0 || self.tokens < cost.min(BURST_BLOCKS) {
            self.diverged += 1;
            return Verdict::Dropped;
        }
        self.tokens -= cost.min(self.tokens);
        match event {
            KvCacheEventData::Stored(s) => {
                let room = self.total.saturating_sub(self.credited);
                let cut = (s.blocks.len() as u64).saturating_sub(room);
                // Stored blocks are a chain from their parent: the ones kept
                // are its beginning.
                s.blocks.truncate(s.blocks.len() - cut as usize);
                self.credited += s.blocks.len() as u64;
                Verdict::Pass { cut }
            }
            KvCacheEventData::Removed(r) => {
                self.credited = self.credited.saturating_sub(r.block_hashes.len() as u64);
                Verdict::Pass { cut: 0 }
            }
            KvCacheEventData::Cleared => {
                self.cleared();
                Verdict::Pass { cut: 0 }
            }
        }
    }
}

/// Counters of what the relays left out, on the admin port's `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Dropped {
    /// Events dropped for a rank over [`BLOCKS_PER_SECOND`].
    pub events: Arc<AtomicU64>,
    /// Stored blocks not credited, beyond the engine's total.
    pub blocks: Arc<AtomicU64>,
    /// Messages missing from the engine's sequence: ZMQ dropped them before
    /// the relay read them (its queue full, the relay paused or slow).
    pub messages: Arc<AtomicU64>,
}

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
    /// The engine's total KV blocks per rank: no more are credited.
    pub total_blocks: u64,
    /// Where what was left out is counted.
    pub dropped: Dropped,
    /// Ends the relay with the worker.
    pub stop: CancellationToken,
}

impl Relay {
    /// Runs the relay until `stop`.
    pub async fn run(self) {
        let Some(mut socket) = self.subscribe() else {
            return;
        };
        let mut state = self.fresh_state();
        loop {
            let going = match self.next(&mut socket, &state).await {
                Next::Message(frames) => {
                    self.relay_message(&mut state, &frames) && self.rest(&mut state).await
                }
                Next::Silent => self.fell_silent(&mut state),
                Next::Retry => true,
                Next::End => false,
            };
            if !going {
                return;
            }
            // Under a flood the socket is always ready, and it is no tokio
            // resource: without this the relay never yields and starves every
            // task behind it on its thread (the lifecycle's timers, the load
            // probe: the engine was judged stale after 35 s of a flood). A
            // message is up to a thousand events to decode, so the relay
            // yields after each one, not once its task budget of 128 units is
            // spent (a second and more of a debug build's decoding on a loaded
            // machine, enough for the load probe to judge the engine stale).
            tokio::task::yield_now().await;
        }
    }

    /// What a relay starts with: a full budget, the publisher just heard.
    fn fresh_state(&self) -> RelayState {
        let now = Instant::now();
        RelayState {
            normalizer: ZmqEventNormalizer::new(self.block_size),
            worker: WorkerWithDpRank::new(self.worker_id, self.source.rank),
            budget: Budget::new(self.total_blocks, now),
            last_heard: now,
            trusted: true,
            undecodable: 0,
            said: Said::default(),
            sequence: Sequence::default(),
            said_lost: Said::default(),
        }
    }

    /// Waits for the next message, the publisher's silence past three
    /// heartbeats (while it is trusted), or the worker's end.
    async fn next(&self, socket: &mut tmq::subscribe::Subscribe, state: &RelayState) -> Next {
        let deadline = self
            .heartbeat
            .map(|h| state.last_heard + h * SILENT_INTERVALS);
        let silence = async {
            match deadline {
                Some(d) if state.trusted => tokio::time::sleep_until(d).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            () = self.stop.cancelled() => Next::End,
            () = silence => Next::Silent,
            next = socket.next() => match next {
                Some(Ok(m)) => Next::Message(m.into_iter().map(|f| f.to_vec()).collect()),
                Some(Err(e)) => {
                    tracing::debug!(rank = self.source.rank, "KV events: receive failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Next::Retry
                }
                None => Next::End,
            },
        }
    }

    /// While the rank is dropping, stops reading until its budget allows
    /// more ([`Budget::pause`]); false if the worker ends meanwhile.
    async fn rest(&self, state: &mut RelayState) -> bool {
        let Some(wait) = state.budget.pause(Instant::now()) else {
            return true;
        };
        tokio::select! {
            () = self.stop.cancelled() => return false,
            () = tokio::time::sleep(wait) => {}
        }
        // The silence meanwhile was the relay's, not the engine's.
        state.last_heard = Instant::now();
        true
    }

    /// The SUB socket on the engine's publisher, or `None` (said once).
    fn subscribe(&self) -> Option<tmq::subscribe::Subscribe> {
        let subscribed = tmq::subscribe(&tmq::Context::new())
            .set_reconnect_ivl(100)
            .set_reconnect_ivl_max(5_000)
            .set_linger(0)
            .set_maxmsgsize(MAX_MESSAGE_BYTES)
            .set_rcvhwm(QUEUED_MESSAGES)
            .connect(&self.source.endpoint)
            .and_then(|s| s.subscribe(self.source.topic.as_bytes()));
        match subscribed {
            Ok(socket) => {
                tracing::info!(
                    rank = self.source.rank,
                    endpoint = self.source.endpoint,
                    topic = self.source.topic,
                    "relaying the engine's KV events to Dynamo's router"
                );
                Some(socket)
            }
            Err(e) => {
                tracing::warn!(
                    rank = self.source.rank,
                    endpoint = self.source.endpoint,
                    "cannot subscribe to the engine's KV events: {e}; Dynamo's router gets \
                     none from this worker"
                );
                None
            }
        }
    }

    /// Publishes `Cleared` for the rank; false once the publisher is gone.
    fn clear(&self, state: &mut RelayState) -> bool {
        let cleared = KvCacheEvent {
            event_id: self.publisher.next_event_id(),
            data: KvCacheEventData::Cleared,
            dp_rank: self.source.rank,
        };
        state.budget.cleared();
        self.publisher.publish(cleared).is_ok()
    }

    /// Three heartbeats of silence: the router forgets the rank's blocks.
    fn fell_silent(&self, state: &mut RelayState) -> bool {
        let rank = self.source.rank;
        state.trusted = false;
        if !self.clear(state) {
            return false;
        }
        tracing::warn!(
            rank,
            "the engine's KV events have been silent for {:?} ({SILENT_INTERVALS} heartbeat \
             intervals): Dynamo's router now forgets every block it credited to this \
             worker's rank {rank} and routes it as a worker without events until they resume",
            state.last_heard.elapsed()
        );
        true
    }

    /// Decodes one message and hands its events to Dynamo's publisher
    /// through the rank's budget; false once the publisher is gone.
    fn relay_message(&self, state: &mut RelayState, frames: &[Vec<u8>]) -> bool {
        let rank = self.source.rank;
        let now = Instant::now();
        state.last_heard = now;
        if !state.trusted {
            state.trusted = true;
            tracing::info!(
                rank,
                "the engine's KV events resumed: Dynamo's router learns this worker's blocks \
                 again as they are stored"
            );
        }
        if let Some(lost) = frames
            .get(1)
            .and_then(|f| Some(u64::from_be_bytes(f.as_slice().try_into().ok()?)))
            .and_then(|number| state.sequence.next(number))
        {
            self.dropped.messages.fetch_add(lost, Ordering::Relaxed);
            state.budget.lost(lost);
            if state.said_lost.due(now) {
                tracing::warn!(
                    rank,
                    "{lost} KV event messages of the engine never reached this worker (ZMQ \
                     dropped them, its queue of {QUEUED_MESSAGES} full): Dynamo's router forgets \
                     this rank's blocks and learns them anew (counted on /metrics; said at most \
                     once a minute)"
                );
            }
        }
        if let Some(dropped) = state.budget.must_clear(now) {
            if !self.clear(state) {
                return false;
            }
            if state.said.due(now) {
                tracing::info!(
                    rank,
                    "the engine's KV events are within {BLOCKS_PER_SECOND} blocks a second \
                     again after {dropped} events dropped or messages lost: Dynamo's router \
                     forgot this rank's blocks and learns them anew as they are stored (said at \
                     most once a minute; /metrics counts every drop)"
                );
            }
        }
        let Some(payload) = frames.get(2).filter(|_| frames.len() == 3) else {
            state.undecodable += 1;
            if state.undecodable == 1 {
                tracing::warn!(
                    rank,
                    "a KV event message of {} frames, not 3 (topic, sequence, payload): \
                     dropped (said once)",
                    frames.len()
                );
            }
            return true;
        };
        let batch = match decode_event_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                state.undecodable += 1;
                if state.undecodable == 1 {
                    tracing::warn!(rank, "a KV event batch did not decode: {e} (said once)");
                }
                return true;
            }
        };
        let mut events = Vec::with_capacity(batch.events.len().min(1_024));
        for raw in batch.events {
            let Ok(raw) = state.normalizer.preprocess_with_reason(raw, state.worker) else {
                continue;
            };
            let Some(mut e) = state.normalizer.normalize_preprocessed(
                raw,
                self.publisher.next_event_id(),
                state.worker,
            ) else {
                continue;
            };
            match state.budget.admit(&mut e.event.data, now) {
                Verdict::Pass { cut } => {
                    if cut > 0 {
                        self.dropped.blocks.fetch_add(cut, Ordering::Relaxed);
                        if self.dropped.blocks.load(Ordering::Relaxed) == cut {
                            tracing::warn!(
                                rank,
                                "a KV event stores more blocks than the engine's {} in all: \
                                 {cut} not credited at Dynamo's router (counted on /metrics; \
                                 said once)",
                                self.total_blocks
                            );
                        }
                    }
                    events.push(e.event);
                }
                Verdict::Dropped => {
                    self.dropped.events.fetch_add(1, Ordering::Relaxed);
                    if state.budget.diverged == 1 && state.said.due(now) {
                        tracing::warn!(
                            rank,
                            "the engine's KV events arrive faster than {BLOCKS_PER_SECOND} \
                             blocks a second: dropped (counted on /metrics) until they slow \
                             down; Dynamo's router then forgets this rank's blocks and learns \
                             them anew"
                        );
                    }
                }
            }
        }
        events.is_empty() || self.publisher.publish_batch(events).is_ok()
    }
}

/// What the relay's wait ended with.
enum Next {
    /// A message's frames.
    Message(Vec<Vec<u8>>),
    /// The publisher has been silent for three heartbeats.
    Silent,
    /// Receiving failed; waited a moment, try again.
    Retry,
    /// The worker ends, or the socket did.
    End,
}

/// What one relay keeps between messages.
struct RelayState {
    normalizer: ZmqEventNormalizer,
    worker: WorkerWithDpRank,
    budget: Budget,
    last_heard: Instant,
    /// The publisher has not fallen silent.
    trusted: bool,
    undecodable: u64,
    /// When a line about dropped events was last written.
    said: Said,
    /// The engine's message sequence, to find messages lost.
    sequence: Sequence,
    /// When a line about lost messages was last written.
    said_lost: Said,
}

/// The engine numbers its messages (the second frame, 8 bytes big-endian):
/// a gap is messages ZMQ dropped before the relay read them.
#[derive(Debug, Default)]
struct Sequence(Option<u64>);

impl Sequence {
    /// Takes the number of the message just read; how many messages were
    /// lost before it, if any. A number not above the last one is a
    /// publisher that started again: nothing lost, counted anew.
    fn next(&mut self, number: u64) -> Option<u64> {
        let last = self.0.replace(number)?;
        number
            .checked_sub(last)
            .and_then(|d| d.checked_sub(1))
            .filter(|lost| *lost > 0)
    }
}

/// A line that is written at most once a minute.
#[derive(Debug, Default)]
struct Said(Option<Instant>);

impl Said {
    /// Whether the line may be written `now` (and it is taken to be).
    fn due(&mut self, now: Instant) -> bool {
        let due = self
            .0
            .is_none_or(|at| now.saturating_duration_since(at) >= Duration::from_secs(60));
        if due {
            self.0 = Some(now);
        }
        due
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

    fn stored(blocks: usize) -> KvCacheEventData {
        KvCacheEventData::Stored(dynamo_kv_router::protocols::KvCacheStoreData {
            parent_hash: None,
            start_position: None,
            blocks: (0..blocks as u64)
                .map(|h| dynamo_kv_router::protocols::KvCacheStoredBlockData {
                    block_hash: dynamo_kv_router::protocols::ExternalSequenceBlockHash(h),
                    tokens_hash: dynamo_kv_router::protocols::LocalBlockHash(h),
                    mm_extra_info: None,
                })
                .collect(),
        })
    }

    fn removed(blocks: u64) -> KvCacheEventData {
        KvCacheEventData::Removed(dynamo_kv_router::protocols::KvCacheRemoveData {
            block_hashes: (0..blocks)
                .map(dynamo_kv_router::protocols::ExternalSequenceBlockHash)
                .collect(),
        })
    }

    #[test]
    fn a_rank_gets_its_burst_then_its_rate_and_after_drops_is_cleared_once_half_refilled() {
        let t0 = Instant::now();
        let mut b = Budget::new(u64::MAX, t0);
        // The burst passes at once, one block over it does not.
        for _ in 0..BURST_BLOCKS / 1_000 {
            assert_eq!(b.admit(&mut stored(1_000), t0), Verdict::Pass { cut: 0 });
        }
        assert_eq!(b.admit(&mut stored(1), t0), Verdict::Dropped);
        // Once dropping, nothing passes until the rank was cleared, and the
        // clear waits for half a bucket, not the first refill.
        let soon = t0 + Duration::from_millis(10);
        assert_eq!(b.must_clear(soon), None);
        assert_eq!(b.admit(&mut stored(1), soon), Verdict::Dropped);
        let half =
            t0 + Duration::from_secs_f64(BURST_BLOCKS as f64 / 2.0 / BLOCKS_PER_SECOND as f64);
        assert_eq!(
            b.must_clear(half),
            Some(2),
            "two dropped since the last clear"
        );
        b.cleared();
        assert_eq!(b.must_clear(half), None);
        assert_eq!(b.admit(&mut stored(1), half), Verdict::Pass { cut: 0 });
        // A steady rate at the limit passes whole.
        let mut b = Budget::new(u64::MAX, t0);
        b.tokens = 0;
        for ms in 1..=2_000u64 {
            let at = t0 + Duration::from_millis(ms);
            let per_ms = (BLOCKS_PER_SECOND / 1_000) as usize;
            assert_eq!(
                b.admit(&mut stored(per_ms), at),
                Verdict::Pass { cut: 0 },
                "{ms} ms"
            );
        }
    }

    #[test]
    fn a_dropping_rank_pauses_its_reading_until_half_refilled_and_a_lost_message_clears_it() {
        let t0 = Instant::now();
        let mut b = Budget::new(u64::MAX, t0);
        assert_eq!(b.pause(t0), None, "a full bucket reads on");
        assert_eq!(
            b.admit(&mut stored(BURST_BLOCKS as usize), t0),
            Verdict::Pass { cut: 0 }
        );
        assert_eq!(b.pause(t0), None, "empty but nothing dropped: reads on");
        assert_eq!(b.admit(&mut stored(1), t0), Verdict::Dropped);
        let wait = b.pause(t0).expect("dropping: the relay pauses");
        let half = Duration::from_secs_f64(BURST_BLOCKS as f64 / 2.0 / BLOCKS_PER_SECOND as f64);
        assert!(
            wait >= half && wait <= half + Duration::from_millis(1),
            "{wait:?}"
        );
        assert_eq!(b.pause(t0 + wait), None);
        assert_eq!(b.must_clear(t0 + wait), Some(1));
        b.cleared();
        // Messages lost with the bucket full: cleared at once, then passed.
        b.lost(3);
        assert_eq!(b.pause(t0 + wait), None, "no need to wait for the bucket");
        assert_eq!(b.must_clear(t0 + wait), Some(3));
    }

    #[test]
    fn a_gap_in_the_engines_sequence_counts_the_messages_lost() {
        let mut s = Sequence::default();
        assert_eq!(s.next(41), None, "the first message read");
        assert_eq!(s.next(42), None);
        assert_eq!(s.next(50), Some(7));
        assert_eq!(s.next(0), None, "a publisher started again");
        assert_eq!(s.next(1), None);
        assert_eq!(s.next(1), None, "a repeat loses nothing");
    }

    #[test]
    fn stored_blocks_are_credited_up_to_the_engines_total_and_removals_make_room() {
        let t0 = Instant::now();
        let mut b = Budget::new(1_024, t0);
        let mut big = stored(20_000);
        assert_eq!(
            b.admit(&mut big, t0),
            Verdict::Pass {
                cut: 20_000 - 1_024
            }
        );
        let KvCacheEventData::Stored(kept) = &big else {
            unreachable!()
        };
        assert_eq!(kept.blocks.len(), 1_024, "the chain's beginning is kept");
        assert_eq!(kept.blocks[0].block_hash.0, 0);
        let mut full = stored(1);
        assert_eq!(
            b.admit(&mut full, t0),
            Verdict::Pass { cut: 1 },
            "nothing fits"
        );
        assert_eq!(b.admit(&mut removed(24), t0), Verdict::Pass { cut: 0 });
        assert_eq!(b.admit(&mut stored(30), t0), Verdict::Pass { cut: 6 });
        assert_eq!(
            b.admit(&mut KvCacheEventData::Cleared, t0),
            Verdict::Pass { cut: 0 }
        );
        assert_eq!(b.admit(&mut stored(1_024), t0), Verdict::Pass { cut: 0 });
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
