//! The request plane's connections to the engine: one to start with, another
//! (up to `--engine-connections`) only when every open one carries as many
//! calls as the engine's SETTINGS allow on a connection. Without that, one
//! caller holding the engine's whole stream limit would make every other
//! caller's call wait behind it in h2's queue. Each call goes to the
//! connection with the fewest of the sidecar's calls on it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tonic::transport::{Channel, Endpoint};

use crate::engine::{EngineConnector, StreamLimit};

/// One engine connection and the calls on it.
struct Pooled {
    channel: Channel,
    open: AtomicU32,
}

/// The engine connections of the request plane.
pub(crate) struct EnginePool {
    endpoint: Endpoint,
    limit: StreamLimit,
    max_connections: usize,
    connections: Mutex<Vec<Arc<Pooled>>>,
}

/// One call's hold on a connection; released when dropped.
pub(crate) struct Lease(Arc<Pooled>);

impl Lease {
    /// The connection to send the call on.
    pub(crate) fn channel(&self) -> Channel {
        self.0.channel.clone()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl EnginePool {
    /// A pool of at most `max_connections` (at least one) lazy connections to
    /// `endpoint`; `limit` is the engine's stream limit, as its SETTINGS said.
    pub(crate) fn new(endpoint: Endpoint, limit: StreamLimit, max_connections: usize) -> Self {
        let pool = EnginePool {
            endpoint,
            limit,
            max_connections: max_connections.max(1),
            connections: Mutex::new(Vec::new()),
        };
        let first = pool.connect();
        pool.lock().push(first);
        pool
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Pooled>>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn connect(&self) -> Arc<Pooled> {
        let connector = EngineConnector::new(self.limit.clone());
        Arc::new(Pooled {
            channel: self.endpoint.connect_with_connector_lazy(connector),
            open: AtomicU32::new(0),
        })
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
            self.limit
                .get()
                .is_some_and(|limit| c.open.load(Ordering::Acquire) >= limit)
        };
        let chosen = match least {
            Some(c) if !full(&c) || connections.len() >= self.max_connections => c,
            Some(_) | None => {
                let fresh = self.connect();
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
        Lease(chosen)
    }

    /// How many calls the engine takes at once through this pool, if it
    /// limits streams per connection.
    pub(crate) fn capacity(&self) -> Option<u64> {
        self.limit
            .get()
            .map(|limit| u64::from(limit) * self.max_connections as u64)
    }
}
