//! The engines' own gRPC servers as they ship on PyPI, with only their engine
//! core replaced, against the real binary: what our mock plays is checked
//! against what ships.
//!
//! SGLang 0.5.23's native server (`clients/sglang_native_server.py`: the
//! wheel's Rust server and its Python bridge, a stand-in TokenizerManager).
//! scripts/test.sh installs the wheel into `target/engines-venv` (or
//! `LLM_SIDECAR_ENGINES_PYTHON` names the Python that has it).
//!
//! Each test prints its figure (ms from the fault to the record's removal)
//! on stderr: `cargo test ... shipped_servers:: -- --nocapture`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use llm_sidecar_engine_api::sglang_runtime::sglang_service_client::SglangServiceClient;
use llm_sidecar_engine_api::sglang_runtime::{GenerateRequest, GenerateResponse, SamplingParams};

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

/// SGLang's native server, started and listening (warming up for `warmup`).
struct ShippedSglang {
    proc: Proc,
    grpc: SocketAddr,
}

impl ShippedSglang {
    fn start(dir: &Path, warmup: Duration) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/process/clients/sglang_native_server.py");
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
                proc.log_text().contains("gRPC server listening") || !proc.running()
            });
            if proc.running() {
                return ShippedSglang { proc, grpc };
            }
            let log = proc.log_text();
            assert!(
                log.contains("ddress already in use") || log.contains("ddrInUse"),
                "the SGLang server did not start:\n{log}"
            );
        }
        panic!("no free port for the SGLang server after 5 attempts");
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
fn serving_shipped(dir: &TempDir, warmup: Duration) -> (ShippedSglang, Sidecar, Duration) {
    let server = ShippedSglang::start(&dir.0, warmup);
    let started = Instant::now();
    let sidecar = Sidecar::start(&dir.0, server.grpc, &[]);
    sidecar.wait_serving();
    (server, sidecar, started.elapsed())
}

/// One streaming Generate, every message as it came.
async fn generate_all(addr: SocketAddr, rid: &str) -> Vec<GenerateResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut stream = SglangServiceClient::new(channel)
        .generate(GenerateRequest {
            input_ids: vec![1, 2, 3],
            sampling_params: Some(SamplingParams {
                max_new_tokens: Some(6),
                ..Default::default()
            }),
            stream: Some(true),
            rid: Some(rid.to_string()),
        })
        .await
        .expect("Generate answers")
        .into_inner();
    let mut all = Vec::new();
    while let Some(message) = stream.message().await.expect("the stream ends OK") {
        all.push(message);
    }
    all
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

#[test]
fn shipped_sglang_native_registers_after_its_warm_up_with_its_instance_id_and_serves_identically() {
    let dir = TempDir::new("shipped-sglang-register");
    let warmup = Duration::from_secs(3);
    let (server, mut sidecar, took) = serving_shipped(&dir, warmup);
    let log = sidecar.proc.log_text();
    assert!(
        log.contains(
            "warming up: its health service \"sglang.runtime.v1.SglangService/HealthCheck\" \
             reports healthy=false"
        ),
        "the warm-up is waited out, and said:\n{log}"
    );
    assert!(
        took >= warmup,
        "registered after {took:?}, before the warm-up ended"
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

    let runtime = rt();
    let direct = runtime.block_on(generate_all(server.grpc, "same-id"));
    let through = runtime.block_on(generate_all(sidecar.listen, "same-id"));
    assert_eq!(direct.len(), 6, "{direct:?}");
    assert_eq!(
        through, direct,
        "Generate through the sidecar is Generate direct"
    );
    eprintln!("figure: shipped SGLang native registered {took:?} after start (warm-up {warmup:?})");

    sidecar.proc.signal("TERM");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    assert!(sidecar.records().is_empty());
}

#[test]
fn shipped_sglang_native_scheduler_failure_is_a_loss_by_its_engine_state() {
    let dir = TempDir::new("shipped-sglang-unhealthy");
    let (server, mut sidecar, _) = serving_shipped(&dir, Duration::from_millis(500));
    let instance = server.instance_id();
    let (after, line) = lost_after(&mut sidecar, || server.proc.signal("USR1"));
    assert!(
        line.contains("SGLang engine lost: liveness reported NOT_SERVING"),
        "{line}"
    );
    assert!(line.ends_with(&format!("(instance {instance})")), "{line}");
    assert!(
        sidecar
            .proc
            .log_text()
            .contains("the SGLang engine reports itself unhealthy (WatchEngineState)")
    );
    eprintln!("figure: shipped SGLang native unhealthy -> withdrawn in {after:?}");
}

#[test]
fn shipped_sglang_native_pause_is_said_and_no_loss() {
    let dir = TempDir::new("shipped-sglang-pause");
    let (server, mut sidecar, _) = serving_shipped(&dir, Duration::from_millis(500));
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
    sidecar.proc.signal("TERM");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
}

#[test]
fn shipped_sglang_native_sigterm_is_a_loss_at_once() {
    let dir = TempDir::new("shipped-sglang-sigterm");
    let (server, mut sidecar, _) = serving_shipped(&dir, Duration::from_millis(500));
    let (after, line) = lost_after(&mut sidecar, || server.proc.signal("TERM"));
    // SGLang's SIGTERM makes it unhealthy at once; with no call to drain its
    // server stops a moment later, and its state stream may end before it
    // sends the unhealthy state (seen: ended 0.03 ms after publishing it).
    assert!(
        line.contains("SGLang engine lost: liveness reported NOT_SERVING")
            || line.contains("SGLang engine lost: liveness stream ended"),
        "{line}"
    );
    eprintln!("figure: shipped SGLang native SIGTERM -> withdrawn in {after:?}");
}

#[test]
fn shipped_sglang_native_sigkill_is_a_loss() {
    let dir = TempDir::new("shipped-sglang-sigkill");
    let (server, mut sidecar, _) = serving_shipped(&dir, Duration::from_millis(500));
    let (after, line) = lost_after(&mut sidecar, || server.proc.signal("KILL"));
    assert!(
        line.contains("SGLang engine lost: liveness stream failed"),
        "{line}"
    );
    eprintln!("figure: shipped SGLang native SIGKILL -> withdrawn in {after:?}");
}
