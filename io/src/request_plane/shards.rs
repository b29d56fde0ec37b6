//! The request plane's threads: each a current-thread runtime of its own (a
//! shard) that runs the caller connections handed to it, their calls, and the
//! engine connections those calls open.
//!
//! Why shards and not tokio's multi-thread scheduler: a token goes from an
//! engine connection's task to its caller connection's task. On one
//! scheduler with work stealing those two tasks land on different threads,
//! and every token is a wake-up across threads; measured at 2,048 paced
//! streams, a second thread that way raised CPU per message by a tenth and
//! the added first-token time with it (docs/PERFORMANCE.md). In a shard both
//! tasks are on one thread, as with a single thread, and the shards work
//! side by side when calls start in a burst. Shard 0 is the runtime the
//! sidecar already runs on (the driver's), so one thread, the default, is
//! exactly the single-threaded sidecar: on cores shared with the engine a
//! second thread takes from the engine what it gives the bursts
//! (docs/PERFORMANCE-LOG.md, "Request-plane threads").
//!
//! A caller connection goes to the shard with the fewest caller connections
//! open. An engine connection lives on the shard of the call that opened it,
//! and calls prefer their own shard's connections ([`current`]); the engine
//! connections and streams the sidecar may hold are counted across shards,
//! so a shard out of its own connections uses another's.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

thread_local! {
    /// The shard this thread runs; 0 off the shards' own threads.
    static SHARD: Cell<usize> = const { Cell::new(0) };
}

/// Most request-plane threads `--worker-threads auto` chooses: the sidecar's
/// share of a node is small beside the engine's, and every thread opens
/// engine connections of its own.
const AUTO_MAX_THREADS: usize = 4;

/// Request-plane threads for `--worker-threads auto`: one per CPU
/// the process may use (std reads its affinity and cgroup CPU quota), at
/// most [`AUTO_MAX_THREADS`].
pub fn auto_worker_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(AUTO_MAX_THREADS)
}

/// The shard running the calling code: 0 on the sidecar's own runtime.
pub(crate) fn current() -> usize {
    SHARD.with(Cell::get)
}

/// The request plane's shards. The threads stop once this is dropped: when
/// the listener has stopped and the last caller connection has ended (each
/// holds its [`ShardSlot`]).
pub(crate) struct Shards {
    /// Each shard's runtime; the first is the sidecar's own.
    handles: Vec<Handle>,
    /// Caller connections open on each shard.
    open: Vec<AtomicUsize>,
    /// Ends the shards' threads.
    stop: CancellationToken,
}

impl Shards {
    /// `threads` shards: the calling runtime and `threads - 1` threads of
    /// their own. Called from within the sidecar's runtime.
    pub(crate) fn start(threads: usize) -> std::io::Result<Arc<Shards>> {
        let stop = CancellationToken::new();
        let mut handles = vec![Handle::current()];
        for shard in 1..threads.max(1) {
            match start_thread(shard, stop.clone()) {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    stop.cancel();
                    return Err(e);
                }
            }
        }
        let open = handles.iter().map(|_| AtomicUsize::new(0)).collect();
        Ok(Arc::new(Shards {
            handles,
            open,
            stop,
        }))
    }

    /// The shard with the fewest caller connections open, for a new one;
    /// the connection holds the returned slot while it lives.
    pub(crate) fn pick(self: &Arc<Self>) -> ShardSlot {
        let shard = (0..self.open.len())
            .min_by_key(|&i| self.open[i].load(Ordering::Acquire))
            .unwrap_or(0);
        self.open[shard].fetch_add(1, Ordering::AcqRel);
        ShardSlot {
            shards: self.clone(),
            shard,
        }
    }
}

/// Starts shard `shard`'s thread and its runtime, which runs until `stop`.
/// The runtime is built on its thread and dropped there: a runtime dropped
/// in the async code that asked for it would panic.
fn start_thread(shard: usize, stop: CancellationToken) -> std::io::Result<Handle> {
    let (built, handle) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(format!("request-plane-{shard}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = built.send(Err(e));
                    return;
                }
            };
            let _ = built.send(Ok(runtime.handle().clone()));
            SHARD.with(|s| s.set(shard));
            runtime.block_on(stop.cancelled());
        })?;
    // Waits the moment it takes a thread to build its runtime.
    handle
        .recv()
        .map_err(|_| std::io::Error::other("the thread ended before its runtime started"))?
}

impl Drop for Shards {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A caller connection's place on a shard.
pub(crate) struct ShardSlot {
    shards: Arc<Shards>,
    shard: usize,
}

impl ShardSlot {
    /// The shard's runtime (shard 0's is the runtime accepting).
    pub(crate) fn handle(&self) -> &Handle {
        &self.shards.handles[self.shard]
    }
}

impl Drop for ShardSlot {
    fn drop(&mut self) {
        self.shards.open[self.shard].fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connections_go_to_the_least_loaded_shard_and_run_on_its_thread() {
        let shards = Shards::start(3).expect("shards");
        let a = shards.pick();
        let b = shards.pick();
        let c = shards.pick();
        assert_eq!([a.shard, b.shard, c.shard], [0, 1, 2]);
        drop(b);
        let d = shards.pick();
        assert_eq!(
            d.shard, 1,
            "the shard a connection left is the least loaded"
        );
        let on = d.handle().spawn(async { current() }).await.expect("ran");
        assert_eq!(on, 1, "a task spawned on shard 1 sees itself there");
        let on = a.handle().spawn(async { current() }).await.expect("ran");
        assert_eq!(on, 0, "shard 0 is the accepting runtime");
        assert_eq!(current(), 0);
    }

    #[test]
    fn the_threads_end_once_the_last_slot_is_gone() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let (stop, slot) = rt.block_on(async {
            let shards = Shards::start(2).expect("shards");
            (shards.stop.clone(), shards.pick())
        });
        assert!(!stop.is_cancelled(), "held by the slot");
        drop(slot);
        assert!(stop.is_cancelled(), "the last slot stops the threads");
    }
}
