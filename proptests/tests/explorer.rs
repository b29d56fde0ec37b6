//! Exhaustive exploration to a fixpoint: from the initial state, every abstract
//! event is tried in every reachable state until no new state appears, with
//! the invariants checked after every step.
//!
//! The time abstraction. States are merged by fingerprint (machine, world and
//! checker, every time taken relative to now, clocks no state reads again left
//! out; see `Lifecycle::fingerprint`). Every setting is a whole number of
//! [`TICK`]s and time only moves in whole ticks (`WaitShort` is one tick,
//! `WaitLong` three, `FireNextTimer` jumps to a deadline, itself on a tick).
//! The machine only acts at deadlines, so an input anywhere between two
//! deadlines behaves as one right after the first of them; inputs at the same
//! instant as a deadline, and waits past several deadlines at once, are in the
//! space. What the lattice leaves out is an input off it, arming deadlines off
//! it too (a signal 0.3 ticks after a probe): the fuzzer, which moves time in
//! 10 ms steps with random settings, covers those orderings.
//!
//! Under that abstraction, and with at most [`CALL_CAP`] calls in flight, the
//! state space is finite: every stored time lies within a bounded window
//! around now (deadlines ahead of it fire, a fresh probe behind it goes
//! stale), on a lattice of ticks. The search therefore ends; [`STATE_LIMIT`]
//! only turns a bug in that argument into a clear failure instead of a hang.

use std::collections::HashSet;
use std::collections::VecDeque;
use std::time::Duration;

use llm_sidecar_core::{Config, OnEngineLoss};
use llm_sidecar_proptests::{AbstractEvent, Harness};

/// The unit every setting and every wait is a whole number of.
const TICK: Duration = Duration::from_millis(500);

/// Production's order (retry < grace < drain < stale < re-registration <
/// startup), in ticks.
fn config(on_engine_loss: OnEngineLoss) -> Config {
    Config {
        retry_interval: 2 * TICK,
        router_grace: 3 * TICK,
        drain_timeout: 5 * TICK,
        stale_after: 7 * TICK,
        startup_deadline: 11 * TICK,
        reregister_deadline: 9 * TICK,
        on_engine_loss,
        ..llm_sidecar_proptests::test_config()
    }
}

/// The abstraction of the call count: none, one, or two at once.
const CALL_CAP: u64 = 2;

/// More distinct states than this means the space is not finite after all.
const STATE_LIMIT: usize = 20_000_000;

#[test]
fn every_reachable_state_keeps_the_invariants() {
    explore(OnEngineLoss::Exit);
}

/// The same with `--on-engine-loss rejoin`: a loss leads back to Starting, so
/// every path after it is explored again from there (instance ids are names,
/// left out of the fingerprint, so the space stays finite).
#[test]
fn every_reachable_state_keeps_the_invariants_with_rejoin() {
    explore(OnEngineLoss::Rejoin);
}

fn explore(policy: OnEngineLoss) {
    let mut start = Harness::new(config(policy));
    start.world.call_cap = CALL_CAP;
    start.world.waits = (TICK, 3 * TICK);
    let mut seen: HashSet<u64> = HashSet::new();
    seen.insert(start.fingerprint());
    // (state, its depth, one path that reaches it)
    let mut queue: VecDeque<(Harness, usize, Vec<AbstractEvent>)> = VecDeque::new();
    queue.push_back((start, 0, Vec::new()));
    let mut transitions: u64 = 0;
    let mut depth_reached = 0;
    let mut phases = HashSet::new();
    while let Some((harness, depth, path)) = queue.pop_front() {
        depth_reached = depth_reached.max(depth);
        for kind in AbstractEvent::ALL {
            let mut next = harness.clone();
            match next.step(kind) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(v) => {
                    let mut p = path.clone();
                    p.push(kind);
                    panic!("{v}\npath: {p:?}");
                }
            }
            transitions += 1;
            phases.insert(format!("{:?}", next.lifecycle.phase()));
            if seen.insert(next.fingerprint()) {
                assert!(
                    seen.len() <= STATE_LIMIT,
                    "more than {STATE_LIMIT} distinct states: the abstraction is not finite"
                );
                let mut p = path.clone();
                p.push(kind);
                queue.push_back((next, depth + 1, p));
            }
        }
    }
    let mut phases: Vec<_> = phases.into_iter().collect();
    phases.sort();
    println!(
        "explorer ({policy:?}): fixpoint reached: {} reachable states, {transitions} transitions, \
         longest shortest path {depth_reached} events, {} event kinds, at most {CALL_CAP} \
         calls in flight, tick {TICK:?}; phases reached: {phases:?}",
        seen.len(),
        AbstractEvent::ALL.len(),
    );
    assert_eq!(phases.len(), 7, "every phase and exit code is reached");
}
