//! loom model of the admission gate and in-flight counter (core/src/gate.rs):
//! under every interleaving (within the preemption bound) of two callers and
//! the closer, no call is admitted after the gate closed, and "drained" is
//! signalled exactly once, when no admitted call is left.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p llm-sidecar-proptests --test loom --release`
#![cfg(loom)]

use std::sync::atomic::AtomicUsize as StdCounter;

use llm_sidecar_core::gate::Gate;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use loom::thread;

static INTERLEAVINGS: StdCounter = StdCounter::new(0);

#[derive(Default)]
struct Observed {
    /// Callers between a successful enter and their leave (test bookkeeping).
    inside: AtomicUsize,
    /// Calls forwarded to the engine.
    forwarded: AtomicUsize,
    /// Drained signals seen, from the closer or a leaving caller.
    drained: AtomicUsize,
    /// Set by the closer once `close()` has returned.
    closed: AtomicBool,
}

fn caller(gate: &Gate, seen: &Observed) {
    let closed_before = seen.closed.load(SeqCst);
    if gate.try_enter() {
        assert!(!closed_before, "a call was admitted after the gate closed");
        assert_eq!(
            seen.drained.load(SeqCst),
            0,
            "a call was admitted after the drain completed"
        );
        seen.inside.fetch_add(1, SeqCst);
        seen.forwarded.fetch_add(1, SeqCst);
        seen.inside.fetch_sub(1, SeqCst);
        let left = gate.leave();
        if left.drained {
            assert_eq!(
                seen.inside.load(SeqCst),
                0,
                "drained while a call was inside"
            );
            seen.drained.fetch_add(1, SeqCst);
        }
    }
}

fn model(callers: usize) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    let before = INTERLEAVINGS.load(std::sync::atomic::Ordering::Relaxed);
    builder.check(move || {
        INTERLEAVINGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let gate = Arc::new(Gate::new());
        gate.open();
        let seen = Arc::new(Observed::default());
        let handles: Vec<_> = (0..callers)
            .map(|_| {
                let (gate, seen) = (gate.clone(), seen.clone());
                thread::spawn(move || caller(&gate, &seen))
            })
            .collect();
        let closed = gate.close();
        seen.closed.store(true, SeqCst);
        if closed.drained {
            assert_eq!(
                seen.inside.load(SeqCst),
                0,
                "close reported drained with a call inside"
            );
            seen.drained.fetch_add(1, SeqCst);
        }
        for h in handles {
            h.join().expect("caller panicked");
        }
        assert_eq!(
            seen.drained.load(SeqCst),
            1,
            "drained must be signalled exactly once"
        );
        assert_eq!(gate.in_flight(), 0);
        assert!(!gate.try_enter(), "closed gate admitted a call");
    });
    let explored = INTERLEAVINGS.load(std::sync::atomic::Ordering::Relaxed) - before;
    println!("loom: {callers} callers + closer: {explored} interleavings explored");
}

#[test]
fn two_callers_and_the_closer() {
    model(2);
}

#[test]
fn three_callers_and_the_closer() {
    model(3);
}
