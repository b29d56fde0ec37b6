//! `llm-sidecar-dynamo` behind Dynamo 1.6.1's real frontend, in front of the
//! mock OpenEngine engine: what a Dynamo user sees (HTTP answers, the
//! discovery files or keys, the exit code, the loss line) and what the engine
//! saw (the token ids, the aborts).

mod hardening;
mod kube;
mod kube_api;
mod kv;
mod requests;
mod support;

use std::time::{Duration, Instant};

pub use llm_sidecar_testkit::proc::{HANG, Proc, wait_until};
pub use support::free_addr;
use support::*;

/// How long the frontend's discovery watch may take to act on a removed
/// record before requests are sent (measured in docs/PERFORMANCE.md's
/// Dynamo table).
const FRONTEND_SETTLE: Duration = Duration::from_millis(0);

/// Which discovery a [`Setup`] registers in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backend {
    File,
    Etcd,
    Kube,
}

/// One frontend, `n` engines and their workers, registered and serving.
struct Setup {
    // Dropped in this order: workers first, then engines, the frontend, etcd,
    // and the directory with everyone's logs last.
    workers: Vec<Worker>,
    engines: Vec<Engine>,
    frontend: Frontend,
    store: Store,
    _dir: TempDir,
    model: String,
    ids: Vec<String>,
}

/// An engine and its worker (router grace 1 s), the worker registered in
/// `store`; with the worker's instance id.
fn start_pair(
    dir: &std::path::Path,
    store: &Store,
    tokenizer: &std::path::Path,
    token_delay: &str,
    worker_env: &[(&str, String)],
) -> (Engine, Worker, String) {
    let engine = Engine::start(dir, token_delay);
    let mut worker = Worker::start(
        &[],
        dir,
        store,
        &engine,
        tokenizer,
        &["--router-grace", "1s"],
        worker_env,
    );
    let id = worker.wait_registered();
    (engine, worker, id)
}

impl Setup {
    fn start(name: &str, n: usize, etcd: bool, token_delay: &str) -> Setup {
        Self::start_with_env(name, n, etcd, token_delay, &[])
    }

    /// As [`Setup::start`], every worker with these environment variables too.
    fn start_with_env(
        name: &str,
        n: usize,
        etcd: bool,
        token_delay: &str,
        worker_env: &[(&str, String)],
    ) -> Setup {
        Self::start_with(name, n, etcd, token_delay, worker_env, &[])
    }

    /// As [`Setup::start_with_env`], the frontend with these flags too.
    fn start_with(
        name: &str,
        n: usize,
        etcd: bool,
        token_delay: &str,
        worker_env: &[(&str, String)],
        frontend_args: &[&str],
    ) -> Setup {
        let backend = if etcd { Backend::Etcd } else { Backend::File };
        Self::start_in(name, backend, n, token_delay, worker_env, frontend_args)
    }

    /// As [`Setup::start_with`], registered in `backend` (`n` 0: the
    /// frontend alone, for a test that starts workers of its own).
    fn start_in(
        name: &str,
        backend: Backend,
        n: usize,
        token_delay: &str,
        worker_env: &[(&str, String)],
        frontend_args: &[&str],
    ) -> Setup {
        let dir = TempDir::new(name);
        let store = match backend {
            Backend::Etcd => Store::Etcd(Box::new(Etcd::started(&dir.0))),
            Backend::Kube => Store::Kube(Box::new(FakeKube::start(&dir.0))),
            Backend::File => {
                let kv = dir.0.join("kv");
                std::fs::create_dir_all(&kv).expect("kv dir");
                Store::File(kv)
            }
        };
        let tokenizer = write_tokenizer(&dir.0);
        let model = tokenizer.display().to_string();
        let frontend = Frontend::start_with(&dir.0, &store, frontend_args);
        let mut engines = Vec::new();
        let mut workers = Vec::new();
        let mut ids = Vec::new();
        for _ in 0..n {
            let (engine, worker, id) =
                start_pair(&dir.0, &store, &tokenizer, token_delay, worker_env);
            ids.push(id);
            engines.push(engine);
            workers.push(worker);
        }
        if let Store::Kube(kube) = &store {
            // Routable only once kubelet found the pod ready.
            wait_until(HANG, "every worker's pod to be ready", || {
                workers
                    .iter()
                    .all(|w: &Worker| w.pod.as_ref().is_some_and(|p| kube.pod_ready(&p.name)))
            });
        }
        if n > 0 {
            wait_until(
                Duration::from_secs(60),
                "the frontend to list the model",
                || frontend.models().contains(&model),
            );
        }
        Setup {
            workers,
            engines,
            frontend,
            store,
            _dir: dir,
            model,
            ids,
        }
    }

    /// Sends requests until every engine has served some: the frontend
    /// spreads them over the workers while all serve (ten requests at
    /// least; more while its discovery watch has not yet heard of one).
    fn serve_from_every_engine(&self) {
        let served_all = || {
            self.engines
                .iter()
                .all(|e| e.stats()["generate_started"].as_u64() > Some(0))
        };
        for i in 0..100 {
            if i >= 10 && served_all() {
                break;
            }
            let (status, answer) = self
                .frontend
                .post("/v1/completions", &completion(&self.model, "w22", 2, false));
            assert_eq!(status, 200, "request {i} before the loss: {answer}");
        }
        assert!(served_all(), "every engine served some before the loss");
    }

    /// Both of a worker's records (instance and model card) are in discovery.
    fn assert_registered(&self, i: usize) {
        let keys = self.store.keys_of(&self.ids[i]);
        assert!(
            keys.iter().any(|k| k.contains("instances/"))
                && keys.iter().any(|k| k.contains("mdc/")),
            "worker {i}'s instance record and model card: {keys:?}"
        );
    }
}

/// The text the mock engine generated for the request it saw with this prompt.
fn engine_text(engine: &Engine, prompt: &[u32]) -> (String, serde_json::Value) {
    let asked = engine.asked_for(prompt);
    let max = asked["max_tokens"].as_u64().expect("max_tokens") as u32;
    (words(&mock_tokens(prompt, max)), asked)
}

#[test]
fn chat_and_completions_reach_the_engine_as_token_ids_and_come_back_intact() {
    let s = Setup::start("dyn-intact", 1, false, "2ms");
    s.assert_registered(0);
    let cases = [
        (
            "/v1/chat/completions",
            chat(&s.model, "w5 w6 w7", 8, false),
            vec![5, 6, 7],
        ),
        (
            "/v1/chat/completions",
            chat(&s.model, "w8 w9", 6, true),
            vec![8, 9],
        ),
        (
            "/v1/completions",
            completion(&s.model, "w10 w11 w12 w13", 5, false),
            vec![10, 11, 12, 13],
        ),
        (
            "/v1/completions",
            completion(&s.model, "w14", 7, true),
            vec![14],
        ),
    ];
    for (path, body, prompt) in cases {
        let (status, answer) = s.frontend.post(path, &body);
        assert_eq!(status, 200, "{path} {body}: {answer}");
        let (expected, asked) = engine_text(&s.engines[0], &prompt);
        assert_eq!(
            asked["max_tokens"], body["max_tokens"],
            "max_tokens reach the engine"
        );
        assert_eq!(
            asked["detokenize"], false,
            "the engine is asked not to detokenize"
        );
        if expected.split(' ').any(|w| matches!(w, "w0" | "w1" | "w2")) {
            // A special token (the end of sequence among them) is not text.
            continue;
        }
        assert_eq!(answer_text(&answer), expected, "{path} {body}: {answer}");
    }
    // The engine saw each request exactly once.
    assert_eq!(s.engines[0].stats()["generate_started"], 4);
}

/// Loses engine 0 of two by `lose`; its worker must leave discovery, exit 1
/// with the loss line, and the frontend must serve every request that starts
/// after the withdrawal from worker 1.
fn loss_moves_traffic_to_the_other_worker(name: &str, lose: impl FnOnce(&mut Setup), reason: &str) {
    loss_moves_traffic_in(Backend::File, name, lose, reason);
}

/// As [`loss_moves_traffic_to_the_other_worker`], registered in `backend`;
/// returns how long after the fault the records were gone.
fn loss_moves_traffic_in(
    backend: Backend,
    name: &str,
    lose: impl FnOnce(&mut Setup),
    reason: &str,
) -> Duration {
    let mut s = Setup::start_in(name, backend, 2, "2ms", &[], &[]);
    s.assert_registered(0);
    s.assert_registered(1);
    s.serve_from_every_engine();
    let engine_instance = s.engines[0].stats()["instance_id"]
        .as_str()
        .expect("the engine's instance id")
        .to_string();
    let lost_at = Instant::now();
    lose(&mut s);
    wait_until(HANG, "worker 0's records to leave discovery", || {
        s.store.keys_of(&s.ids[0]).is_empty()
    });
    let withdrawn_after = lost_at.elapsed();
    s.workers[0]
        .proc
        .assert_engine_lost("TensorRT-LLM", &engine_instance, reason);
    // The frontend hears of the removal through its discovery watch.
    std::thread::sleep(FRONTEND_SETTLE);
    let served_before = s.engines[1].stats()["generate_started"]
        .as_u64()
        .unwrap_or(0);
    for i in 0..20 {
        let (status, answer) = s.frontend.post(
            "/v1/completions",
            &completion(&s.model, "w20 w21", 4, false),
        );
        assert_eq!(status, 200, "request {i} after the withdrawal: {answer}");
    }
    let served_after = s.engines[1].stats()["generate_started"]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(served_after - served_before, 20, "worker 1 served them all");
    s.assert_registered(1);
    eprintln!("{name}: records gone {withdrawn_after:?} after the loss");
    withdrawn_after
}

#[test]
fn an_engine_going_not_serving_takes_its_worker_out_of_discovery() {
    loss_moves_traffic_to_the_other_worker(
        "dyn-not-serving",
        |s| s.engines[0].control("/liveness?status=2"),
        "liveness reported NOT_SERVING",
    );
}

#[test]
fn a_killed_engine_takes_its_worker_out_of_discovery() {
    loss_moves_traffic_to_the_other_worker(
        "dyn-killed",
        |s| s.engines[0].proc.signal("KILL"),
        "liveness stream",
    );
}

/// The same SIGKILL with the records in a real etcd: the worker's keys go,
/// and every later request is served by the other worker (the figure beside
/// the file and Kubernetes backends' in docs/DYNAMO.md).
#[test]
fn a_killed_engine_takes_its_worker_out_of_etcd() {
    loss_moves_traffic_in(
        Backend::Etcd,
        "dyn-etcd-killed",
        |s| s.engines[0].proc.signal("KILL"),
        "liveness stream",
    );
}

#[test]
fn an_ended_liveness_watch_takes_its_worker_out_of_discovery() {
    loss_moves_traffic_to_the_other_worker(
        "dyn-watch-end",
        |s| s.engines[0].control("/watch/end"),
        "liveness stream ended",
    );
}

/// SIGTERM with a streaming request in flight: it completes, the worker
/// exits 0, and both of its records are gone (Dynamo's own sidecar leaves its
/// model card behind to expire).
fn sigterm_drains_and_leaves_nothing(s: &Setup) {
    // The first token has arrived: the request is in flight.
    let (stream, first) = s.frontend.open_stream(
        "/v1/completions",
        &completion(&s.model, "w30 w31", 200, true),
    );
    s.workers[0].proc.signal("TERM");
    let (status, body) = read_rest(stream, first);
    assert_eq!(status, 200, "{body}");
    let (expected, _) = engine_text(&s.engines[0], &[30, 31]);
    // The mock's tokens are pseudo-random: one of them can be the end of
    // sequence (w2), at which the frontend finishes with "stop".
    let finish = if expected.split(' ').any(|w| w == "w2") {
        "stop"
    } else {
        "length"
    };
    assert!(
        body.contains(&format!("\"finish_reason\":\"{finish}\"")),
        "the stream finished ({finish}): {body}"
    );
    if !expected.split(' ').any(|w| matches!(w, "w0" | "w1" | "w2")) {
        assert_eq!(answer_text(&body), expected, "every token arrived");
    }
    assert!(
        s.store.keys_of(&s.ids[0]).is_empty(),
        "both records are gone: {:?}",
        s.store.keys()
    );
}

#[test]
fn sigterm_lets_a_request_in_flight_finish_and_leaves_no_record() {
    let mut s = Setup::start("dyn-sigterm", 1, false, "10ms");
    sigterm_drains_and_leaves_nothing(&s);
    let code = s.workers[0].proc.wait_exit(HANG);
    assert_eq!(code, 0, "log:\n{}", s.workers[0].proc.log_text());
    s.workers[0].proc.assert_withdrawn_before_exit(0);
    assert!(
        s.store.keys().is_empty(),
        "nothing left in discovery: {:?}",
        s.store.keys()
    );
}

#[test]
fn a_client_that_disconnects_mid_stream_makes_the_worker_abort_the_engine_call() {
    let s = Setup::start("dyn-abort", 1, false, "20ms");
    let (stream, _) = s.frontend.open_stream(
        "/v1/chat/completions",
        &chat(&s.model, "w40 w41 w42", 500, true),
    );
    let id = s.engines[0].stats()["asked"][0]["request_id"]
        .as_str()
        .expect("the engine saw the request")
        .to_string();
    drop(stream);
    wait_until(
        HANG,
        "the engine to see Control.Abort for the request",
        || {
            s.engines[0].stats()["aborted_ids"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == id.as_str()))
        },
    );
    wait_until(HANG, "the engine's generation to end", || {
        s.engines[0].stats()["generate_cancelled"] == 1
    });
    // The worker's account counts the request as its caller's cancel.
    let admin = s.workers[0].admin.expect("an admin port");
    let cancelled = "llm_sidecar_calls_total{outcome=\"cancelled_by_caller\"} 1";
    wait_until(HANG, "the account to show the cancel", || {
        llm_sidecar_loadgen::local::http_get(admin, "/metrics", Duration::from_secs(10))
            .is_some_and(|(_, page)| page.lines().any(|l| l == cancelled))
    });
    // The worker keeps serving.
    let (status, answer) = s
        .frontend
        .post("/v1/completions", &completion(&s.model, "w43", 3, false));
    assert_eq!(status, 200, "{answer}");
}

#[test]
fn etcd_discovery_registers_serves_and_withdraws_both_keys() {
    let mut s = Setup::start("dyn-etcd", 1, true, "10ms");
    s.assert_registered(0);
    let (status, answer) = s
        .frontend
        .post("/v1/chat/completions", &chat(&s.model, "w50 w51", 4, false));
    assert_eq!(status, 200, "{answer}");
    sigterm_drains_and_leaves_nothing(&s);
    let code = s.workers[0].proc.wait_exit(HANG);
    assert_eq!(code, 0, "log:\n{}", s.workers[0].proc.log_text());
    assert!(
        s.store.keys_of(&s.ids[0]).is_empty(),
        "keys: {:?}",
        s.store.keys()
    );
}

#[test]
fn bad_flags_exit_2_before_anything_is_contacted() {
    let dir = TempDir::new("dyn-flags");
    let kv = dir.0.join("kv");
    // Runs the worker with these flags and variables: it must exit 2 having
    // touched nothing; what it said on stderr.
    let refused = |args: &[&str], env: &[(&str, &str)]| {
        let out = std::process::Command::new(worker_binary())
            .args(args)
            .env("DYN_FILE_KV", &kv)
            .env("DYN_DISCOVERY_BACKEND", "file")
            .envs(env.iter().copied())
            .output()
            .expect("run the worker");
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {out:?}");
        assert!(!kv.exists(), "{args:?} {env:?} touched discovery");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for bad in [
        vec!["--grpc-endpoint", "no-port", "--model-path", "/m"],
        vec![
            "--grpc-endpoint",
            "127.0.0.1:1",
            "--model-path",
            "/m",
            "--disaggregation-mode",
            "prefill",
        ],
        vec![
            "--grpc-endpoint",
            "127.0.0.1:1",
            "--model-path",
            "/m",
            "--discovery-backend",
            "mem",
        ],
        vec![
            "--grpc-endpoint",
            "127.0.0.1:1",
            "--model-path",
            "/m",
            "--keepalive-interval",
            "5s",
        ],
        vec!["--grpc-endpoint", "127.0.0.1:1"],
    ] {
        let said = refused(&bad, &[]);
        assert!(said.contains("error"), "{bad:?} says what is wrong: {said}");
    }
    // A Dynamo runtime variable Dynamo would refuse (its system port is an i16).
    let said = refused(
        &["--grpc-endpoint", "127.0.0.1:1", "--model-path", "/m"],
        &[("DYN_SYSTEM_PORT", "40000")],
    );
    assert!(said.contains("SYSTEM_PORT"), "says which variable: {said}");
}

/// Two workers on one host, each started with exactly the arguments Dynamo's
/// own sidecar takes (no port of llm-sidecar's given): both register and
/// serve. (With an admin port on by default, the second could not bind it.)
#[test]
fn two_workers_started_with_dynamos_sidecar_arguments_both_register() {
    let dir = TempDir::new("dyn-two-on-a-host");
    let kv = dir.0.join("kv");
    std::fs::create_dir_all(&kv).expect("kv dir");
    let store = Store::File(kv);
    let tokenizer = write_tokenizer(&dir.0);
    let engines = [Engine::start(&dir.0, "1ms"), Engine::start(&dir.0, "1ms")];
    let mut workers: Vec<Worker> = engines
        .iter()
        .map(|e| Worker::spawn(&[], &dir.0, &store, e, &tokenizer, &[], &[]))
        .collect();
    let ids: Vec<String> = workers.iter_mut().map(Worker::wait_registered).collect();
    assert_ne!(ids[0], ids[1]);
    std::thread::sleep(Duration::from_secs(2));
    for (i, w) in workers.iter_mut().enumerate() {
        assert!(w.proc.running(), "worker {i} runs:\n{}", w.proc.log_text());
        let keys = store.keys_of(&ids[i]);
        assert!(
            keys.iter().any(|k| k.contains("instances/"))
                && keys.iter().any(|k| k.contains("mdc/")),
            "worker {i} is registered: {keys:?}"
        );
    }
    for w in &mut workers {
        w.proc.signal("TERM");
        assert_eq!(w.proc.wait_exit(HANG), 0, "log:\n{}", w.proc.log_text());
    }
}

/// On etcd, an engine loss while a request is in flight: every key the
/// worker wrote (instance, model card, event channels: anything naming its
/// id) is gone while the process still drains; Dynamo's system port
/// (`DYN_SYSTEM_PORT`) and llm-sidecar's admin port answer `/health` 503
/// from then on, `/live` stays 200 on the admin port; the request in flight
/// finishes; exit 1.
#[test]
fn an_engine_loss_on_etcd_leaves_no_key_of_the_worker_while_it_drains() {
    let system = free_system_addr();
    let env = [
        ("DYN_SYSTEM_HOST", system.ip().to_string()),
        ("DYN_SYSTEM_PORT", system.port().to_string()),
    ];
    let mut s = Setup::start_with_env("dyn-etcd-loss", 1, true, "20ms", &env);
    let admin = s.workers[0].admin.expect("an admin port");
    let get = |addr, path| {
        llm_sidecar_loadgen::local::http_get(addr, path, Duration::from_secs(10)).map(|r| r.0)
    };
    for (addr, path) in [
        (system, "/live"),
        (system, "/health"),
        (admin, "/live"),
        (admin, "/health"),
    ] {
        assert_eq!(get(addr, path), Some(200), "{addr}{path} while serving");
    }
    // Dynamo's worker registers its event channels (kv_metrics,
    // active_sequences_events, kv-events) and its KV event source under
    // random publisher ids, not its instance id; in this setup it is the
    // only publisher of any.
    let channels = || -> Vec<String> {
        s.store
            .keys()
            .into_iter()
            .filter(|k| k.contains("event_channels/") || k.contains("event_sources/"))
            .collect()
    };
    eprintln!("etcd while serving: {:?}", s.store.keys());
    for what in [
        "event_channels/",
        "event_sources/",
        "worker_kv_query_source",
    ] {
        assert!(
            s.store.keys().iter().any(|k| k.contains(what)),
            "the worker's {what} keys: {:?}",
            s.store.keys()
        );
    }
    // 150 tokens at 20 ms: the drain lasts about three seconds.
    let (stream, first) = s.frontend.open_stream(
        "/v1/completions",
        &completion(&s.model, "w60 w61", 150, true),
    );
    s.engines[0].control("/liveness?status=2");
    wait_until(HANG, "every key of worker 0 to leave etcd", || {
        s.store.keys_naming(&s.ids[0]).is_empty() && channels().is_empty()
    });
    assert!(
        s.workers[0].proc.running(),
        "the keys went while the worker still drains, not with its exit"
    );
    assert_eq!(
        get(system, "/health"),
        Some(503),
        "Dynamo's /health once withdrawn"
    );
    assert_eq!(
        get(admin, "/health"),
        Some(503),
        "llm-sidecar's /health once withdrawn"
    );
    assert_eq!(
        get(admin, "/live"),
        Some(200),
        "llm-sidecar's /live while draining"
    );
    let (status, body) = read_rest(stream, first);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"finish_reason\":\"length\""),
        "the request finished: {body}"
    );
    assert_eq!(
        s.workers[0].proc.wait_exit(HANG),
        1,
        "log:\n{}",
        s.workers[0].proc.log_text()
    );
}

/// A gauge's value on a Prometheus text page, for `dp_rank="0"`.
fn rank0_gauge(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains("dp_rank=\"0\""))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The engine's KV capacity (GetServerInfo: 32-token blocks, 8,192 of them;
/// Dynamo's default block size is 16) is in the model card the worker
/// registers and in what the frontend's KV router reads of it, and the load
/// the engine reports (GetLoad, polled every 100 ms) reaches the worker's
/// `dynamo_component_*` gauges on Dynamo's system port.
#[test]
fn the_engines_kv_capacity_is_registered_and_its_load_reaches_dynamos_gauges() {
    let system = free_system_addr();
    let env = [
        ("DYN_SYSTEM_HOST", system.ip().to_string()),
        ("DYN_SYSTEM_PORT", system.port().to_string()),
    ];
    let s = Setup::start_with("dyn-load", 1, false, "2ms", &env, &["--router-mode", "kv"]);
    let Store::File(kv) = &s.store else {
        unreachable!("a file store")
    };
    let card =
        llm_sidecar_loadgen::local::files_under(kv, &|p| p.display().to_string().contains("mdc"));
    let card = std::fs::read_to_string(card.first().expect("a model card")).expect("read it");
    let card: serde_json::Value = serde_json::from_str(&card).expect("a JSON card");
    let text = card.to_string();
    assert!(
        text.contains("\"kv_cache_block_size\":32") && text.contains("\"total_kv_blocks\":8192"),
        "the card carries the engine's block size and total: {text}"
    );
    // The KV router reads them from the card.
    let page = s.frontend.metrics();
    for (name, value) in [
        ("dynamo_frontend_model_kv_cache_block_size", "32"),
        ("dynamo_frontend_model_total_kv_blocks", "8192"),
    ] {
        assert!(
            page.lines()
                .any(|l| l.starts_with(&format!("{name}{{")) && l.ends_with(&format!(" {value}"))),
            "the frontend's {name} is {value}"
        );
    }
    let metrics = || {
        llm_sidecar_loadgen::local::http_get(system, "/metrics", Duration::from_secs(10))
            .map(|r| r.1)
            .unwrap_or_default()
    };
    let usage_is = |want: f64| {
        rank0_gauge(&metrics(), "dynamo_component_gpu_cache_usage_percent")
            .is_some_and(|v| (v - want).abs() < 1e-6)
    };
    wait_until(HANG, "the first load on the gauges", || usage_is(0.0));
    assert_eq!(
        rank0_gauge(&metrics(), "dynamo_component_total_blocks"),
        Some(8192.0)
    );
    let mut slowest = Duration::ZERO;
    for used in [2048u64, 6144, 512] {
        let changed = Instant::now();
        s.engines[0].control(&format!("/load?used_kv_blocks={used}&running=3"));
        wait_until(HANG, "the gauge to follow the engine", || {
            usage_is(used as f64 / 8192.0)
        });
        slowest = slowest.max(changed.elapsed());
    }
    eprintln!("load on the gauges within {slowest:?} of the engine's change (poll: 100 ms)");
}
