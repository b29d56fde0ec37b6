//! The call account: what the clients saw, what the engine saw (its journal)
//! and what the sidecar counted (its account at exit) must agree exactly.
//!
//! A [`Load`] sends Generate calls with unique ids through the sidecar and
//! records how each one ended, as a caller can tell it from the status:
//!
//! | outcome | what the caller got |
//! |---|---|
//! | `ok` | the stream ended OK |
//! | `engine_status` | the status the engine was asked to fail with (`error:<code>:` ids) |
//! | `refused` | UNAVAILABLE "draining": never forwarded |
//! | `cut` | UNAVAILABLE "drain deadline reached…" |
//! | `engine_failed` | UNAVAILABLE "engine stream failed…" / "engine unavailable…" |
//! | `cancelled` | the caller dropped the call itself |
//! | `not_sent` | the call never left the caller: nothing listened on its port (between two runs), or hyper dropped it from its queue as the connection was closing ("operation was canceled") |
//! | `goaway` | the sidecar's exit sent GOAWAY under the call: its stream was above the GOAWAY's last id, or hyper's client failed a request it had just written (see [`FAILED_BY_GOAWAY`]) |
//! | `reset` | the connection failed under the call at the sidecar's exit ("transport error") |
//!
//! Anything else is `unexplained` and fails the reconciliation.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_engine_api::trtllm::{GenerateRequest, TokenizedInput};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

/// How one call ended, seen from the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    Ok,
    EngineStatus,
    /// The engine's own graceful stop cancelled the call at the end of its
    /// grace (UNAVAILABLE "Cancelling all calls", relayed as the engine sent it).
    EngineStopped,
    Refused,
    Cut,
    EngineFailed,
    Cancelled,
    NotSent,
    GoAway,
    Reset,
    Unexplained(String),
}

impl Seen {
    pub fn label(&self) -> &'static str {
        match self {
            Seen::Ok => "ok",
            Seen::EngineStatus => "engine_status",
            Seen::EngineStopped => "engine_stopped",
            Seen::Refused => "refused",
            Seen::Cut => "cut",
            Seen::EngineFailed => "engine_failed",
            Seen::Cancelled => "cancelled",
            Seen::NotSent => "not_sent",
            Seen::GoAway => "goaway",
            Seen::Reset => "reset",
            Seen::Unexplained(_) => "unexplained",
        }
    }

    fn forwarded(&self) -> bool {
        matches!(
            self,
            Seen::Ok
                | Seen::EngineStatus
                | Seen::EngineStopped
                | Seen::Cut
                | Seen::EngineFailed
                | Seen::Cancelled
        )
    }
}

/// What the load sends.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Concurrent callers.
    pub concurrency: usize,
    /// Tokens per ordinary call.
    pub tokens: u32,
    /// Every n-th call asks the engine to fail with FAILED_PRECONDITION (0: never).
    pub error_every: u64,
    /// Every n-th call is long and dropped by the caller after `cancel_after` (0: never).
    pub cancel_every: u64,
    pub cancel_after: Duration,
    /// Prefix of every request id, so two loads never share one.
    pub prefix: String,
}

impl Shape {
    /// One caller whose stream outlasts any drain: the sidecar then has a call
    /// in flight whenever it drains, until the drain deadline cuts it.
    pub fn long(prefix: &str) -> Self {
        Shape {
            concurrency: 1,
            tokens: 1_000_000,
            error_every: 0,
            cancel_every: 0,
            cancel_after: Duration::ZERO,
            prefix: prefix.to_string(),
        }
    }

    pub fn mixed(prefix: &str) -> Self {
        Shape {
            concurrency: 8,
            tokens: 8,
            error_every: 7,
            cancel_every: 11,
            cancel_after: Duration::from_millis(150),
            prefix: prefix.to_string(),
        }
    }
}

/// The callers' record: request id → outcome.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    pub calls: BTreeMap<String, Seen>,
}

impl Ledger {
    pub fn counts(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for seen in self.calls.values() {
            *out.entry(seen.label()).or_insert(0) += 1;
        }
        out
    }

    pub fn count(&self, label: &str) -> u64 {
        self.counts().get(label).copied().unwrap_or(0)
    }

    pub fn merge(&mut self, other: Ledger) {
        self.calls.extend(other.calls);
    }
}

/// Generate calls running in the background until [`Load::stop`].
pub struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Ledger>>,
}

impl Load {
    pub fn start(target: SocketAddr, shape: Shape) -> Load {
        let endpoint = Endpoint::from_shared(format!("http://{target}")).expect("endpoint");
        Load::start_on(endpoint, shape)
    }

    /// Load on any endpoint (e.g. `https://` with a TLS configuration).
    pub fn start_on(endpoint: Endpoint, shape: Shape) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(run(endpoint, shape, flag))
        });
        Load {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sending; waits for the calls in flight to end; returns the ledger.
    pub fn stop(mut self) -> Ledger {
        self.stop.store(true, Ordering::Release);
        self.thread
            .take()
            .expect("stopped once")
            .join()
            .expect("load thread")
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

async fn run(endpoint: Endpoint, shape: Shape, stop: Arc<AtomicBool>) -> Ledger {
    let channel = endpoint
        .connect_timeout(Duration::from_secs(1))
        .connect_lazy();
    let mut workers = Vec::new();
    for w in 0..shape.concurrency {
        let (channel, shape, stop) = (channel.clone(), shape.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut ledger = Ledger::default();
            let mut n: u64 = 0;
            while !stop.load(Ordering::Acquire) {
                n += 1;
                let (id, seen) = one_call(&channel, &shape, w, n).await;
                if matches!(seen, Seen::NotSent | Seen::GoAway | Seen::Reset) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                ledger.calls.insert(id, seen);
            }
            ledger
        }));
    }
    let mut ledger = Ledger::default();
    for w in workers {
        // A hang here is a call that never ended: the test's own timeout reports it.
        ledger.merge(w.await.expect("load worker"));
    }
    ledger
}

async fn one_call(channel: &Channel, shape: &Shape, worker: usize, n: u64) -> (String, Seen) {
    let base = format!("{}-{worker}-{n}", shape.prefix);
    let error = shape.error_every > 0 && n.is_multiple_of(shape.error_every);
    let cancel = !error && shape.cancel_every > 0 && n.is_multiple_of(shape.cancel_every);
    let id = if error {
        format!("error:9:{base}")
    } else {
        base
    };
    let request = GenerateRequest {
        request_id: id.clone(),
        tokenized: Some(TokenizedInput {
            original_text: String::new(),
            input_token_ids: vec![1, 2, 3],
        }),
        max_tokens: if cancel { 100_000 } else { shape.tokens },
        streaming: true,
    };
    let call = call_to_end(TrtllmServiceClient::new(channel.clone()), request);
    let result = if cancel {
        match tokio::time::timeout(shape.cancel_after, call).await {
            Ok(r) => r,
            Err(_) => return (id, Seen::Cancelled),
        }
    } else {
        call.await
    };
    let seen = match result {
        Ok(()) => Seen::Ok,
        Err((code, message)) => classify(code, &message, error.then_some(&id)),
    };
    (id, seen)
}

/// Marks a call failed by the sidecar's HTTP/2 GOAWAY (tonic reports those as
/// INTERNAL "h2 protocol error"). Mostly the stream id was above the last one
/// the GOAWAY promised to process, so it was never processed (RFC 9113 §6.8).
/// But hyper's client also fails a request it has just written if the first,
/// graceful GOAWAY lands before it polls the connection again: the sidecar
/// then received the call, and since it only closes connections at exit,
/// after admission closed, it refused it.
const FAILED_BY_GOAWAY: &str = "failed by GOAWAY";

/// Reads the stream to its end; `Err` carries the final status if not OK.
async fn call_to_end(
    mut client: TrtllmServiceClient<Channel>,
    request: GenerateRequest,
) -> Result<(), (Code, String)> {
    let status = |s: tonic::Status| {
        let mut source = std::error::Error::source(&s);
        while let Some(e) = source {
            if let Some(h2) = e.downcast_ref::<h2::Error>()
                && h2.is_go_away()
                && h2.is_remote()
                && h2.reason() == Some(h2::Reason::NO_ERROR)
            {
                return (s.code(), FAILED_BY_GOAWAY.to_string());
            }
            source = e.source();
        }
        (s.code(), s.message().to_string())
    };
    let mut stream = client.generate(request).await.map_err(status)?.into_inner();
    while stream.message().await.map_err(status)?.is_some() {}
    Ok(())
}

fn classify(code: Code, message: &str, requested_error: Option<&String>) -> Seen {
    if let Some(id) = requested_error {
        // The mock fails `error:9:<rest>` with FAILED_PRECONDITION and message `<rest>`.
        if code == Code::FailedPrecondition && id.ends_with(message) {
            return Seen::EngineStatus;
        }
    }
    match code {
        Code::Unavailable if message == "draining" => Seen::Refused,
        Code::Unavailable if message == "Cancelling all calls" => Seen::EngineStopped,
        Code::Unavailable if message.starts_with("drain deadline reached") => Seen::Cut,
        Code::Unavailable
            if message.starts_with("engine stream failed")
                || message.starts_with("engine unavailable") =>
        {
            Seen::EngineFailed
        }
        Code::Unavailable if message.contains("connect") => Seen::NotSent,
        // A new connection (after the GOAWAY) that the exiting sidecar's
        // kernel accepted and then reset, before the TLS handshake: the call
        // was never sent (the journal check below proves the engine never saw it).
        Code::Unavailable if message.contains("Connection reset by peer") => Seen::NotSent,
        Code::Cancelled if message == "operation was canceled" => Seen::NotSent,
        _ if message == FAILED_BY_GOAWAY => Seen::GoAway,
        // The connection failed under the call as the sidecar exited (its
        // lingering close makes this rare: a caller that did not close within
        // the linger).
        Code::Unknown if message == "transport error" => Seen::Reset,
        _ => Seen::Unexplained(format!("{code:?}: {message}")),
    }
}

/// The engine's side: the mock's `--journal`.
#[derive(Debug, Default)]
pub struct Journal {
    pub events: BTreeMap<&'static str, BTreeSet<String>>,
}

impl Journal {
    pub fn read(path: &Path) -> Journal {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let mut j = Journal::default();
        for line in text.lines() {
            let Some((event, id)) = line.split_once(' ') else {
                continue;
            };
            let event = match event {
                "seen" => "seen",
                "done" => "done",
                "error" => "error",
                "cancelled" => "cancelled",
                "aborted" => "aborted",
                _ => continue,
            };
            j.events.entry(event).or_default().insert(id.to_string());
        }
        j
    }

    pub fn has(&self, event: &str, id: &str) -> bool {
        self.events.get(event).is_some_and(|s| s.contains(id))
    }

    pub fn count(&self, event: &str) -> usize {
        self.events.get(event).map_or(0, BTreeSet::len)
    }
}

/// The sidecar's side: the `request plane account at exit:` line of one run.
#[derive(Debug, Default, Clone)]
pub struct SidecarAccount(pub BTreeMap<String, u64>);

impl SidecarAccount {
    /// Parses the account line from a sidecar's log; `None` if it never exited cleanly.
    pub fn from_log(log: &str) -> Option<SidecarAccount> {
        let line = log
            .lines()
            .find(|l| l.contains("request plane account at exit:"))?;
        let rest = line.split("request plane account at exit:").nth(1)?;
        let mut map = BTreeMap::new();
        for pair in rest.split_whitespace() {
            if let Some((k, v)) = pair.split_once('=') {
                map.insert(k.to_string(), v.parse().ok()?);
            }
        }
        Some(SidecarAccount(map))
    }

    pub fn get(&self, key: &str) -> u64 {
        self.0.get(key).copied().unwrap_or(0)
    }

    pub fn sum(accounts: &[SidecarAccount]) -> SidecarAccount {
        let mut total = SidecarAccount::default();
        for a in accounts {
            for (k, v) in &a.0 {
                *total.0.entry(k.clone()).or_insert(0) += v;
            }
        }
        total
    }
}

/// The reconciliation's result, for the test's output and the issue note.
#[derive(Debug)]
pub struct Report {
    pub calls: usize,
    pub counts: BTreeMap<&'static str, u64>,
    pub engine_seen: usize,
    pub admitted: u64,
    /// Calls the caller cancelled as the sidecar ended them (see `reconcile`).
    pub cancel_races: u64,
    /// Refusals whose answer the caller never read, because hyper failed the
    /// call on the sidecar's GOAWAY (see `reconcile`).
    pub unread_refusals: u64,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} calls:", self.calls)?;
        for (k, v) in &self.counts {
            write!(f, " {k}={v}")?;
        }
        write!(
            f,
            "; sidecar admitted {}, engine saw {}, cancel races {}, unread refusals {}",
            self.admitted, self.engine_seen, self.cancel_races, self.unread_refusals
        )
    }
}

/// Checks that the three accounts agree; `Err` lists every disagreement.
///
/// `engine_survived`: the engine outlived the calls, so every forwarded call it
/// did not finish must show in its journal as reset (`cancelled`/`aborted`).
pub fn reconcile(
    ledger: &Ledger,
    journal: &Journal,
    sidecar: &SidecarAccount,
    engine_survived: bool,
) -> Result<Report, String> {
    let mut problems = Vec::new();
    let counts = ledger.counts();
    let c = |k: &str| counts.get(k).copied().unwrap_or(0);
    for (id, seen) in &ledger.calls {
        if let Seen::Unexplained(why) = seen {
            problems.push(format!("call {id} ended unexplained: {why}"));
        }
    }
    // Client ↔ sidecar, outcome by outcome.
    let pairs = [
        ("ok", sidecar.get("ok")),
        ("engine_status", sidecar.get("engine_status")),
        ("refused", sidecar.get("refused")),
        ("cut", sidecar.get("cut_at_deadline")),
        (
            "engine_failed",
            sidecar.get("engine_failed") + sidecar.get("engine_unreachable"),
        ),
        ("cancelled", sidecar.get("cancelled_by_caller")),
    ];
    // The one race no count can settle: a caller drops its call in the same
    // instant the sidecar ends it (engine failure, cut). The sidecar counts how
    // it ended the call; the caller never read that ending. Such calls must be
    // few, and they must account exactly for the difference.
    let cancel_races = c("cancelled").saturating_sub(sidecar.get("cancelled_by_caller"));
    let ended_by_sidecar = |label: &str, counted: u64| {
        matches!(label, "engine_failed" | "cut").then(|| counted.saturating_sub(c(label)))
    };
    let absorbed: u64 = pairs
        .iter()
        .filter_map(|(label, counted)| ended_by_sidecar(label, *counted))
        .sum();
    if cancel_races != absorbed || cancel_races > 1 + c("cancelled") / 100 {
        problems.push(format!(
            "{cancel_races} cancels at the callers are not matched by {absorbed} endings at the sidecar"
        ));
    }
    // The second: the sidecar refused a call whose caller then reported the
    // GOAWAY instead (`goaway`, see FAILED_BY_GOAWAY). The sidecar sends
    // GOAWAY only at exit, after admission closed, so such a call was refused,
    // never forwarded; the journal check below proves the engine never saw a
    // `goaway` call. A `reset` never excuses a refusal: the sidecar's graceful,
    // lingering close must deliver every answer it wrote.
    let unread_refusals = sidecar.get("refused").saturating_sub(c("refused"));
    if unread_refusals > c("goaway") {
        problems.push(format!(
            "the sidecar refused {unread_refusals} calls more than the callers saw, \
             but only {} calls were failed by its GOAWAY",
            c("goaway")
        ));
    }
    for (label, counted) in pairs {
        let counted = match label {
            "cancelled" => counted + cancel_races,
            "engine_failed" | "cut" => counted - ended_by_sidecar(label, counted).unwrap_or(0),
            "refused" => counted - unread_refusals,
            _ => counted,
        };
        // The sidecar counts an engine's stop like any status the engine sent.
        let seen = match label {
            "engine_status" => c(label) + c("engine_stopped"),
            _ => c(label),
        };
        if seen != counted {
            problems.push(format!(
                "{label}: callers saw {seen}, the sidecar counted {counted}"
            ));
        }
    }
    for unused in ["deadline_exceeded", "too_large"] {
        if sidecar.get(unused) != 0 {
            problems.push(format!("sidecar counted {unused}={}", sidecar.get(unused)));
        }
    }
    let admitted_outcomes: u64 = [
        "ok",
        "engine_status",
        "cancelled_by_caller",
        "cut_at_deadline",
        "deadline_exceeded",
        "too_large",
        "engine_unreachable",
        "engine_failed",
    ]
    .iter()
    .map(|k| sidecar.get(k))
    .sum();
    if sidecar.get("admitted") != admitted_outcomes {
        problems.push(format!(
            "sidecar admitted {} calls but accounts for {admitted_outcomes} endings",
            sidecar.get("admitted")
        ));
    }
    if sidecar.get("in_flight") != 0 {
        problems.push(format!(
            "sidecar exited with {} calls in flight",
            sidecar.get("in_flight")
        ));
    }
    // Client ↔ engine, call by call.
    for (id, seen) in &ledger.calls {
        let saw = journal.has("seen", id);
        if saw && !seen.forwarded() {
            problems.push(format!(
                "call {id} reached the engine but the caller got {}",
                seen.label()
            ));
        }
        match seen {
            Seen::Ok if !journal.has("done", id) => {
                problems.push(format!(
                    "call {id} ok at the caller, not done at the engine"
                ));
            }
            Seen::EngineStatus if !journal.has("error", id) => {
                problems.push(format!("call {id}: engine status never sent by the engine"));
            }
            Seen::EngineStopped if !journal.has("aborted", id) => {
                problems.push(format!("call {id}: never cancelled by the engine's stop"));
            }
            // A call the engine was still generating when the caller lost it must
            // reach the engine as a reset. (A frozen engine may finish a call after
            // it was cut: "done" at the engine then means generated, not delivered.
            // Nor does a call the engine answered with an error at once: a relay
            // that held its request while silent delivers it after the sidecar
            // cut it, and there is nothing left to reset.)
            Seen::Cut | Seen::Cancelled
                if engine_survived
                    && saw
                    && !journal.has("done", id)
                    && !journal.has("error", id)
                    && !journal.has("cancelled", id)
                    && !journal.has("aborted", id) =>
            {
                problems.push(format!(
                    "call {id} {} but the engine never saw the reset",
                    seen.label()
                ));
            }
            _ => {}
        }
    }
    if let Some(seen) = journal.events.get("seen") {
        for id in seen {
            if !ledger.calls.contains_key(id) {
                problems.push(format!("the engine saw {id}, which no caller sent"));
            }
        }
    }
    let engine_seen = journal.count("seen");
    if engine_seen as u64 > sidecar.get("admitted") {
        problems.push(format!(
            "the engine saw {engine_seen} calls, the sidecar admitted only {}",
            sidecar.get("admitted")
        ));
    }
    if problems.is_empty() {
        Ok(Report {
            calls: ledger.calls.len(),
            counts,
            engine_seen,
            admitted: sidecar.get("admitted"),
            cancel_races,
            unread_refusals,
        })
    } else {
        problems.truncate(20);
        Err(problems.join("\n"))
    }
}

/// Reconciles, giving the engine's journal a few seconds to record late resets.
pub fn reconcile_settled(
    ledger: &Ledger,
    journal: &Path,
    sidecar: &SidecarAccount,
    engine_survived: bool,
) -> Report {
    let start = std::time::Instant::now();
    loop {
        match reconcile(ledger, &Journal::read(journal), sidecar, engine_survived) {
            Ok(report) => return report,
            Err(problems) if start.elapsed() > Duration::from_secs(5) => {
                panic!("the call account does not reconcile:\n{problems}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
