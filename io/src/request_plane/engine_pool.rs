//! The request plane's connections to the engine: one to start with, another
//! (up to `--engine-connections`) only when every open one carries as many
//! calls as the engine's SETTINGS allow on a connection. Without that, one
//! caller holding the engine's whole stream limit would make every other
//! caller's call wait behind it in h2's queue. Each call goes to the
//! connection with the fewest of the sidecar's calls on it.
//!
//! Each connection is hyper's HTTP/2 client connection itself, not a tonic
//! `Channel`: a `Channel` puts every call through a buffer task before
//! hyper's, one more task hop on the way to the engine for each new call,
//! which under load is a wait behind every relay the runtime has queued
//! (docs/PERFORMANCE.md, "Paced"). A connection that closed (the engine went
//! away) is opened again by the next call that leases it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::TokioTimer;
use tonic::body::Body;

use crate::engine::{
    ChannelSettings, ENGINE_CONNECTION_WINDOW, ENGINE_MAX_HEADER_LIST_BYTES, ENGINE_STREAM_WINDOW,
    StreamLimit,
};

/// Why a call could not be sent to the engine, or its answer not read.
pub(crate) type SendError = Box<dyn std::error::Error + Send + Sync>;

/// Where and how every connection of the pool is opened.
struct Target {
    /// `host:port`.
    address: String,
    /// `http://host:port`, the origin every request is sent to.
    origin: http::uri::Authority,
    settings: ChannelSettings,
    limit: StreamLimit,
}

/// One engine connection and the calls on it.
#[derive(Default)]
struct Pooled {
    /// The open connection; `None` before the first call and after it closed.
    /// An async lock: the first of many calls opens it, the others wait.
    sender: tokio::sync::Mutex<Option<SendRequest<Body>>>,
    open: AtomicU32,
}

/// The engine connections of the request plane.
pub(crate) struct EnginePool {
    target: Arc<Target>,
    max_connections: usize,
    connections: Mutex<Vec<Arc<Pooled>>>,
}

/// One call's hold on a connection; released when dropped.
pub(crate) struct Lease {
    pooled: Arc<Pooled>,
    target: Arc<Target>,
}

impl Lease {
    /// Sends `request` to the engine on this connection (opening it first if
    /// it is not open) and waits for the answer's headers.
    pub(crate) async fn send(
        &self,
        mut request: http::Request<Body>,
    ) -> Result<http::Response<Incoming>, SendError> {
        let mut sender = self.sender().await?;
        // HTTP/2 needs the origin; the caller's request carries its own path.
        let mut parts = request.uri().clone().into_parts();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        parts.authority = Some(self.target.origin.clone());
        *request.uri_mut() = http::Uri::from_parts(parts)?;
        sender.ready().await?;
        Ok(sender.send_request(request).await?)
    }

    /// The connection's sender, opened if it is not (or no longer) open.
    async fn sender(&self) -> Result<SendRequest<Body>, SendError> {
        let mut slot = self.pooled.sender.lock().await;
        if let Some(sender) = slot.as_ref()
            && !sender.is_closed()
        {
            return Ok(sender.clone());
        }
        *slot = None;
        let sender = connect(&self.target).await?;
        *slot = Some(sender.clone());
        Ok(sender)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pooled.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Hyper's executor for the engine connections: spawns each future in a box.
///
/// Why: hyper spawns, for every call, a task that pipes the request body to the
/// engine and one that waits for the response headers, and both are its one
/// future type, as large as the whole connection (1.6 KiB). A tokio task's
/// memory is freed only when the last waker of it is gone, and the pipe leaves
/// its waker in the call's h2 stream until the call ends: spawned as they are,
/// 1.6 KiB stay per streaming call. Boxed, the future is freed when it
/// completes and what stays is the task's header (docs/PERFORMANCE.md, "Memory
/// per stream").
#[derive(Clone, Copy)]
struct SpawnBoxed;

impl<F> hyper::rt::Executor<F> for SpawnBoxed
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    fn execute(&self, future: F) {
        tokio::spawn(Box::pin(future));
    }
}

/// Opens one HTTP/2 connection to the engine, bounded by the connect
/// timeout, with the keepalive and windows of every engine connection.
async fn connect(target: &Target) -> Result<SendRequest<Body>, SendError> {
    let settings = target.settings;
    let handshake = async {
        let io = crate::engine::open_connection(&target.address, target.limit.clone()).await?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(SpawnBoxed)
            .timer(TokioTimer::new())
            .keep_alive_interval(settings.keepalive_interval)
            .keep_alive_timeout(settings.keepalive_timeout)
            .keep_alive_while_idle(true)
            .max_header_list_size(ENGINE_MAX_HEADER_LIST_BYTES)
            .initial_connection_window_size(ENGINE_CONNECTION_WINDOW)
            .initial_stream_window_size(ENGINE_STREAM_WINDOW)
            .handshake::<_, Body>(io)
            .await?;
        Ok::<_, SendError>((sender, connection))
    };
    let (sender, connection) = tokio::time::timeout(settings.connect_timeout, handshake)
        .await
        .map_err(|_| {
            format!(
                "no connection within {}",
                llm_sidecar_core::HumanDuration(settings.connect_timeout)
            )
        })??;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("request plane: an engine connection ended: {e}");
        }
    });
    Ok(sender)
}

impl EnginePool {
    /// A pool of at most `max_connections` (at least one) connections to the
    /// engine at `address`, each opened by the first call that needs it;
    /// `limit` is the engine's stream limit, as its SETTINGS said.
    pub(crate) fn new(
        address: &str,
        settings: ChannelSettings,
        limit: StreamLimit,
        max_connections: usize,
    ) -> Result<Self, http::uri::InvalidUri> {
        let pool = EnginePool {
            target: Arc::new(Target {
                address: address.to_string(),
                origin: address.parse()?,
                settings,
                limit,
            }),
            max_connections: max_connections.max(1),
            connections: Mutex::new(Vec::new()),
        };
        pool.lock().push(Arc::new(Pooled::default()));
        Ok(pool)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Pooled>>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection for one more call: the least busy, or a new one when even
    /// that one is at the engine's limit and the pool may grow.
    pub(crate) fn lease(&self) -> Lease {
        let mut connections = self.lock();
        let least = connections
            .iter()
            .min_by_key(|c| c.open.load(Ordering::Acquire))
            .cloned();
        let full = |c: &Pooled| {
            self.target
                .limit
                .get()
                .is_some_and(|limit| c.open.load(Ordering::Acquire) >= limit)
        };
        let chosen = match least {
            Some(c) if !full(&c) || connections.len() >= self.max_connections => c,
            Some(_) | None => {
                let fresh = Arc::new(Pooled::default());
                connections.push(fresh.clone());
                tracing::info!(
                    connections = connections.len(),
                    "request plane: every engine connection is at the engine's stream limit; \
                     opened another"
                );
                fresh
            }
        };
        chosen.open.fetch_add(1, Ordering::AcqRel);
        Lease {
            pooled: chosen,
            target: self.target.clone(),
        }
    }

    /// How many calls the engine takes at once through this pool, if it
    /// limits streams per connection.
    pub(crate) fn capacity(&self) -> Option<u64> {
        self.target
            .limit
            .get()
            .map(|limit| u64::from(limit) * self.max_connections as u64)
    }
}
