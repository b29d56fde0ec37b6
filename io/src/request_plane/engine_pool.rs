//! The request plane's connections to the engine: one to start with, another
//! only when every open one carries as many calls as the engine's SETTINGS
//! allow on a connection, up to what the engine streams the sidecar may hold
//! need ([`Sizing`]; `--engine-connections` sets the number instead). Without
//! that, one caller holding the engine's whole stream limit would make every
//! other caller's call wait behind it in h2's queue. Each call goes to the
//! connection with the fewest of the sidecar's calls on it among those of its
//! own request-plane thread ([`super::shards`]), so that a token is read and
//! passed on by one thread; another thread's only when its own are full and
//! the pool may not grow.
//!
//! Each connection is an `h2` client connection of its own, driven by one
//! task, with no HTTP layer above it: a call opens its engine stream from its
//! own task and moves its request and response frames there itself. A tonic
//! `Channel` puts every call through a buffer task before hyper's, and hyper's
//! client adds per call a task that waits for the response headers and one that
//! pipes the request body, each one more hop through the runtime's queue on the
//! way to the first token (docs/PERFORMANCE-LOG.md, "The engine side on h2"). A
//! connection that closed (the engine went away) is opened again by the next
//! call that leases it.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use bytes::Bytes;
use h2::SendStream;
use h2::client::{ResponseFuture, SendRequest};

use super::engine_streams::EngineStream;
use crate::engine::{
    ChannelSettings, ENGINE_CONNECTION_WINDOW, ENGINE_MAX_HEADER_LIST_BYTES, ENGINE_STREAM_WINDOW,
    ReadsPerTurn, StreamLimit,
};

/// Why a call could not be sent to the engine.
pub(crate) type SendError = Box<dyn std::error::Error + Send + Sync>;

/// How many streams a new connection opens before the engine's SETTINGS say
/// how many it takes (hyper's default; h2's own is unlimited).
const INITIAL_MAX_SEND_STREAMS: usize = 100;

/// The most streams the pool opens on one engine connection, whatever the
/// engine allows. An engine stream's answer waits in the sidecar while its
/// caller's window is closed, and what waits keeps its share of the engine
/// connection's window: a stream window at most (ENGINE_STREAM_WINDOW). With
/// this many streams, the streams of callers that never read hold at most
/// half the connection's window (ENGINE_CONNECTION_WINDOW), and the other
/// half always flows to the calls beside them. Without it, 4,096 calls from
/// callers with a window of zero held all of it, and another call on that
/// connection got no byte in 20 s (docs/RELIABILITY.md, "Flow control").
pub(crate) const STREAMS_PER_CONNECTION: u32 = ENGINE_CONNECTION_WINDOW / ENGINE_STREAM_WINDOW / 2;

/// The engine streams callers may take without competing (`engine_streams`)
/// when `--engine-connections` is not given: twice as many may be held when
/// callers compete, and each may make the sidecar hold one engine stream
/// window of answer unread by its caller, so the sidecar holds at most
/// 2 GiB of answers (32,768 × 64 KiB). It is four times the most streams a
/// router was measured to keep open on one engine (8,192), which this lets
/// through whole; past it, calls wait in turn instead of failing.
pub(crate) const OPEN_STREAMS: usize = 16_384;

/// How much request data one engine stream may hold unsent (hyper's default).
const MAX_SEND_BUFFER_BYTES: usize = 1 << 20;

/// How much one turn of an engine connection's task reads before it lets the
/// rest of the turn happen: h2 reads every frame the socket holds before it
/// writes, and under a flood of tokens the socket is never empty, so the new
/// calls' requests and the window updates that let the engine go on waited
/// behind megabytes of reads, and the caller connections relayed them in
/// one late batch. Past this, the read says "not now" and wakes the task
/// again: h2 writes what is queued, and the callers' connections relay what
/// was read before the next turn reads on (docs/PERFORMANCE-LOG.md, "The caller
/// side on h2": time to first token at 256 saturated streams 17 → 13 ms).
const READ_PER_TURN: usize = 64 << 10;

/// Where and how every connection of the pool is opened.
struct Target {
    /// `host:port`.
    address: String,
    /// `http://host:port`, the origin every request is sent to.
    origin: http::uri::Authority,
    settings: ChannelSettings,
    limit: StreamLimit,
}

/// An open engine connection: the handle calls open streams with, and whether
/// the task driving it has ended.
struct Open {
    sender: SendRequest<Bytes>,
    closed: Arc<AtomicBool>,
}

/// One engine connection and the calls on it.
struct Pooled {
    /// The open connection; `None` before the first call and after it closed.
    sender: Mutex<Option<Open>>,
    /// Whether the connection is being opened, or why the last attempt failed.
    opening: Mutex<Opening>,
    /// Woken when an attempt to open the connection is over.
    opened: tokio::sync::Notify,
    /// Calls leased this connection.
    open: AtomicU32,
    /// [`STREAMS_PER_CONNECTION`] permits, one held by each call whose
    /// engine stream is open on this connection.
    streams: Arc<Semaphore>,
    /// The request-plane shard whose thread drives the connection (the one
    /// that opened it last): its calls lease it first.
    home: AtomicUsize,
}

impl Pooled {
    /// A connection not opened yet, for the calls of shard `home`.
    fn new(home: usize) -> Self {
        Pooled {
            sender: Mutex::default(),
            opening: Mutex::default(),
            opened: tokio::sync::Notify::new(),
            open: AtomicU32::new(0),
            streams: Arc::new(Semaphore::new(STREAMS_PER_CONNECTION as usize)),
            home: AtomicUsize::new(home),
        }
    }
}

/// The state of opening a pooled connection.
///
/// Opening runs in a task of its own, not in the call that asked first: a
/// call the caller resets must not take the half-made connection with it
/// (thousands of HEADERS+RST_STREAM pairs made the engine accept a connection
/// each), and the calls that came meanwhile wait for the same attempt.
#[derive(Default)]
enum Opening {
    /// Nothing under way: the next call without a connection starts it.
    #[default]
    Idle,
    /// An attempt is under way; its end wakes `opened`.
    Underway,
    /// The last attempt failed, with this reason, for the calls that waited
    /// on it; the next call starts another.
    Failed(String),
}

impl Pooled {
    /// The open connection's sender and closed flag, if it is open.
    fn current(&self) -> Option<(SendRequest<Bytes>, Arc<AtomicBool>)> {
        let slot = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref()
            .filter(|open| !open.closed.load(Ordering::Acquire))
            .map(|open| (open.sender.clone(), open.closed.clone()))
    }
}

/// The engine connections of the request plane.
pub(crate) struct EnginePool {
    target: Arc<Target>,
    sizing: Sizing,
    connections: Mutex<Vec<Arc<Pooled>>>,
}

/// How many engine streams and connections the request plane uses, from the
/// engine's stream limit per connection (its SETTINGS) and the operator's
/// `--engine-connections`, if given.
#[derive(Clone)]
pub(crate) struct Sizing {
    limit: StreamLimit,
    connections: Option<usize>,
}

impl Sizing {
    /// The streams one connection carries: the engine's limit, and never
    /// more than [`STREAMS_PER_CONNECTION`].
    fn streams_per_connection(&self) -> usize {
        self.limit.get().map_or(STREAMS_PER_CONNECTION, |limit| {
            limit.clamp(1, STREAMS_PER_CONNECTION)
        }) as usize
    }

    /// The engine streams callers may take without competing: half of what
    /// the connections take when their number is set (the other half is
    /// for callers under their fair share), else [`OPEN_STREAMS`].
    pub(crate) fn open_streams(&self) -> usize {
        self.connections.map_or(OPEN_STREAMS, |n| {
            (n * self.streams_per_connection() / 2).max(1)
        })
    }

    /// The connections the pool may open: as set, or enough to carry twice
    /// [`Self::open_streams`] at the engine's limit per connection.
    fn max_connections(&self) -> usize {
        self.connections
            .unwrap_or_else(|| (2 * OPEN_STREAMS).div_ceil(self.streams_per_connection()))
            .max(1)
    }
}

/// One call's hold on a connection; released when dropped.
pub(crate) struct Lease {
    pooled: Arc<Pooled>,
    target: Arc<Target>,
    /// The call's place among the connection's streams, once it opens one.
    stream: Option<OwnedSemaphorePermit>,
    /// Its engine stream among every caller's, held likewise.
    _caller: Option<EngineStream>,
}

impl Lease {
    /// Opens the call's stream to the engine on this connection (opening the
    /// connection first if it is not open) and sends `request`'s headers, with
    /// END_STREAM when `end_of_stream`. The answer's headers come through the
    /// [`ResponseFuture`]; the request's body, if any, goes into the stream.
    ///
    /// It first waits for a place among the connection's streams, held until
    /// the call ends.
    pub(crate) async fn send(
        &mut self,
        mut request: http::Request<()>,
        end_of_stream: bool,
    ) -> Result<(ResponseFuture, SendStream<Bytes>), SendError> {
        if self.stream.is_none() {
            // Waits only when every connection the pool may open is at
            // STREAMS_PER_CONNECTION (the permits are never closed).
            self.stream = self.pooled.streams.clone().acquire_owned().await.ok();
        }
        let (sender, closed) = self.sender().await?;
        // HTTP/2 needs the origin; the caller's request carries its own path.
        let mut parts = request.uri().clone().into_parts();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        parts.authority = Some(self.target.origin.clone());
        *request.uri_mut() = http::Uri::from_parts(parts)?;
        let mut sender = match sender.ready().await {
            Ok(sender) => sender,
            Err(e) => {
                // This connection opens no more streams: it went away (GOAWAY,
                // or broken) before its task said so, or it used up its stream
                // ids (2^30 calls). Nothing was sent yet, so the call goes on
                // a new connection, and so do the calls after it.
                closed.store(true, Ordering::Release);
                tracing::debug!("request plane: an engine connection opens no more streams: {e}");
                let (fresh, _) = self.sender().await?;
                fresh.ready().await?
            }
        };
        Ok(sender.send_request(request, end_of_stream)?)
    }

    /// The connection's sender and its closed flag, opened if it is not (or
    /// no longer) open: by a task of its own, which this call (and any other
    /// that comes meanwhile) waits for, and which goes on if they go away.
    async fn sender(&self) -> Result<(SendRequest<Bytes>, Arc<AtomicBool>), SendError> {
        // This call has waited for an attempt: if that one failed, so does
        // the call (a fresh call starts another).
        let mut waited = false;
        loop {
            if let Some(handles) = self.pooled.current() {
                return Ok(handles);
            }
            let woken = self.pooled.opened.notified();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            {
                let mut opening = self
                    .pooled
                    .opening
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                match &*opening {
                    Opening::Underway => {}
                    Opening::Failed(why) if waited => return Err(why.clone().into()),
                    Opening::Idle | Opening::Failed(_) => {
                        if self.pooled.current().is_some() {
                            continue;
                        }
                        *opening = Opening::Underway;
                        // Spawned here, so driven by this call's shard.
                        self.pooled
                            .home
                            .store(super::shards::current(), Ordering::Release);
                        tokio::spawn(open_pooled(self.pooled.clone(), self.target.clone()));
                    }
                }
            }
            woken.await;
            waited = true;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pooled.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Opens `pooled`'s connection and says how it went to every call waiting.
async fn open_pooled(pooled: Arc<Pooled>, target: Arc<Target>) {
    let attempt = connect(&target).await;
    let mut opening = pooled.opening.lock().unwrap_or_else(|p| p.into_inner());
    match attempt {
        Ok(open) => {
            *pooled.sender.lock().unwrap_or_else(|p| p.into_inner()) = Some(open);
            *opening = Opening::Idle;
        }
        Err(e) => *opening = Opening::Failed(crate::report::error_chain(e.as_ref())),
    }
    drop(opening);
    pooled.opened.notify_waiters();
}

/// Opens one HTTP/2 connection to the engine, bounded by the connect
/// timeout, with the windows of every engine connection, and spawns the task
/// that drives it and pings the engine every keepalive interval.
async fn connect(target: &Target) -> Result<Open, SendError> {
    let settings = target.settings;
    let turn = ReadsPerTurn::new(READ_PER_TURN);
    let handshake = async {
        let io = crate::engine::open_connection(&target.address, target.limit.clone())
            .await?
            .into_inner()
            .reads_per_turn(turn.clone());
        let handshake = h2::client::Builder::new()
            .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
            .initial_window_size(ENGINE_STREAM_WINDOW)
            .initial_connection_window_size(ENGINE_CONNECTION_WINDOW)
            .max_header_list_size(ENGINE_MAX_HEADER_LIST_BYTES)
            .max_send_buffer_size(MAX_SEND_BUFFER_BYTES)
            .enable_push(false)
            .handshake::<_, Bytes>(io)
            .await?;
        Ok::<_, SendError>(handshake)
    };
    let (sender, mut connection) = tokio::time::timeout(settings.connect_timeout, handshake)
        .await
        .map_err(|_| {
            format!(
                "no connection within {}",
                llm_sidecar_core::HumanDuration(settings.connect_timeout)
            )
        })??;
    let closed = Arc::new(AtomicBool::new(false));
    let ended = MarkClosed(closed.clone());
    let ping_pong = connection.ping_pong();
    tokio::spawn(async move {
        let _ended = ended;
        let keepalive = keep_alive(
            ping_pong,
            settings.keepalive_interval,
            settings.keepalive_timeout,
        );
        let driven = std::future::poll_fn(|cx| {
            turn.begin();
            Pin::new(&mut connection).poll(cx)
        });
        let how = tokio::select! {
            result = driven => match result {
                Ok(()) => "closed".to_string(),
                Err(e) => crate::report::error_chain(&e),
            },
            why = keepalive => why,
        };
        // Dropping the connection fails every stream still on it, so their
        // calls end (UNAVAILABLE, retryable) instead of waiting on a dead peer.
        drop(connection);
        tracing::debug!("request plane: an engine connection ended: {how}");
    });
    Ok(Open { sender, closed })
}

/// Marks an engine connection closed when its task ends, whichever way:
/// returning, or unwinding from a panic. A panic while h2's internal lock
/// is held poisons that lock, and h2 then panics on every use of the
/// connection; marked closed, it leaves the pool and the next call opens a
/// new one, where a flag set only on a normal return kept it there.
struct MarkClosed(Arc<AtomicBool>);

impl Drop for MarkClosed {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Pings the engine every `interval` and returns why the connection must be
/// given up: a ping that could not be sent or had no answer within `timeout`
/// (a frozen engine or a silent network).
async fn keep_alive(
    ping_pong: Option<h2::PingPong>,
    interval: Duration,
    timeout: Duration,
) -> String {
    let Some(mut ping_pong) = ping_pong else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(interval).await;
        if let Err(e) = ping_pong.send_ping(h2::Ping::opaque()) {
            return format!("keepalive ping not sent: {e}");
        }
        let pong = std::future::poll_fn(|cx| ping_pong.poll_pong(cx));
        match tokio::time::timeout(timeout, pong).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return format!("keepalive ping failed: {e}"),
            Err(_) => {
                return format!(
                    "keepalive ping unanswered for {}",
                    llm_sidecar_core::HumanDuration(timeout)
                );
            }
        }
    }
}

impl EnginePool {
    /// A pool of connections to the engine at `address`, each opened by the
    /// first call that needs it: `connections` of them at most, or (`None`)
    /// as many as [`Sizing`] says; `limit` is the engine's stream limit, as
    /// its SETTINGS said.
    pub(crate) fn new(
        address: &str,
        settings: ChannelSettings,
        limit: StreamLimit,
        connections: Option<usize>,
    ) -> Result<Self, http::uri::InvalidUri> {
        let pool = EnginePool {
            target: Arc::new(Target {
                address: address.to_string(),
                origin: address.parse()?,
                settings,
                limit: limit.clone(),
            }),
            sizing: Sizing {
                limit,
                connections: connections.map(|n| n.max(1)),
            },
            connections: Mutex::new(Vec::new()),
        };
        pool.lock().push(Arc::new(Pooled::new(0)));
        Ok(pool)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Pooled>>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection for one more call: the least busy of the call's own
    /// shard's; else a new one for that shard while the pool may grow; else
    /// the least busy of any shard's (its thread drives it).
    ///
    /// `caller` is the call's engine stream, taken before: the lease holds
    /// it until the call ends.
    pub(crate) fn lease(&self, caller: Option<EngineStream>) -> Lease {
        let here = super::shards::current();
        let mut connections = self.lock();
        let per_connection = self.sizing.streams_per_connection();
        let busy = |c: &Arc<Pooled>| c.open.load(Ordering::Acquire);
        let full = |c: &Pooled| c.open.load(Ordering::Acquire) as usize >= per_connection;
        let own = connections
            .iter()
            .filter(|c| c.home.load(Ordering::Acquire) == here)
            .min_by_key(|c| busy(c))
            .cloned();
        let least = connections.iter().min_by_key(|c| busy(c)).cloned();
        let grow = connections.len() < self.sizing.max_connections();
        let chosen = match (own, least) {
            (Some(c), _) if !full(&c) => c,
            (_, Some(c)) if !grow => c,
            (own, _) => {
                let fresh = Arc::new(Pooled::new(here));
                connections.push(fresh.clone());
                if own.is_some() {
                    tracing::info!(
                        connections = connections.len(),
                        "request plane: every engine connection of a thread is at the engine's \
                         stream limit; opened another"
                    );
                }
                fresh
            }
        };
        chosen.open.fetch_add(1, Ordering::AcqRel);
        Lease {
            pooled: chosen,
            target: self.target.clone(),
            stream: None,
            _caller: caller,
        }
    }

    /// The engine streams callers may take without competing.
    pub(crate) fn open_streams(&self) -> usize {
        self.sizing.open_streams()
    }

    /// How the pool is sized, for what shares its streams.
    pub(crate) fn sizing(&self) -> Sizing {
        self.sizing.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_task_that_panics_leaves_its_connection_marked_closed() {
        let closed = Arc::new(AtomicBool::new(false));
        let ended = MarkClosed(closed.clone());
        let task = tokio::spawn(async move {
            let _ended = ended;
            panic!("as if h2's lock were poisoned");
        });
        assert!(task.await.expect_err("the task panicked").is_panic());
        assert!(closed.load(Ordering::Acquire), "the pool sees it closed");
    }
}
