//! Behind Dynamo's frontend with `--router-mode kv`: the engine's KV events
//! reach Dynamo's router through the worker, so a request goes to the
//! engine that already holds its prefix; a publisher that falls silent stops
//! being trusted; an engine lost while its worker is routed by KV leaves
//! the other worker serving everything (docs/DYNAMO.md).

use std::time::{Duration, Instant};

use crate::support::*;
use crate::{HANG, Setup, wait_until};

/// The shared prefix: 256 tokens, eight of the mock engine's 32-token blocks.
fn prefix() -> String {
    (0..256).map(|i| format!("w{} ", 1000 + i)).collect()
}

/// A prompt of the shared prefix and a suffix of its own.
fn prompt(n: u32) -> String {
    format!("{}w{} w{}", prefix(), 5000 + n, 6000 + n)
}

fn started(engine: &Engine) -> u64 {
    engine.stats()["generate_started"].as_u64().unwrap_or(0)
}

/// The router's KV hit rate histogram on the frontend's `/metrics`: its
/// sum and count (the share of each routed request's prompt blocks the
/// router believed cached on the worker it chose).
fn kv_hit_rate(frontend: &Frontend) -> (f64, f64) {
    let page = frontend.metrics();
    let value = |suffix: &str| {
        page.lines()
            .filter(|l| l.contains("kv_hit_rate") && !l.starts_with('#'))
            .filter(|l| {
                l.split(['{', ' '])
                    .next()
                    .is_some_and(|n| n.ends_with(suffix))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    (value("_sum"), value("_count"))
}

/// Two workers behind the frontend's KV router, and a first request with
/// the shared prefix whose blocks have reached the router's index: the
/// setup and the index of the engine that served that request.
fn primed(name: &str, token_delay: &str) -> (Setup, usize) {
    let s = Setup::start_with(name, 2, false, token_delay, &[], &["--router-mode", "kv"]);
    let first = route(&s, &prompt(0));
    // The engine's events reach the router's index through the worker.
    wait_until(HANG, "the first engine's blocks to be published", || {
        s.engines[first].stats()["kv_events"]["events"].as_u64() >= Some(1)
    });
    std::thread::sleep(Duration::from_millis(500));
    (s, first)
}

/// Sends one short completion; the index of the engine that served it.
fn route(s: &Setup, text: &str) -> usize {
    let before: Vec<u64> = s.engines.iter().map(started).collect();
    let (status, body) = s
        .frontend
        .post("/v1/completions", &completion(&s.model, text, 2, false));
    assert_eq!(status, 200, "{body}");
    let after: Vec<u64> = s.engines.iter().map(started).collect();
    (0..s.engines.len())
        .find(|i| after[*i] > before[*i])
        .expect("an engine served the request")
}

#[test]
fn the_kv_router_sends_requests_sharing_a_prefix_to_the_engine_that_holds_it() {
    let (s, first) = primed("dyn-kv-affinity", "1ms");
    let (sum0, count0) = kv_hit_rate(&s.frontend);
    let mut to_first = 0;
    for n in 1..50 {
        if route(&s, &prompt(n)) == first {
            to_first += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (sum, count) = kv_hit_rate(&s.frontend);
    let hit_rate = (sum - sum0) / (count - count0).max(1.0);
    eprintln!(
        "prefix affinity: {}/49 after the first went to its engine; the router's mean KV hit \
         rate for them {hit_rate:.2}",
        to_first
    );
    assert!(
        to_first >= 44,
        "at least 90% of the 49 followed the first: {to_first}"
    );
    assert!(
        hit_rate > 0.5,
        "the router credited the chosen engine with the prefix's blocks: {hit_rate}"
    );
}

#[test]
fn a_silent_kv_event_publisher_stops_being_trusted_within_three_heartbeats() {
    let (s, first) = primed("dyn-kv-silent", "1ms");
    let (sum0, count0) = kv_hit_rate(&s.frontend);
    assert_eq!(route(&s, &prompt(1)), first);
    let (sum1, count1) = kv_hit_rate(&s.frontend);
    assert!(
        sum1 - sum0 > 0.5 && count1 - count0 == 1.0,
        "trusted, the prefix counts as cached: {}",
        sum1 - sum0
    );
    // The engine's publisher falls silent (heartbeat 1 s): within three
    // intervals the worker says so and the router forgets its blocks.
    let heartbeat = Duration::from_secs(1);
    s.engines[first].control("/kv-events?publish=off");
    let silenced = Instant::now();
    let line = "the engine's KV events have been silent";
    wait_until(HANG, "the worker to stop trusting the publisher", || {
        s.workers[first].proc.log_text().contains(line)
    });
    let noticed = silenced.elapsed();
    eprintln!("silent publisher noticed {noticed:?} after it stopped (heartbeat {heartbeat:?})");
    assert!(
        noticed < heartbeat * 3 + Duration::from_millis(1500),
        "noticed within three heartbeat intervals (and the last one's age): {noticed:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let (sum2, count2) = kv_hit_rate(&s.frontend);
    route(&s, &prompt(2));
    let (sum3, count3) = kv_hit_rate(&s.frontend);
    assert_eq!(count3 - count2, 1.0);
    assert!(
        sum3 - sum2 < 1e-9,
        "untrusted, the router credits no worker with the prefix: hit rate {}",
        sum3 - sum2
    );
    // Events again: the next request's blocks are learned anew.
    s.engines[first].control("/kv-events?publish=on");
    wait_until(HANG, "the worker to hear the publisher again", || {
        s.workers[first]
            .proc
            .log_text()
            .contains("KV events resumed")
    });
}

#[test]
fn an_engine_killed_while_the_kv_router_prefers_it_leaves_the_other_worker_serving_everything() {
    let (mut s, first) = primed("dyn-kv-loss", "2ms");
    let other = 1 - first;
    for n in 1..6 {
        assert_eq!(
            route(&s, &prompt(n)),
            first,
            "the router prefers the prefix's engine"
        );
    }
    let instance = s.engines[first].stats()["instance_id"]
        .as_str()
        .expect("the engine's instance id")
        .to_string();
    let killed = Instant::now();
    s.engines[first].proc.signal("KILL");
    wait_until(HANG, "the lost worker's records to leave discovery", || {
        s.store.keys_of(&s.ids[first]).is_empty()
    });
    let withdrawn = killed.elapsed();
    s.workers[first]
        .proc
        .assert_engine_lost("TensorRT-LLM", &instance, "liveness stream");
    let before = started(&s.engines[other]);
    for n in 10..30 {
        let (status, body) = s.frontend.post(
            "/v1/completions",
            &completion(&s.model, &prompt(n), 2, false),
        );
        assert_eq!(status, 200, "request {n} after the withdrawal: {body}");
    }
    assert_eq!(
        started(&s.engines[other]) - before,
        20,
        "the other worker served every request with the prefix"
    );
    assert_eq!(
        s.workers[first].proc.wait_exit(HANG),
        1,
        "the lost worker exits 1"
    );
    eprintln!("KV mode: the lost worker's records gone {withdrawn:?} after the kill");
}
