//! The engines' own gRPC servers as they ship on PyPI, with only their engine
//! core replaced, against the real binary: what our mock plays is checked
//! against what ships.
//!
//! SGLang 0.5.23's native server (`clients/sglang_native_server.py`: the
//! wheel's Rust server and its Python bridge, a stand-in TokenizerManager),
//! and SGLang through smg-grpc-servicer 0.14.1 (`clients/sglang_smg_server.py`:
//! the servicer's own `serve_grpc`, a stand-in scheduler process and request
//! manager), and vLLM 0.34.0's own gRPC launcher with smg's servicer
//! (`clients/vllm_server.py`: a stand-in AsyncLLM). scripts/test.sh installs
//! the wheels into `target/engines-venv`
//! (or `LLM_SIDECAR_ENGINES_PYTHON` names the Python that has them).
//!
//! Each test prints its figure (ms from the fault to the record's removal)
//! on stderr: `cargo test ... shipped_servers:: -- --nocapture`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use llm_sidecar_engine_api::sglang_runtime::sglang_service_client::SglangServiceClient;
use llm_sidecar_engine_api::sglang_runtime::{GenerateRequest, GenerateResponse, SamplingParams};
use llm_sidecar_engine_api::{sglang, vllm};

use crate::support::*;

/// The Python with SGLang's wheel installed.
fn engines_python() -> PathBuf {
    let python = std::env::var_os("LLM_SIDECAR_ENGINES_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/engines-venv/bin/python")
        });
    assert!(
        python.exists(),
        "{} is missing: scripts/test.sh installs the shipped engines' wheels there",
        python.display()
    );
    python
}

/// A shipped server, started and listening (warming up for `warmup`).
struct ShippedServer {
    proc: Proc,
    grpc: SocketAddr,
}

/// Which one.
#[derive(Clone, Copy)]
enum Shipped {
    /// SGLang 0.5.23's native server.
    SglangNative,
    /// SGLang through smg-grpc-servicer 0.14.1's Python servicer.
    SglangSmg,
    /// vLLM 0.34.0's own gRPC launcher with smg-grpc-servicer 0.14.1's servicer.
    Vllm,
}

impl Shipped {
    /// How the loss line names the engine.
    fn engine(self) -> &'static str {
        match self {
            Shipped::SglangNative | Shipped::SglangSmg => "SGLang",
            Shipped::Vllm => "vLLM",
        }
    }

    /// Whether its stand-in takes a warm-up (and says "warmed up" at its
    /// end): the SGLang servers do; vLLM's launcher is ready once it listens.
    fn warms_up(self) -> bool {
        match self {
            Shipped::SglangNative | Shipped::SglangSmg => true,
            Shipped::Vllm => false,
        }
    }
}

/// A grpcio server's graceful stop, as the loss line reads it.
const GOAWAY_STOP: &str = "engine stopped: it said GOAWAY (NO_ERROR)";

/// The server process gone: its connection, or the Check in flight.
const CONNECTION_GONE: &[&str] = &[
    "engine connection lost: the engine closed the connection",
    "engine connection lost: the connection was reset",
    "health check failed",
];

impl ShippedServer {
    fn start(dir: &Path, which: Shipped, warmup: Duration) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/process/clients")
            .join(match which {
                Shipped::SglangNative => "sglang_native_server.py",
                Shipped::SglangSmg => "sglang_smg_server.py",
                Shipped::Vllm => "vllm_server.py",
            });
        let python = engines_python();
        for attempt in 0..5 {
            let grpc = free_addr();
            let mut proc = Proc::spawn_program(
                python.to_str().expect("a UTF-8 path"),
                &[
                    script.display().to_string(),
                    grpc.port().to_string(),
                    warmup.as_secs_f64().to_string(),
                ],
                dir.join(format!("sglang-native-{attempt}.log")),
            );
            wait_until(HANG, "the SGLang server to listen or exit", || {
                let log = proc.log_text();
                // SGLang's servers say the first, vLLM's launcher the second.
                log.contains("gRPC server listening")
                    || log.contains("gRPC server started on")
                    || !proc.running()
            });
            if proc.running() {
                return ShippedServer { proc, grpc };
            }
            let log = proc.log_text();
            assert!(
                ["ddress already in use", "ddrInUse", "Failed to bind"]
                    .iter()
                    .any(|said| log.contains(said)),
                "the server did not start:\n{log}"
            );
        }
        panic!("no free port for the server after 5 attempts");
    }

    /// The instance id its Rust server published (`instance_id=<n>` in its log).
    fn instance_id(&self) -> String {
        let log = strip_ansi(&self.proc.log_text());
        let at = log
            .find("instance_id=")
            .unwrap_or_else(|| panic!("no published state in:\n{log}"));
        log[at + "instance_id=".len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect()
    }
}

/// The Rust server's log lines carry colour codes.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The server and a sidecar at `--engine-kind auto`, registered; the sidecar
/// started while the server warms up.
///
/// With a warm-up (SGLang's), the record must not appear before the server said
/// "warmed up": the server says it just before its health turns serving, so
/// the order is causal and no clock is compared (the warm-up's sleep starts
/// before the server says it listens, so a duration measured here can fall
/// short of it by the log's polling).
fn serving_shipped(
    dir: &TempDir,
    which: Shipped,
    warmup: Duration,
) -> (ShippedServer, Sidecar, Duration) {
    let server = ShippedServer::start(&dir.0, which, warmup);
    let started = Instant::now();
    let sidecar = Sidecar::start(&dir.0, server.grpc, &[]);
    sidecar.wait_serving();
    let took = started.elapsed();
    if which.warms_up() && !warmup.is_zero() {
        let said = server.proc.log_text();
        assert!(
            said.contains("warmed up"),
            "registered after {took:?}, before the server's warm-up ended:\n{said}"
        );
    }
    (server, sidecar, took)
}

async fn connect(addr: SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

/// Every message of a streaming call, as it came; the stream must end OK.
async fn every_message<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>>,
) -> Vec<T> {
    let mut stream = call.await.expect("Generate answers").into_inner();
    let mut all = Vec::new();
    while let Some(message) = stream.message().await.expect("the stream ends OK") {
        all.push(message);
    }
    all
}

/// One streaming Generate, every message as it came.
async fn generate_all(addr: SocketAddr, rid: &str) -> Vec<GenerateResponse> {
    every_message(
        SglangServiceClient::new(connect(addr).await).generate(GenerateRequest {
            input_ids: vec![1, 2, 3],
            sampling_params: Some(SamplingParams {
                max_new_tokens: Some(6),
                ..Default::default()
            }),
            stream: Some(true),
            rid: Some(rid.to_string()),
        }),
    )
    .await
}

/// Ms from `fault` to the worker's record leaving discovery, and the loss line.
fn lost_after(sidecar: &mut Sidecar, fault: impl FnOnce()) -> (Duration, String) {
    let t0 = Instant::now();
    fault();
    wait_until(HANG, "the record to leave discovery", || {
        sidecar.records().is_empty()
    });
    let withdrawn = t0.elapsed();
    assert_eq!(
        sidecar.proc.wait_exit(HANG),
        1,
        "{}",
        sidecar.proc.log_text()
    );
    let log = sidecar.proc.log_text();
    let line = log
        .lines()
        .find(|l| l.contains(" engine lost: "))
        .unwrap_or_else(|| panic!("no loss line:\n{log}"))
        .to_string();
    sidecar.proc.assert_withdrawn_before_exit(1);
    (withdrawn, line)
}

/// Generate through the sidecar is Generate direct, message for message
/// (`generate` calls the address it is given); what direct answered.
fn serves_identically<T, Fut>(
    server: &ShippedServer,
    sidecar: &Sidecar,
    generate: impl Fn(SocketAddr) -> Fut,
) -> Vec<T>
where
    T: PartialEq + std::fmt::Debug,
    Fut: std::future::Future<Output = Vec<T>>,
{
    let runtime = rt();
    let direct = runtime.block_on(generate(server.grpc));
    let through = runtime.block_on(generate(sidecar.listen));
    assert_eq!(
        through, direct,
        "Generate through the sidecar is Generate direct"
    );
    direct
}

/// The sidecar's SIGTERM: exit 0, its record gone.
fn stop_cleanly(mut sidecar: Sidecar) {
    sidecar.proc.stop_cleanly();
    assert!(sidecar.records().is_empty());
}

/// `which` serving, `fault` done to it, and the loss that follows: the
/// line is one of `reasons` (after "<engine> engine lost: "), never a
/// keepalive timeout, and the figure (ms to withdrawal) is printed.
fn loss_after_fault(
    name: &str,
    which: Shipped,
    fault: impl FnOnce(&ShippedServer),
    reasons: &[&str],
) -> (TempDir, ShippedServer, Sidecar, String) {
    let dir = TempDir::new(name);
    let (server, mut sidecar, _) = serving_shipped(&dir, which, Duration::from_millis(500));
    let (after, line) = lost_after(&mut sidecar, || fault(&server));
    let engine = which.engine();
    assert!(
        reasons
            .iter()
            .any(|r| line.contains(&format!("{engine} engine lost: {r}"))),
        "{line} is one of {reasons:?}"
    );
    assert!(!line.contains("keepalive"), "{line}");
    eprintln!("figure: shipped {name} -> withdrawn in {after:?}: {line}");
    (dir, server, sidecar, line)
}

#[test]
fn shipped_sglang_native_registers_after_its_warm_up_with_its_instance_id_and_serves_identically() {
    let dir = TempDir::new("shipped-sglang-register");
    let warmup = Duration::from_secs(3);
    let (server, sidecar, took) = serving_shipped(&dir, Shipped::SglangNative, warmup);
    let log = sidecar.proc.log_text();
    assert!(
        log.contains(
            "warming up: its health service \"sglang.runtime.v1.SglangService/HealthCheck\" \
             reports healthy=false"
        ),
        "the warm-up is waited out, and said:\n{log}"
    );
    assert!(
        log.contains(
            "serves sglang.runtime.v1.SglangService: following it as --engine-kind sglang-native"
        ),
        "{log}"
    );
    let r = sidecar.record(&sidecar.records()[0]);
    assert_eq!(r["engine"]["kind"], "sglang-native", "{r}");
    assert_eq!(
        r["engine"]["version"], "unknown",
        "no version on its API: {r}"
    );
    assert_eq!(
        r["engine"]["identity"],
        server.instance_id().as_str(),
        "{r}"
    );
    assert_eq!(r["model"]["name"], "shipped-sglang", "{r}");
    assert_eq!(r["model"]["max_seq_len"], 4096, "{r}");
    assert_eq!(r["model"]["max_input_len"], 4090, "{r}");
    // The scheduler's info, which the server merges into its document.
    assert_eq!(r["model"]["kv_cache_tokens"], 65_536, "{r}");

    let direct = serves_identically(&server, &sidecar, |addr| generate_all(addr, "same-id"));
    assert_eq!(direct.len(), 6, "{direct:?}");
    eprintln!("figure: shipped SGLang native registered {took:?} after start (warm-up {warmup:?})");

    stop_cleanly(sidecar);
}

#[test]
fn shipped_sglang_native_scheduler_failure_is_a_loss_by_its_engine_state() {
    let (_dir, server, sidecar, line) = loss_after_fault(
        "sglang-native-unhealthy",
        Shipped::SglangNative,
        |server| server.proc.signal("USR1"),
        &["liveness reported NOT_SERVING"],
    );
    let instance = server.instance_id();
    assert!(line.ends_with(&format!("(instance {instance})")), "{line}");
    assert!(
        sidecar
            .proc
            .log_text()
            .contains("the SGLang engine reports itself unhealthy (WatchEngineState)")
    );
}

#[test]
fn shipped_sglang_native_pause_is_said_and_no_loss() {
    let dir = TempDir::new("shipped-sglang-pause");
    let (server, mut sidecar, _) =
        serving_shipped(&dir, Shipped::SglangNative, Duration::from_millis(500));
    server.proc.signal("USR2");
    sidecar
        .proc
        .wait_for_line("the SGLang engine's generation is paused", HANG);
    server.proc.signal("USR2");
    sidecar
        .proc
        .wait_for_line("the SGLang engine's generation continues", HANG);
    assert!(sidecar.proc.running(), "{}", sidecar.proc.log_text());
    assert_eq!(sidecar.records().len(), 1, "still registered");
    sidecar.proc.stop_cleanly();
}

#[test]
fn shipped_sglang_native_sigterm_is_a_loss_at_once() {
    // SGLang's SIGTERM makes it unhealthy at once; with no call to drain its
    // server stops a moment later, and its state stream may end before it
    // sends the unhealthy state (seen: ended 0.03 ms after publishing it).
    loss_after_fault(
        "sglang-native-sigterm",
        Shipped::SglangNative,
        |server| server.proc.signal("TERM"),
        &["liveness reported NOT_SERVING", "liveness stream ended"],
    );
}

#[test]
fn shipped_sglang_native_sigkill_is_a_loss() {
    loss_after_fault(
        "sglang-native-sigkill",
        Shipped::SglangNative,
        |server| server.proc.signal("KILL"),
        &["liveness stream failed"],
    );
}

// ---- SGLang through smg-grpc-servicer 0.14.1 ----------------------------------

/// One streaming Generate on the smg API, every message as it came.
async fn generate_all_smg(addr: SocketAddr, rid: &str) -> Vec<sglang::GenerateResponse> {
    every_message(
        sglang::sglang_scheduler_client::SglangSchedulerClient::new(connect(addr).await).generate(
            sglang::GenerateRequest {
                request_id: rid.to_string(),
                tokenized: Some(sglang::TokenizedInput {
                    original_text: String::new(),
                    input_ids: vec![1, 2, 3],
                }),
                sampling_params: Some(sglang::SamplingParams {
                    max_new_tokens: Some(6),
                }),
                stream: true,
            },
        ),
    )
    .await
}

/// The scheduler's pid, as the server printed it.
fn scheduler_pid(server: &ShippedServer) -> String {
    let log = server.proc.log_text();
    let at = log
        .find("scheduler pid ")
        .unwrap_or_else(|| panic!("no scheduler pid in:\n{log}"));
    log[at + "scheduler pid ".len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect()
}

#[test]
fn shipped_sglang_smg_registers_after_its_warm_up_with_its_lengths_and_serves_identically() {
    let dir = TempDir::new("shipped-smg-register");
    let warmup = Duration::from_secs(3);
    let (server, mut sidecar, took) = serving_shipped(&dir, Shipped::SglangSmg, warmup);
    let log = sidecar.proc.log_text();
    assert!(
        log.contains(
            "warming up: its health service \"sglang.grpc.scheduler.SglangScheduler\" reports \
             NOT_SERVING"
        ),
        "the warm-up is waited out, and said:\n{log}"
    );
    let r = sidecar.record(&sidecar.records()[0]);
    assert_eq!(r["engine"]["kind"], "sglang", "{r}");
    assert_eq!(r["engine"]["version"], "0.5.23", "{r}");
    assert!(
        r["engine"]["identity"]
            .as_str()
            .is_some_and(|i| i.starts_with("started 20")),
        "{r}"
    );
    assert_eq!(r["model"]["name"], "shipped-sglang", "{r}");
    // Its max_context_length is the KV pool: recorded as the pool, and the
    // sequence length from SGLang's own input limit (4090 + 6).
    assert_eq!(r["model"]["kv_cache_tokens"], 65_536, "{r}");
    assert_eq!(r["model"]["max_seq_len"], 4_096, "{r}");
    assert_eq!(r["model"]["max_input_len"], 4_090, "{r}");

    let direct = serves_identically(&server, &sidecar, |addr| generate_all_smg(addr, "same-id"));
    assert!(direct.len() >= 6, "{direct:?}");
    // Seconds of serving: its load and health answer, no loss.
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running(), "{}", sidecar.proc.log_text());
    eprintln!("figure: shipped SGLang (smg) registered {took:?} after start (warm-up {warmup:?})");
    stop_cleanly(sidecar);
}

/// The servicer's own stop (NOT_SERVING, then `server.stop(5)`): the loss
/// line says the engine stopped, never that a keepalive ping went unanswered.
#[test]
fn shipped_sglang_smg_sigterm_reads_as_the_stop_it_is() {
    loss_after_fault(
        "sglang-smg-sigterm",
        Shipped::SglangSmg,
        |server| server.proc.signal("TERM"),
        &[GOAWAY_STOP, "liveness reported NOT_SERVING"],
    );
}

/// The scheduler process dying: the servicer's watchdog (a 1 s poll) stops
/// the server, and that is a loss.
#[test]
fn shipped_sglang_smg_scheduler_death_is_a_loss() {
    loss_after_fault(
        "sglang-smg-scheduler-killed",
        Shipped::SglangSmg,
        |server| {
            let pid = scheduler_pid(server);
            let killed = std::process::Command::new("kill")
                .args(["-KILL", &pid])
                .status()
                .expect("run kill")
                .success();
            assert!(killed, "kill the scheduler {pid}");
        },
        &[GOAWAY_STOP, "liveness reported NOT_SERVING"],
    );
}

/// The scheduler stalled (a request pending, nothing from the scheduler for
/// over 30 s): the servicer's own stall check turns its service NOT_SERVING.
#[test]
fn shipped_sglang_smg_scheduler_stall_is_a_loss() {
    loss_after_fault(
        "sglang-smg-stall",
        Shipped::SglangSmg,
        |server| server.proc.signal("USR1"),
        &["liveness reported NOT_SERVING"],
    );
}

#[test]
fn shipped_sglang_smg_sigkill_is_a_loss() {
    loss_after_fault(
        "sglang-smg-sigkill",
        Shipped::SglangSmg,
        |server| server.proc.signal("KILL"),
        CONNECTION_GONE,
    );
}

// ---- vLLM 0.34.0's launcher with smg-grpc-servicer 0.14.1 ----------------------

/// One streaming Generate on vLLM's API, every message as it came.
async fn generate_all_vllm(addr: SocketAddr, rid: &str) -> Vec<vllm::GenerateResponse> {
    every_message(
        vllm::vllm_engine_client::VllmEngineClient::new(connect(addr).await).generate(
            vllm::GenerateRequest {
                request_id: rid.to_string(),
                input: Some(vllm::generate_request::Input::Tokenized(
                    vllm::TokenizedInput {
                        original_text: String::new(),
                        input_ids: vec![1, 2, 3],
                    },
                )),
                sampling_params: Some(vllm::SamplingParams {
                    max_tokens: Some(6),
                }),
                stream: true,
            },
        ),
    )
    .await
}

#[test]
fn shipped_vllm_registers_with_its_version_and_serves_identically() {
    let dir = TempDir::new("shipped-vllm-register");
    let (server, mut sidecar, took) = serving_shipped(&dir, Shipped::Vllm, Duration::ZERO);
    let r = sidecar.record(&sidecar.records()[0]);
    assert_eq!(r["engine"]["kind"], "vllm", "{r}");
    assert_eq!(r["engine"]["version"], "0.34.0", "GetLoads says it: {r}");
    assert_eq!(r["model"]["name"], "shipped-vllm", "{r}");
    assert_eq!(r["model"]["max_seq_len"], 4_096, "{r}");
    let direct = serves_identically(&server, &sidecar, |addr| generate_all_vllm(addr, "same-id"));
    assert!(direct.len() >= 6, "{direct:?}");
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running(), "{}", sidecar.proc.log_text());
    eprintln!("figure: shipped vLLM registered {took:?} after its server listened");
    stop_cleanly(sidecar);
}

/// A dead engine core (AsyncLLM.errored): the health servicer's
/// `check_health()` fails, its services answer NOT_SERVING at the next Check.
#[test]
fn shipped_vllm_dead_engine_core_is_a_loss() {
    loss_after_fault(
        "vllm-dead-engine-core",
        Shipped::Vllm,
        |server| server.proc.signal("USR1"),
        &["liveness reported NOT_SERVING"],
    );
}

/// The launcher's own stop (NOT_SERVING, then `server.stop(5)`): read as
/// the stop it is, never as a keepalive timeout.
#[test]
fn shipped_vllm_sigterm_reads_as_the_stop_it_is() {
    loss_after_fault(
        "vllm-sigterm",
        Shipped::Vllm,
        |server| server.proc.signal("TERM"),
        &[GOAWAY_STOP, "liveness reported NOT_SERVING"],
    );
}

#[test]
fn shipped_vllm_sigkill_is_a_loss() {
    loss_after_fault(
        "vllm-sigkill",
        Shipped::Vllm,
        |server| server.proc.signal("KILL"),
        CONNECTION_GONE,
    );
}
