//! Exhaustive exploration: every sequence of abstract events up to `DEPTH`,
//! from the initial state, with the invariants checked after every step.
//!
//! States are merged by fingerprint (machine, world and checker, times taken
//! relative to now), so each distinct state is expanded once per depth while the
//! number of sequences it stands for is carried along as a multiplicity.

use std::collections::HashMap;
use std::collections::HashSet;

use llm_sidecar_proptests::{AbstractEvent, Harness};

const DEPTH: usize = 9;

#[test]
fn every_sequence_up_to_depth_keeps_the_invariants() {
    // fingerprint -> (representative, sequences reaching it, one such path)
    let mut frontier: HashMap<u64, (Harness, u128, Vec<AbstractEvent>)> = HashMap::new();
    let start = Harness::default();
    frontier.insert(start.fingerprint(), (start, 1, Vec::new()));
    let mut distinct: HashSet<u64> = frontier.keys().copied().collect();
    let mut sequences: u128 = 0;
    let mut steps: u64 = 0;
    let mut phases = HashSet::new();
    for depth in 1..=DEPTH {
        let mut next: HashMap<u64, (Harness, u128, Vec<AbstractEvent>)> = HashMap::new();
        for (harness, count, path) in frontier.values() {
            for kind in AbstractEvent::ALL {
                let mut h = harness.clone();
                steps += 1;
                match h.step(kind) {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(v) => {
                        let mut p = path.clone();
                        p.push(kind);
                        panic!("{v}\npath: {p:?}");
                    }
                }
                sequences += count;
                phases.insert(format!("{:?}", h.lifecycle.phase()));
                let fp = h.fingerprint();
                distinct.insert(fp);
                match next.get_mut(&fp) {
                    Some(entry) => entry.1 += count,
                    None => {
                        let mut p = path.clone();
                        p.push(kind);
                        next.insert(fp, (h, *count, p));
                    }
                }
            }
        }
        println!(
            "depth {depth}: {} distinct states on the frontier",
            next.len()
        );
        frontier = next;
    }
    println!(
        "explorer: depth {DEPTH}, {sequences} event sequences of 1..={DEPTH} deliverable events \
         checked, {} distinct states, {steps} steps executed, phases reached: {:?}",
        distinct.len(),
        {
            let mut p: Vec<_> = phases.into_iter().collect();
            p.sort();
            p
        }
    );
    assert!(
        distinct.len() > 100,
        "the explorer should reach many states"
    );
}
