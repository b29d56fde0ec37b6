//! Engine streams shared by need across caller addresses, and callers whose
//! answers wait in the sidecar, run in-process. Each test here was a process
//! test in `bin/tests/process/hardening.rs` of the same name and asserts what
//! it asserted there.

use std::net::SocketAddr;
use std::time::Duration;

use llm_sidecar_testkit::raw_h2::{self, RawH2};
use llm_sidecar_testkit::trtllm::{generate_or_give_up, raw_calls, zero_window_callers};

use crate::harness::*;

/// `work` with hand-written HTTP/2 callers, off the runtime's threads (their
/// sockets block).
async fn raw<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work)
        .await
        .expect("the raw callers ran")
}

/// Attack 3 of hardening round three, with tokens: 400 calls whose callers
/// set their window to zero, the engine streaming one token per DATA frame
/// (as engines do) every millisecond. h2 charges each small frame it holds
/// unread against a budget of its connection; left unread in h2, the stalled
/// answers spent it, and h2 failed the engine connection
/// (`too_many_data_frames`) and the call streaming beside them. The relay
/// now reads them out of h2 and holds them itself, the engine's window kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_window_callers_of_token_streams_kill_no_engine_connection() {
    let (_engine, worker) = serving(|e| e.token_delay = Duration::from_millis(1), |_| {}).await;
    let listen = worker.listen;
    let streaming =
        tokio::spawn(async move { generate_or_give_up(listen, "streaming", 4_000).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stalled = raw(move || zero_window_callers(listen, 200)).await;
    assert_eq!(
        streaming.await.expect("streaming caller"),
        Ok(4_001),
        "a call streaming beside 400 stalled calls gets all of its tokens"
    );
    let held = worker
        .metric("llm_sidecar_answer_bytes_held")
        .await
        .unwrap_or(0.0);
    println!("{held} bytes of answers held for 400 callers that do not read");
    assert!(held > 0.0, "the stalled answers are held by the sidecar");
    drop(stalled);
    worker.stop_cleanly().await;
}

/// `calls` Generate calls of 1,000 tokens on each of `connections`
/// connections from `address`: at the tests' 100 ms per token, none ends
/// while a test looks.
async fn hold_streams(
    listen: SocketAddr,
    address: &'static str,
    connections: u32,
    calls: u32,
) -> Vec<RawH2> {
    raw(move || {
        let source: std::net::IpAddr = address.parse().expect("address");
        (0..connections)
            .map(|c| {
                raw_calls(listen, source, &[], calls, 1_000, |n| {
                    format!("{address}-{c}-{n}")
                })
            })
            .collect()
    })
    .await
}

/// Reads `raw`'s frames until `n` of its streams have been answered (their
/// response HEADERS came) or the hang guard passes; how many were.
fn streams_answered(raw: &mut RawH2, n: usize) -> usize {
    let mut answered = std::collections::HashSet::new();
    let start = std::time::Instant::now();
    while answered.len() < n && start.elapsed() < HANG {
        match raw.read_frame() {
            Ok(f) if f.kind == raw_h2::HEADERS => {
                answered.insert(f.stream);
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    answered.len()
}

/// Waits until the engine has started `n` Generate calls, then a moment more
/// for any it should not have; returns how many it started.
async fn engine_started_settled(engine: &Engine, n: u64) -> u64 {
    let started = || async {
        engine.stats().await["generate_started"]
            .as_u64()
            .unwrap_or(0)
    };
    let start = std::time::Instant::now();
    while started().await < n && start.elapsed() < HANG {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    started().await
}

/// An engine of 20 streams per connection at 100 ms per token.
fn twenty_streams_slow(e: &mut llm_sidecar_mock_engine::MockConfig) {
    e.max_concurrent_streams = Some(20);
    e.token_delay = Duration::from_millis(100);
}

/// Attack 6 of hardening round three, across connections: one address opens
/// four connections of 40 calls each. Counted per connection only, they held
/// every engine stream and a call from another address got no answer while
/// `/ready` said 200. With `--engine-connections 4` on an engine of 20
/// streams per connection (80 in all), callers take 40 before they compete:
/// the address alone takes those 40, and another address is answered at once
/// from the 40 kept for callers under their share. (The sidecar's default
/// does not cap an address that is alone, which
/// `one_address_alone_gets_every_engine_stream_it_asks_for` shows.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_on_many_connections_holds_no_more_engine_streams_than_one_connection_may() {
    let (engine, worker) = serving(twenty_streams_slow, |w| {
        w.limits.engine_connections = Some(4)
    })
    .await;
    let listen = worker.listen;
    let held = hold_streams(listen, "127.0.0.2", 4, 40).await;
    assert_eq!(
        engine_started_settled(&engine, 40).await,
        40,
        "one address holds 40 engine streams, on any number of connections"
    );
    assert_eq!(
        generate_or_give_up(listen, "another-caller", 2).await,
        Ok(3),
        "a caller at another address is answered beside the holder's 160 calls"
    );
    drop(held);
    worker.stop_cleanly().await;
}

/// Fairness is not a ceiling (issue 38): on default flags, one address —
/// a router — alone takes every engine stream it asks for, on an engine of
/// 20 streams per connection, through as many engine connections as that
/// takes. A per-address budget of half the pool held it to 40 of its 160.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_alone_gets_every_engine_stream_it_asks_for() {
    let (engine, worker) = serving(twenty_streams_slow, |_| {}).await;
    let held = hold_streams(worker.listen, "127.0.0.2", 4, 40).await;
    assert_eq!(
        engine_started_settled(&engine, 160).await,
        160,
        "one address alone has all 160 of its calls at the engine"
    );
    drop(held);
    worker.stop_cleanly().await;
}

/// When engine streams run short, a hostile address that took all it could
/// while alone starves nobody: each newcomer gets its fair share at once,
/// what is over its share waits, and waiting calls go on as streams end.
/// `--engine-connections 4` on an engine of 20 streams per connection: 40
/// before callers compete, 80 in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_engine_streams_run_short_each_address_gets_its_share_at_once() {
    let (engine, worker) = serving(twenty_streams_slow, |w| {
        w.limits.engine_connections = Some(4)
    })
    .await;
    let listen = worker.listen;
    let hostile = hold_streams(listen, "127.0.0.2", 4, 40).await;
    assert_eq!(
        engine_started_settled(&engine, 40).await,
        40,
        "the hostile address"
    );
    // A second address asks for 30: its share of 40 between two is 20.
    let mut second = hold_streams(listen, "127.0.0.3", 1, 30).await;
    assert_eq!(
        engine_started_settled(&engine, 60).await,
        60,
        "the second address gets its share, 20, at once, and no more"
    );
    assert_eq!(
        generate_or_give_up(listen, "a-third-address", 2).await,
        Ok(3),
        "a third address is answered at once beside both"
    );
    // The hostile address goes: its 40 streams end, and the second
    // address's 10 waiting calls reach the engine and are answered. (Counted
    // on the second's own connection: the hostile's four connections close
    // one by one, and a waiting call of one still open may start at the
    // engine in between, as it should while its caller is there.)
    drop(hostile);
    let answered = raw(move || streams_answered(&mut second[0], 30)).await;
    assert_eq!(
        answered, 30,
        "the second address's waiting calls go on as streams end"
    );
    worker.stop_cleanly().await;
}
