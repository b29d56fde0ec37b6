//! The state diagram, derived from behaviour rather than drawn.
//!
//! Every state reachable within a few steps is driven with every event kind;
//! each change of state becomes an edge labelled with the events that cause it.
//! The rendered Mermaid is committed as `docs/state-diagram.md`, and a test
//! fails when the machine and the committed picture disagree.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use llm_sidecar_core::{Config, ExitReason, OnEngineLoss, Phase};

use crate::{AbstractEvent, Harness, test_config};

/// How deep the derivation explores from the initial state.
pub const DEPTH: usize = 7;

fn node(phase: Phase) -> (&'static str, &'static str) {
    match phase {
        Phase::Starting => ("Starting", "Starting"),
        Phase::Serving => ("Serving", "Serving"),
        Phase::Draining => ("Draining", "Draining"),
        Phase::Lost => ("Lost", "Lost"),
        Phase::Exited(ExitReason::Clean) => ("Exited0", "Exited { code: 0 }"),
        Phase::Exited(ExitReason::EngineLost) => ("Exited1", "Exited { code: 1 }"),
        Phase::Exited(ExitReason::StartupFailed) => ("Exited3", "Exited { code: 3 }"),
    }
}

fn label(event: AbstractEvent, timer_reason: Option<&'static str>) -> String {
    match (event, timer_reason) {
        (AbstractEvent::FireNextTimer, Some(reason)) => format!("timer: {reason}"),
        (other, _) => format!("{other:?}"),
    }
}

/// Edges `(from, to) -> labels` of both policies: those only
/// `--on-engine-loss rejoin` has are labelled `[rejoin]`.
pub fn edges() -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut all = edges_of(test_config());
    let rejoin = edges_of(Config {
        on_engine_loss: OnEngineLoss::Rejoin,
        ..test_config()
    });
    for (edge, labels) in rejoin {
        let known = all.get(&edge).cloned().unwrap_or_default();
        let entry = all.entry(edge).or_default();
        for label in labels.difference(&known) {
            entry.insert(format!("{label} [rejoin]"));
        }
    }
    all
}

/// Edges `(from, to) -> labels` under `config`, from exploring `DEPTH` steps.
fn edges_of(config: Config) -> BTreeMap<(String, String), BTreeSet<String>> {
    let kinds: Vec<AbstractEvent> = AbstractEvent::ALL
        .into_iter()
        .filter(|e| !matches!(e, AbstractEvent::WaitShort | AbstractEvent::WaitLong))
        .collect();
    let mut edges: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    let mut seen = HashSet::new();
    let mut frontier = vec![Harness::new(config)];
    for _ in 0..DEPTH {
        let mut next = Vec::new();
        for h in &frontier {
            for &kind in &kinds {
                let mut h2 = h.clone();
                let before = h2.lifecycle.phase();
                let reason = h2.lifecycle.poll_timeout().map(|(_, r)| r);
                match h2.step(kind) {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(v) => panic!("{v}"),
                }
                let after = h2.lifecycle.phase();
                if before != after {
                    edges
                        .entry((node(before).0.to_string(), node(after).0.to_string()))
                        .or_default()
                        .insert(label(kind, reason));
                }
                if seen.insert(h2.fingerprint()) {
                    next.push(h2);
                }
            }
        }
        frontier = next;
    }
    edges
}

/// The committed document: Mermaid diagram plus the edge table.
pub fn render() -> String {
    let edges = edges();
    let mut out = String::new();
    out.push_str("# Lifecycle state diagram\n\n");
    out.push_str(
        "Generated from the machine's behaviour by `proptests/src/diagram.rs`: every state\n\
         reachable within a few steps is driven with every event kind, and each change of\n\
         state is drawn with the events that caused it; `[rejoin]` marks what only\n\
         `--on-engine-loss rejoin` does. Do not edit by hand; regenerate with\n\
         `UPDATE_SNAPSHOTS=1 cargo test -p llm-sidecar-proptests --test diagram`.\n\n",
    );
    out.push_str("```mermaid\nstateDiagram-v2\n");
    let mut nodes = BTreeSet::new();
    for (from, to) in edges.keys() {
        nodes.insert(from.clone());
        nodes.insert(to.clone());
    }
    for phase in [
        Phase::Starting,
        Phase::Serving,
        Phase::Draining,
        Phase::Lost,
        Phase::Exited(ExitReason::Clean),
        Phase::Exited(ExitReason::EngineLost),
        Phase::Exited(ExitReason::StartupFailed),
    ] {
        let (id, name) = node(phase);
        if nodes.contains(id) && id != name {
            out.push_str(&format!("    state \"{name}\" as {id}\n"));
        }
    }
    out.push_str("    [*] --> Starting\n");
    for ((from, to), labels) in &edges {
        let joined: Vec<&str> = labels.iter().map(String::as_str).collect();
        out.push_str(&format!("    {from} --> {to}: {}\n", joined.join(", ")));
    }
    for id in ["Exited0", "Exited1", "Exited3"] {
        if nodes.contains(id) {
            out.push_str(&format!("    {id} --> [*]\n"));
        }
    }
    out.push_str("```\n\n## Transitions\n\n| from | to | events |\n|---|---|---|\n");
    for ((from, to), labels) in &edges {
        let joined: Vec<&str> = labels.iter().map(String::as_str).collect();
        out.push_str(&format!("| {from} | {to} | {} |\n", joined.join(", ")));
    }
    out
}
