//! The mock's KV-cache events, published as TensorRT-LLM's newer OpenEngine
//! server does for Dynamo's KV router: a ZMQ PUB socket (advertised by
//! `Control.GetKvEventSources`), one message per batch of events, and an
//! empty batch every heartbeat interval (advertised in `ServerInfo.extra` as
//! `kv_event_heartbeat_interval_ms`).
//!
//! A message is three ZMQ frames: the topic, an 8-byte big-endian sequence
//! number, and a msgpack payload `[timestamp, [event, ...], data_parallel_rank]`
//! whose events are maps with a `type` of `BlockStored` (`block_hashes`,
//! `parent_block_hash`, `token_ids`, `block_size`, `medium`) or `BlockRemoved`
//! (`block_hashes`, `medium`): the shape Dynamo 1.6.1's decoder reads
//! (`dynamo-kv-router` `zmq_wire`). The mock's cache holds the full blocks of
//! every prompt it served, least recently used first out once it holds its
//! capacity (`TOTAL_KV_BLOCKS`).
//!
//! The ZMQ side is a minimal ZMTP 3.0 publisher written here (NULL security, a
//! READY handshake, the peer's subscriptions, PING answered): the mock needs
//! only that, and the ZMQ crates either link the C++ libzmq into the static
//! `llm-sidecar` binary or bring an async framework of their own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::lock;

/// The topic every message is published under (the first frame).
pub(crate) const TOPIC: &str = "kv-events";

/// What the mock publishes and where.
pub(crate) struct KvEvents {
    /// The PUB socket's address.
    pub(crate) addr: SocketAddr,
    /// How often an empty batch goes out.
    pub(crate) heartbeat: Duration,
    /// Tokens per block.
    block_size: u32,
    /// Nothing is published (neither events nor heartbeats) while this is
    /// set: a publisher that died while the engine serves (control
    /// `/kv-events?publish=off`).
    silent: AtomicBool,
    /// The encoded messages, to every subscriber's connection.
    messages: broadcast::Sender<Arc<Vec<u8>>>,
    next_sequence: AtomicU64,
    cache: Mutex<BlockCache>,
    /// Messages published (heartbeats included) and events in them.
    pub(crate) published: AtomicU64,
    pub(crate) events: AtomicU64,
}

/// One KV-cache event, as the mock publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
}

/// The blocks the mock's cache holds, and when each was last used.
#[derive(Debug)]
struct BlockCache {
    capacity: usize,
    /// Block hash to the stamp of its last use.
    held: HashMap<u64, u64>,
    /// Stamps of last use to block hashes: least recently used first.
    by_use: BTreeMap<u64, u64>,
    /// A counter standing for the time of each use.
    clock: u64,
}

impl BlockCache {
    fn new(capacity: usize) -> Self {
        BlockCache {
            capacity,
            held: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
        }
    }

    /// The events of serving a prompt: its full blocks stored (those not held
    /// yet, each chained to the one before) and the least recently used
    /// blocks removed past the capacity.
    fn serve(&mut self, prompt: &[u32], block_size: usize) -> Vec<Event> {
        let mut events = Vec::new();
        let mut parent: Option<u64> = None;
        let (mut hashes, mut tokens, mut first_parent) = (Vec::new(), Vec::new(), None);
        for block in prompt.chunks_exact(block_size.max(1)) {
            let hash = block_hash(parent, block);
            self.clock += 1;
            match self.held.insert(hash, self.clock) {
                Some(last) => {
                    self.by_use.remove(&last);
                }
                None => {
                    if hashes.is_empty() {
                        first_parent = parent;
                    }
                    hashes.push(hash);
                    tokens.extend_from_slice(block);
                }
            }
            self.by_use.insert(self.clock, hash);
            parent = Some(hash);
        }
        if !hashes.is_empty() {
            events.push(Event::Stored {
                hashes,
                parent: first_parent,
                tokens,
            });
        }
        let mut removed = Vec::new();
        while self.held.len() > self.capacity {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            self.held.remove(&oldest);
            removed.push(oldest);
        }
        if !removed.is_empty() {
            events.push(Event::Removed { hashes: removed });
        }
        events
    }
}

/// A block's hash: FNV-1a over its parent's hash and its tokens, so equal
/// prefixes give equal chains (and a block's hash names its whole prefix).
fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&parent.unwrap_or(0).to_le_bytes());
    for t in tokens {
        eat(&t.to_le_bytes());
    }
    // Dynamo reads hashes as signed or unsigned 64-bit values; keep them in
    // i64's range so every reader agrees.
    h >> 1
}

impl KvEvents {
    /// Serves the PUB socket on `listener` and starts its heartbeat.
    pub(crate) fn start(
        listener: TcpListener,
        heartbeat: Duration,
        block_size: u32,
        capacity: u64,
        stop: CancellationToken,
    ) -> std::io::Result<Arc<Self>> {
        let events = Arc::new(KvEvents {
            addr: listener.local_addr()?,
            heartbeat,
            block_size,
            silent: AtomicBool::new(false),
            messages: broadcast::channel(4096).0,
            next_sequence: AtomicU64::new(0),
            cache: Mutex::new(BlockCache::new(
                usize::try_from(capacity).unwrap_or(usize::MAX),
            )),
            published: AtomicU64::new(0),
            events: AtomicU64::new(0),
        });
        tokio::spawn(accept(listener, events.messages.clone(), stop.clone()));
        let beat = events.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(beat.heartbeat);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = every.tick() => beat.publish(&[]),
                }
            }
        });
        Ok(events)
    }

    /// Publishes what serving this prompt did to the cache.
    pub(crate) fn served(&self, prompt: &[u32]) {
        let events = lock(&self.cache).serve(prompt, self.block_size as usize);
        if !events.is_empty() {
            self.publish(&events);
        }
    }

    /// Stops or resumes publishing altogether.
    pub(crate) fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::Release);
    }

    pub(crate) fn is_silent(&self) -> bool {
        self.silent.load(Ordering::Acquire)
    }

    /// Blocks the cache holds.
    pub(crate) fn blocks_held(&self) -> usize {
        lock(&self.cache).held.len()
    }

    /// Publishes for `length` as fast as subscribers take it (a publisher
    /// gone wrong): batches of 1,024 events, each storing one new block or
    /// removing the one stored before it. Returns at once.
    pub(crate) fn flood(self: &Arc<Self>, length: Duration) {
        let events = self.clone();
        tokio::spawn(async move {
            let until = tokio::time::Instant::now() + length;
            let tokens: Vec<u32> = (0..events.block_size).map(|t| 3 + t % 1000).collect();
            let mut hash: u64 = 1 << 40;
            while tokio::time::Instant::now() < until {
                let batch: Vec<Event> = (0..512)
                    .flat_map(|_| {
                        hash += 1;
                        [
                            Event::Stored {
                                hashes: vec![hash],
                                parent: None,
                                tokens: tokens.clone(),
                            },
                            Event::Removed { hashes: vec![hash] },
                        ]
                    })
                    .collect();
                events.publish(&batch);
                tokio::task::yield_now().await;
            }
        });
    }

    /// Publishes one event storing `blocks` new blocks in one chain, whatever
    /// the cache holds (an engine that reports more than it has).
    pub(crate) fn store_unheld(&self, blocks: u32) {
        let tokens: Vec<u32> = (0..blocks * self.block_size)
            .map(|t| 3 + t % 1000)
            .collect();
        let hashes: Vec<u64> = (0..u64::from(blocks)).map(|i| (1 << 50) + i).collect();
        self.publish(&[Event::Stored {
            hashes,
            parent: None,
            tokens,
        }]);
    }

    fn publish(&self, events: &[Event]) {
        if self.is_silent() {
            return;
        }
        let sequence = self.next_sequence.fetch_add(1, Ordering::AcqRel);
        let payload = encode_batch(events, self.block_size);
        let message = zmtp_message(&[TOPIC.as_bytes(), &sequence.to_be_bytes(), &payload]);
        self.published.fetch_add(1, Ordering::Relaxed);
        self.events
            .fetch_add(events.len() as u64, Ordering::Relaxed);
        // No subscriber: the message goes nowhere, as on a real PUB socket.
        let _ = self.messages.send(Arc::new(message));
    }
}

/// `[timestamp, [event, ...], 0]` in msgpack.
fn encode_batch(events: &[Event], block_size: u32) -> Vec<u8> {
    use rmp::encode::{
        write_array_len, write_f64, write_map_len, write_nil, write_str, write_uint,
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let mut out = Vec::new();
    // Writing into a Vec cannot fail: every result below is Ok.
    let w = &mut out;
    let _ = write_array_len(w, 3);
    let _ = write_f64(w, now);
    let _ = write_array_len(w, events.len() as u32);
    let hashes = |w: &mut Vec<u8>, hashes: &[u64]| {
        let _ = write_str(w, "block_hashes");
        let _ = write_array_len(w, hashes.len() as u32);
        for h in hashes {
            let _ = write_uint(w, *h);
        }
    };
    for event in events {
        match event {
            Event::Stored {
                hashes: stored,
                parent,
                tokens,
            } => {
                let _ = write_map_len(w, 6);
                let _ = write_str(w, "type");
                let _ = write_str(w, "BlockStored");
                hashes(w, stored);
                let _ = write_str(w, "parent_block_hash");
                match parent {
                    Some(p) => {
                        let _ = write_uint(w, *p);
                    }
                    None => {
                        let _ = write_nil(w);
                    }
                }
                let _ = write_str(w, "token_ids");
                let _ = write_array_len(w, tokens.len() as u32);
                for t in tokens {
                    let _ = write_uint(w, u64::from(*t));
                }
                let _ = write_str(w, "block_size");
                let _ = write_uint(w, u64::from(block_size));
                let _ = write_str(w, "medium");
                let _ = write_str(w, "GPU");
            }
            Event::Removed { hashes: removed } => {
                let _ = write_map_len(w, 3);
                let _ = write_str(w, "type");
                let _ = write_str(w, "BlockRemoved");
                hashes(w, removed);
                let _ = write_str(w, "medium");
                let _ = write_str(w, "GPU");
            }
        }
    }
    let _ = write_uint(w, 0);
    out
}

// ZMTP 3.0 (rfc.zeromq.org/spec/23) frame flags.
const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// A multipart message as ZMTP frames.
fn zmtp_message(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let more = if i + 1 < parts.len() { MORE } else { 0 };
        frame(&mut out, more, part);
    }
    out
}

fn frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if let Ok(short) = u8::try_from(body.len()) {
        out.push(flags);
        out.push(short);
    } else {
        out.push(flags | LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    out.extend_from_slice(body);
}

/// A command frame: its name, then its data.
fn command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut out = Vec::new();
    frame(&mut out, COMMAND, &body);
    out
}

/// This side's greeting: ZMTP 3.0, the NULL mechanism.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[8] = 0x01;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

async fn accept(
    listener: TcpListener,
    messages: broadcast::Sender<Arc<Vec<u8>>>,
    stop: CancellationToken,
) {
    loop {
        let socket = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => socket,
                Err(e) => {
                    tracing::warn!("KV event publisher: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let rx = messages.subscribe();
        let stop = stop.clone();
        tokio::spawn(async move {
            if let Err(e) = subscriber(socket, rx, stop).await {
                tracing::debug!("KV event subscriber gone: {e}");
            }
        });
    }
}

/// What the subscriber side of a connection sent.
enum FromPeer {
    Subscribe(Vec<u8>),
    Cancel(Vec<u8>),
    Ping(Vec<u8>),
    Other,
}

async fn read_frame(socket: &mut (impl AsyncReadExt + Unpin)) -> std::io::Result<(u8, Vec<u8>)> {
    let flags = socket.read_u8().await?;
    let len = if flags & LONG != 0 {
        socket.read_u64().await?
    } else {
        u64::from(socket.read_u8().await?)
    };
    // A subscriber sends topics and short commands; refuse anything huge.
    if len > 1 << 20 {
        return Err(std::io::Error::other(
            "a frame over 1 MiB from a subscriber",
        ));
    }
    let mut body = vec![0; len as usize];
    socket.read_exact(&mut body).await?;
    Ok((flags, body))
}

fn parse(flags: u8, body: Vec<u8>) -> FromPeer {
    if flags & COMMAND != 0 {
        let name_len = body.first().copied().unwrap_or(0) as usize;
        let name = body.get(1..1 + name_len).unwrap_or_default();
        let data = body.get(1 + name_len..).unwrap_or_default().to_vec();
        return match name {
            b"SUBSCRIBE" => FromPeer::Subscribe(data),
            b"CANCEL" => FromPeer::Cancel(data),
            // PING: a 2-byte TTL, then the context PONG echoes.
            b"PING" => FromPeer::Ping(data.get(2..).unwrap_or_default().to_vec()),
            _ => FromPeer::Other,
        };
    }
    // ZMTP 3.0: a subscription is a message whose first byte is 1 (0 cancels).
    match body.split_first() {
        Some((1, topic)) => FromPeer::Subscribe(topic.to_vec()),
        Some((0, topic)) => FromPeer::Cancel(topic.to_vec()),
        _ => FromPeer::Other,
    }
}

async fn subscriber(
    socket: TcpStream,
    mut messages: broadcast::Receiver<Arc<Vec<u8>>>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    socket.set_nodelay(true)?;
    let (mut read, mut write) = socket.into_split();
    write.write_all(&greeting()).await?;
    let mut theirs = [0u8; 64];
    read.read_exact(&mut theirs).await?;
    if theirs[0] != 0xff || theirs[9] != 0x7f || theirs[10] < 3 {
        return Err(std::io::Error::other("not a ZMTP 3 peer"));
    }
    let mut ready = vec![11];
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"PUB");
    write.write_all(&command("READY", &ready)).await?;
    let (flags, _) = read_frame(&mut read).await?;
    if flags & COMMAND == 0 {
        return Err(std::io::Error::other(
            "the peer's first frame was not READY",
        ));
    }
    let (peer_tx, mut peer_rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        while let Ok((flags, body)) = read_frame(&mut read).await {
            if peer_tx.send(parse(flags, body)).await.is_err() {
                return;
            }
        }
    });
    let mut topics: BTreeSet<Vec<u8>> = BTreeSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            from_peer = peer_rx.recv() => match from_peer {
                None => return Ok(()),
                Some(FromPeer::Subscribe(t)) => { topics.insert(t); }
                Some(FromPeer::Cancel(t)) => { topics.remove(&t); }
                Some(FromPeer::Ping(context)) => write.write_all(&command("PONG", &context)).await?,
                Some(FromPeer::Other) => {}
            },
            message = messages.recv() => match message {
                Ok(m) => {
                    if topics.iter().any(|t| TOPIC.as_bytes().starts_with(t)) {
                        write.write_all(&m).await?;
                    }
                }
                // A subscriber too slow to keep up loses messages, as at a
                // real PUB socket's high-water mark.
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_stores_its_full_blocks_once_chained_and_the_oldest_leave_past_capacity() {
        let mut cache = BlockCache::new(4);
        let prompt: Vec<u32> = (0..70).collect();
        let events = cache.serve(&prompt, 32);
        let [
            Event::Stored {
                hashes,
                parent,
                tokens,
            },
        ] = events.as_slice()
        else {
            panic!("{events:?}")
        };
        assert_eq!(hashes.len(), 2, "70 tokens are two full blocks of 32");
        assert_eq!((*parent, tokens.len()), (None, 64));
        assert_eq!(hashes[1], block_hash(Some(hashes[0]), &prompt[32..64]));
        // The same prefix again: nothing new.
        assert!(cache.serve(&prompt[..64], 32).is_empty());
        // A longer prompt sharing it: only its third block, parented.
        let longer: Vec<u32> = (0..96).collect();
        let events = cache.serve(&longer, 32);
        assert_eq!(
            events,
            vec![Event::Stored {
                hashes: vec![block_hash(Some(hashes[1]), &longer[64..96])],
                parent: Some(hashes[1]),
                tokens: longer[64..96].to_vec(),
            }]
        );
        // Two more blocks of another prompt: five held, capacity four, the
        // least recently used (the first prompt's first block) leaves.
        let other: Vec<u32> = (1000..1064).collect();
        let events = cache.serve(&other, 32);
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(
            events[1],
            Event::Removed {
                hashes: vec![hashes[0]]
            }
        );
        assert_eq!(cache.held.len(), 4);
    }

    #[test]
    fn a_batch_is_msgpack_of_timestamp_events_and_rank() {
        let payload = encode_batch(
            &[Event::Removed {
                hashes: vec![7, 1 << 40],
            }],
            32,
        );
        let mut r = payload.as_slice();
        assert_eq!(rmp::decode::read_array_len(&mut r).ok(), Some(3));
        assert!(rmp::decode::read_f64(&mut r).is_ok_and(|ts| ts > 1.7e9));
        assert_eq!(rmp::decode::read_array_len(&mut r).ok(), Some(1));
        assert_eq!(rmp::decode::read_map_len(&mut r).ok(), Some(3));
        let mut text = [0u8; 32];
        assert_eq!(rmp::decode::read_str(&mut r, &mut text).ok(), Some("type"));
        assert_eq!(
            rmp::decode::read_str(&mut r, &mut text).ok(),
            Some("BlockRemoved")
        );
    }

    #[test]
    fn frames_are_short_below_256_bytes_and_long_above() {
        let m = zmtp_message(&[b"t", &[0u8; 300]]);
        assert_eq!(&m[..3], &[MORE, 1, b't']);
        assert_eq!(m[3], LONG);
        assert_eq!(&m[4..12], &300u64.to_be_bytes());
        assert_eq!(m.len(), 3 + 9 + 300);
    }
}
