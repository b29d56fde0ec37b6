//! The calls of one caller connection, run inside that connection's task.
//!
//! Why not a task per call, as hyper's server spawns: a token on its way from
//! the engine to a caller then crosses three tasks (the engine connection's,
//! the call's, the caller connection's), each a turn in the runtime's queue
//! behind every relay of that moment, and a new call waits for its own task's
//! first turn before its request leaves for the engine. Here a call is a
//! future the caller connection's task polls itself: once as soon as its
//! stream arrives (the request is on its way to the engine before the
//! connection reads on), and again whenever something it waits for wakes it,
//! after which the connection writes what the calls queued in the same turn.
//! A token crosses two tasks. (docs/PERFORMANCE-LOG.md, "The caller side on h2".)
//!
//! Each call has its own waker, which puts the call on the connection's woken
//! list and wakes the connection's task once for any number of calls; a turn
//! polls exactly the calls on the list, never all of them.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

/// One call: everything from its request headers to the end of its stream.
pub(crate) type Call = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The calls of one connection. Dropping it drops every call still running
/// (each then ends as its own drop decides: a caller gone, the engine
/// stream reset).
pub(crate) struct Calls {
    slots: Vec<Option<Slot>>,
    /// Slots free for the next call.
    free: Vec<usize>,
    /// Tells a call from an earlier one in the same slot, so that a stale
    /// waker never polls the wrong call.
    next_generation: u64,
    shared: Arc<Shared>,
    /// The woken list taken at the start of a turn, kept for its capacity.
    turn: Vec<(usize, u64)>,
}

struct Slot {
    call: Call,
    generation: u64,
    wake: Arc<CallWake>,
    waker: Waker,
}

/// What the wakers and the connection's task share.
struct Shared(Mutex<Woken>);

struct Woken {
    calls: Vec<(usize, u64)>,
    /// The connection's task.
    connection: Option<Waker>,
    /// The connection's task was woken since its last turn began.
    notified: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Woken> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One call's waker.
struct CallWake {
    index: usize,
    generation: u64,
    /// On the woken list already: a second wake before the call's next poll
    /// adds nothing.
    queued: AtomicBool,
    shared: Arc<Shared>,
}

impl Wake for CallWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut woken = self.shared.lock();
        woken.calls.push((self.index, self.generation));
        if !woken.notified {
            woken.notified = true;
            if let Some(connection) = &woken.connection {
                connection.wake_by_ref();
            }
        }
    }
}

impl Calls {
    pub(crate) fn new() -> Self {
        Calls {
            slots: Vec::new(),
            free: Vec::new(),
            next_generation: 0,
            shared: Arc::new(Shared(Mutex::new(Woken {
                calls: Vec::new(),
                connection: None,
                notified: false,
            }))),
            turn: Vec::new(),
        }
    }

    /// Calls running now.
    #[cfg(test)]
    fn running(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Starts a call and polls it once, now. The connection's task must have
    /// begun its turn with [`Calls::run_woken`] (which tells the wakers whom
    /// to wake).
    pub(crate) fn start(&mut self, call: Call) {
        let generation = self.next_generation;
        self.next_generation += 1;
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let wake = Arc::new(CallWake {
            index,
            generation,
            queued: AtomicBool::new(false),
            shared: self.shared.clone(),
        });
        let waker = Waker::from(wake.clone());
        self.slots[index] = Some(Slot {
            call,
            generation,
            wake,
            waker,
        });
        self.poll_call(index, generation);
    }

    /// Begins a turn of the connection's task: from now on wakers wake `cx`'s
    /// task; then polls every call woken since the last turn. Returns how many
    /// were polled (what they queued is the connection's to write).
    pub(crate) fn run_woken(&mut self, cx: &Context<'_>) -> usize {
        {
            let mut woken = self.shared.lock();
            woken.notified = false;
            if !woken
                .connection
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                woken.connection = Some(cx.waker().clone());
            }
            std::mem::swap(&mut woken.calls, &mut self.turn);
        }
        let mut turn = std::mem::take(&mut self.turn);
        let polled = turn.len();
        for (index, generation) in turn.drain(..) {
            self.poll_call(index, generation);
        }
        self.turn = turn;
        polled
    }

    fn poll_call(&mut self, index: usize, generation: u64) {
        let Some(slot) = self.slots.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        if slot.generation != generation {
            return;
        }
        slot.wake.queued.store(false, Ordering::Release);
        let mut cx = Context::from_waker(&slot.waker);
        // A panic ends its own call only, as it would in a task of its own:
        // the call's drop still closes its account.
        let polled = catch_unwind(AssertUnwindSafe(|| slot.call.as_mut().poll(&mut cx)));
        let done = match polled {
            Ok(Poll::Pending) => false,
            Ok(Poll::Ready(())) => true,
            Err(_) => {
                tracing::error!("request plane: a call panicked; it was ended alone");
                true
            }
        };
        if done {
            self.slots[index] = None;
            self.free.push(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A call that counts its polls and ends once told.
    fn counting(
        polls: Arc<AtomicUsize>,
        done: Arc<AtomicBool>,
        waker: Arc<Mutex<Option<Waker>>>,
    ) -> Call {
        Box::pin(std::future::poll_fn(move |cx| {
            polls.fetch_add(1, Ordering::SeqCst);
            *waker.lock().unwrap() = Some(cx.waker().clone());
            if done.load(Ordering::SeqCst) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }))
    }

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_call_is_polled_at_start_and_then_only_when_woken() {
        let connection = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(connection.clone());
        let cx = Context::from_waker(&waker);
        let mut calls = Calls::new();
        assert_eq!(calls.run_woken(&cx), 0);
        let (polls, done, call_waker) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(None)),
        );
        calls.start(counting(polls.clone(), done.clone(), call_waker.clone()));
        assert_eq!(polls.load(Ordering::SeqCst), 1);
        assert_eq!(calls.run_woken(&cx), 0, "not woken: not polled");
        assert_eq!(polls.load(Ordering::SeqCst), 1);

        let w = call_waker.lock().unwrap().clone().unwrap();
        w.wake_by_ref();
        w.wake_by_ref();
        assert!(
            connection.0.load(Ordering::SeqCst),
            "the connection's task is woken"
        );
        assert_eq!(calls.run_woken(&cx), 1, "two wakes, one poll");
        assert_eq!(polls.load(Ordering::SeqCst), 2);

        done.store(true, Ordering::SeqCst);
        w.wake_by_ref();
        calls.run_woken(&cx);
        assert_eq!(calls.running(), 0);
        // A stale waker of the finished call never polls the next one in its slot.
        let polls2 = Arc::new(AtomicUsize::new(0));
        calls.start(counting(
            polls2.clone(),
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(None)),
        ));
        w.wake_by_ref();
        calls.run_woken(&cx);
        assert_eq!(polls2.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_panicking_call_ends_alone() {
        let waker = Waker::from(Arc::new(Flag(AtomicBool::new(false))));
        let cx = Context::from_waker(&waker);
        let mut calls = Calls::new();
        calls.run_woken(&cx);
        let polls = Arc::new(AtomicUsize::new(0));
        calls.start(counting(
            polls.clone(),
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(None)),
        ));
        calls.start(Box::pin(async { panic!("a call's panic, on purpose") }));
        assert_eq!(calls.running(), 1);
    }
}
