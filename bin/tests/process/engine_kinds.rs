//! Every engine kind end to end: the mock plays TensorRT-LLM's two APIs, vLLM
//! and SGLang with each one's real health behaviour, and the sidecar is left
//! at `--engine-kind auto`. What an operator sees per kind: the detection
//! line, the record's values, each way that kind is lost (with its line),
//! a SIGKILL, a SIGTERM drain with a call in flight, and what is not a loss.

use std::time::Duration;

use llm_sidecar_engine_api::{openengine, sglang, sglang_runtime, trtllm, vllm};
use tonic::Code;
use tonic::transport::Channel;

use crate::support::relay::Relay;
use crate::support::*;

/// One kind as the tests name it.
#[derive(Clone, Copy)]
struct Kind {
    /// `--kind` / `--engine-kind` value.
    flag: &'static str,
    /// How the loss line names the engine.
    engine: &'static str,
    /// The gRPC service detection finds.
    service: &'static str,
}

const TRTLLM: Kind = Kind {
    flag: "trtllm",
    engine: "TensorRT-LLM",
    service: "trtllm.TrtllmService",
};
const OPENENGINE: Kind = Kind {
    flag: "openengine",
    engine: "TensorRT-LLM",
    service: "openengine.v1.Control",
};
const VLLM: Kind = Kind {
    flag: "vllm",
    engine: "vLLM",
    service: "vllm.grpc.engine.VllmEngine",
};
const SGLANG: Kind = Kind {
    flag: "sglang",
    engine: "SGLang",
    service: "sglang.grpc.scheduler.SglangScheduler",
};
const VLLM_NATIVE: Kind = Kind {
    flag: "vllm-native",
    engine: "vLLM",
    service: "vllm.Inference",
};
const SGLANG_NATIVE: Kind = Kind {
    flag: "sglang-native",
    engine: "SGLang",
    service: "sglang.runtime.v1.SglangService",
};

fn mock_args<'a>(kind: Kind, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--kind", kind.flag];
    args.extend_from_slice(extra);
    args
}

/// The mock playing `kind` and a sidecar at `--engine-kind auto` in front,
/// registered and serving, having said once what it found.
fn serving_kind(dir: &TempDir, kind: Kind, mock: &[&str], sidecar: &[&str]) -> (Mock, Sidecar) {
    let (mock, sidecar) = serving(&dir.0, &mock_args(kind, mock), sidecar);
    assert_detected(&sidecar, kind, mock.grpc);
    (mock, sidecar)
}

fn assert_detected(sidecar: &Sidecar, kind: Kind, engine: std::net::SocketAddr) {
    let line = format!(
        "the engine at {engine} serves {}: following it as --engine-kind {}",
        kind.service, kind.flag
    );
    assert_eq!(
        sidecar.proc.count_lines(&line),
        1,
        "detection logged once at INFO ({line}); log:\n{}",
        sidecar.proc.log_text()
    );
    assert!(sidecar.proc.wait_for_line(&line, HANG).contains(" INFO "));
}

async fn channel(addr: std::net::SocketAddr) -> Channel {
    llm_sidecar_loadgen::connect(&addr.to_string())
        .await
        .expect("connect")
}

fn engine_kind(kind: Kind) -> llm_sidecar_io::engine::EngineKind {
    llm_sidecar_io::engine::EngineKind::from_name(kind.flag).expect("a kind")
}

/// One streaming Generate of `tokens` tokens in `kind`'s API; the tokens
/// streamed, or the status's code and message.
async fn generate(
    kind: Kind,
    addr: std::net::SocketAddr,
    id: &str,
    tokens: u32,
) -> Result<usize, (Code, String)> {
    generate_call(kind, addr, id, tokens)
        .await
        .map_err(|s| (s.code(), s.message().to_string()))
}

async fn generate_call(
    kind: Kind,
    addr: std::net::SocketAddr,
    id: &str,
    tokens: u32,
) -> Result<usize, tonic::Status> {
    let pieces = llm_sidecar_loadgen::generate::generate(
        engine_kind(kind),
        channel(addr).await,
        id.to_string(),
        8,
        tokens,
    )
    .await?;
    llm_sidecar_loadgen::generate::tokens_of(pieces).await
}

/// The kind's own health RPC, as a gateway calls it.
async fn health_rpc(kind: Kind, addr: std::net::SocketAddr) -> Result<(), tonic::Status> {
    let ch = channel(addr).await;
    match kind.flag {
        "trtllm" => trtllm::trtllm_service_client::TrtllmServiceClient::new(ch)
            .health_check(trtllm::HealthCheckRequest {})
            .await
            .map(drop),
        "openengine" => openengine::control_client::ControlClient::new(ch)
            .health(openengine::HealthRequest::default())
            .await
            .map(drop),
        "vllm" => vllm::vllm_engine_client::VllmEngineClient::new(ch)
            .health_check(vllm::HealthCheckRequest {})
            .await
            .map(drop),
        "sglang-native" => sglang_runtime::sglang_service_client::SglangServiceClient::new(ch)
            .health_check(sglang_runtime::HealthCheckRequest {})
            .await
            .map(drop),
        _ => sglang::sglang_scheduler_client::SglangSchedulerClient::new(ch)
            .health_check(sglang::HealthCheckRequest {})
            .await
            .map(drop),
    }
}

// ---- detection and the record ----------------------------------------------

#[test]
fn auto_finds_trtllm_and_keeps_todays_record() {
    let dir = TempDir::new("kind-trtllm");
    let (_mock, mut sidecar) = serving_kind(&dir, TRTLLM, &[], &[]);
    let r = sidecar.record(&sidecar.records()[0]);
    assert_eq!(r["engine"]["kind"], "trtllm");
    assert!(
        r["engine"]["identity"]
            .as_str()
            .is_some_and(|i| i.starts_with("trtllm 1.0.0-mock backend=pytorch")),
        "{r}"
    );
    sidecar.proc.stop_cleanly();
}

#[test]
fn auto_finds_openengine_and_registers_its_instance_id_and_served_model() {
    let dir = TempDir::new("kind-openengine");
    let (mock, mut sidecar) = serving_kind(
        &dir,
        OPENENGINE,
        &["--model-id", "acme/oe-8b", "--engine-version", "1.3.0rc9"],
        &[],
    );
    let r = sidecar.record(&sidecar.records()[0]);
    let instance = mock.instance_id();
    let pid = mock.proc.pid();
    assert!(
        instance.contains(&format!("-{pid}-")),
        "<host>-<pid>-<ms>: {instance}"
    );
    assert_eq!(r["engine"]["kind"], "openengine");
    assert_eq!(r["engine"]["identity"], instance.as_str());
    assert_eq!(r["engine"]["version"], "1.3.0rc9");
    assert_eq!(r["model"]["name"], "acme/oe-8b");
    assert_eq!(r["model"]["max_seq_len"], 8192);
    sidecar.proc.stop_cleanly();
}

#[test]
fn vllm_with_its_port_closed_while_loading_is_waited_for_then_registered() {
    let dir = TempDir::new("kind-vllm");
    let mock = Mock::start(
        &dir.0,
        free_addr(),
        &mock_args(
            VLLM,
            &[
                "--load-delay",
                "2s",
                "--warmup",
                "1s",
                "--model-id",
                "acme/v-8b",
                "--engine-version",
                "0.11.0",
            ],
        ),
    );
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    sidecar
        .proc
        .wait_for_line("Connection refused", Duration::from_secs(10));
    sidecar.proc.wait_for_line("warming up", HANG);
    assert!(
        sidecar.records().is_empty(),
        "not registered while warming up"
    );
    sidecar.wait_serving();
    assert_detected(&sidecar, VLLM, mock.grpc);
    let r = sidecar.record(&sidecar.records()[0]);
    assert_eq!(r["engine"]["kind"], "vllm");
    assert_eq!(r["engine"]["version"], "0.11.0");
    assert_eq!(r["model"]["name"], "acme/v-8b");
    assert_eq!(r["model"]["max_input_len"], 4096);
    assert_eq!(sidecar.proc.count_lines(" engine lost: "), 0);
    sidecar.proc.stop_cleanly();
}

#[test]
fn sglang_warm_up_is_not_a_loss_and_start_time_is_its_identity() {
    let dir = TempDir::new("kind-sglang");
    let mock = Mock::start(
        &dir.0,
        free_addr(),
        &mock_args(SGLANG, &["--warmup", "3s", "--model-id", "acme/s-8b"]),
    );
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
    let line = sidecar.proc.wait_for_line("warming up", HANG);
    assert!(
        line.contains("\"sglang.grpc.scheduler.SglangScheduler\" reports NOT_SERVING"),
        "{line}"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(sidecar.proc.running(), "NOT_SERVING in warm-up is no loss");
    assert!(
        sidecar.records().is_empty(),
        "not registered while warming up"
    );
    sidecar.wait_serving();
    assert_detected(&sidecar, SGLANG, mock.grpc);
    let r = sidecar.record(&sidecar.records()[0]);
    assert_eq!(r["engine"]["kind"], "sglang");
    assert_eq!(r["model"]["name"], "acme/s-8b");
    // smg's servicer reports its KV pool (65,536) as max_context_length: the
    // record has it as the pool, and the model's 8,192 tokens as the
    // sequence length (SGLang's max_req_input_len, 8,186, + 6).
    assert_eq!(r["model"]["kv_cache_tokens"], 65_536, "{r}");
    assert_eq!(r["model"]["max_seq_len"], 8_192, "{r}");
    assert_eq!(r["model"]["max_input_len"], 8_186, "{r}");
    let identity = r["engine"]["identity"].as_str().expect("identity");
    assert!(
        identity.starts_with("started 20") && identity.ends_with(".000Z"),
        "start_time in whole seconds: {identity}"
    );
    assert_eq!(sidecar.proc.count_lines(" engine lost: "), 0);
    sidecar.proc.stop_cleanly();
}

#[test]
fn an_engine_serving_none_of_the_apis_fails_start_up_saying_what_was_tried() {
    let dir = TempDir::new("kind-none");
    let mock = Mock::start(&dir.0, free_addr(), &["--no-engine-api"]);
    let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &["--startup-deadline", "3s"]);
    assert_eq!(sidecar.proc.wait_exit(HANG), 3);
    let log = sidecar.proc.log_text();
    assert!(
        log.contains(
            "serves none of the engine APIs llm-sidecar follows (tried \
             /openengine.v1.Control/GetServerInfo, /trtllm.TrtllmService/GetModelInfo, \
             /vllm.Control/GetModelInfo, /vllm.grpc.engine.VllmEngine/GetModelInfo, \
             /sglang.grpc.scheduler.SglangScheduler/GetModelInfo, \
             /sglang.runtime.v1.SglangService/GetModelInfo: every one UNIMPLEMENTED)"
        ),
        "{log}"
    );
    assert_eq!(
        sidecar.proc.count_lines("serves none of the engine APIs"),
        1,
        "said once, not every attempt"
    );
    assert!(sidecar.records().is_empty());
}

// ---- OpenEngine ------------------------------------------------------------

#[test]
fn openengine_not_serving_is_a_loss_named_by_its_engine_name_and_instance_id() {
    let dir = TempDir::new("oe-notserving");
    let (mock, mut sidecar) = serving_kind(&dir, OPENENGINE, &["--engine-name", "acme_llm"], &[]);
    let instance = mock.instance_id();
    // `inference` is never followed.
    mock.control("/liveness?service=inference&status=2");
    std::thread::sleep(Duration::from_millis(500));
    assert!(sidecar.proc.running(), "inference NOT_SERVING is no loss");
    mock.control("/liveness?status=2");
    let line = assert_engine_lost(
        &mut sidecar,
        "acme_llm",
        &instance,
        "liveness reported NOT_SERVING",
    );
    assert!(line.ends_with(&format!(
        "acme_llm engine lost: liveness reported NOT_SERVING (instance {instance})"
    )));
}

#[test]
fn openengine_get_load_failing_unavailable_is_a_stale_load_loss() {
    let dir = TempDir::new("oe-stale");
    let (mock, mut sidecar) = serving_kind(&dir, OPENENGINE, &[], &["--stale-after", "2s"]);
    let instance = mock.instance_id();
    mock.control("/getload?mode=unavailable");
    assert_engine_lost(
        &mut sidecar,
        "TensorRT-LLM",
        &instance,
        "routing load stale for 2",
    );
}

#[test]
fn openengine_without_health_warns_once_then_a_stalled_get_load_is_still_a_loss() {
    let dir = TempDir::new("oe-nohealth");
    let (mock, mut sidecar) =
        serving_kind(&dir, OPENENGINE, &["--no-health"], &["--stale-after", "2s"]);
    let instance = mock.instance_id();
    sidecar
        .proc
        .wait_for_line("does not serve grpc.health.v1", HANG);
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running(), "no health service is no loss");
    assert_eq!(
        sidecar.proc.count_lines(" WARN "),
        1,
        "one warning; log:\n{}",
        sidecar.proc.log_text()
    );
    mock.control("/getload?mode=stall");
    assert_engine_lost(
        &mut sidecar,
        "TensorRT-LLM",
        &instance,
        "routing load stale for 2",
    );
}

#[test]
fn openengine_restarted_on_the_same_port_is_a_loss_by_its_new_instance_id() {
    let dir = TempDir::new("oe-restart");
    // Without health, only the identity can tell the restart apart.
    let (mut mock, mut sidecar) = serving_kind(
        &dir,
        OPENENGINE,
        &["--no-health"],
        &["--stale-after", "30s"],
    );
    // Until the Watch has had its UNIMPLEMENTED answer, a failing stream is
    // (rightly) a loss of its own: kill the engine only once it is unwatched.
    sidecar
        .proc
        .wait_for_line("does not serve grpc.health.v1", HANG);
    let old = mock.instance_id();
    let grpc = mock.grpc;
    mock.proc.signal("KILL");
    mock.proc.wait_exit_or_signal(HANG);
    let restarted = Mock::start(&dir.0, grpc, &mock_args(OPENENGINE, &["--no-health"]));
    let new = restarted.stats()["instance_id"]
        .as_str()
        .expect("id")
        .to_string();
    assert_ne!(old, new);
    let line = assert_engine_lost(
        &mut sidecar,
        "TensorRT-LLM",
        &old,
        &format!("new engine identity {old} -> {new}"),
    );
    assert!(line.contains(&new));
}

#[test]
fn openengine_connection_cut_is_reconnected_not_a_loss() {
    let dir = TempDir::new("oe-cut");
    let mock = Mock::start(
        &dir.0,
        free_addr(),
        &mock_args(OPENENGINE, &["--no-health"]),
    );
    let relay = Relay::start(mock.grpc);
    let mut sidecar = Sidecar::start(&dir.0, relay.addr, &[]);
    sidecar.wait_serving();
    // Serving opens the Watch; a cut before its UNIMPLEMENTED answer is a
    // failed liveness stream, which is a loss (docs/CONTRACT.md, the liveness
    // table). Cut only the connection of an engine whose liveness is unwatched.
    sidecar
        .proc
        .wait_for_line("does not serve grpc.health.v1", HANG);
    // A call first, so the request plane's own engine connection is open and
    // is cut too: the call after the cut must get a new one.
    assert_eq!(
        rt().block_on(generate(OPENENGINE, sidecar.listen, "before-cut", 4)),
        Ok(4)
    );
    relay.cut();
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        sidecar.proc.running(),
        "OpenEngine has an identity of its own: a new connection is no loss; log:\n{}",
        sidecar.proc.log_text()
    );
    assert_eq!(
        rt().block_on(generate(OPENENGINE, sidecar.listen, "after-cut", 4)),
        Ok(4)
    );
    sidecar.proc.stop_cleanly();
}

// ---- vLLM --------------------------------------------------------------------

#[test]
fn vllm_single_message_watch_is_not_a_loss_over_seconds_of_serving() {
    let dir = TempDir::new("vllm-serving");
    let (mock, mut sidecar) = serving_kind(&dir, VLLM, &[], &[]);
    let loads_before = mock.stats()["load_calls"].as_u64().unwrap_or(0);
    let runtime = rt();
    for i in 0..8 {
        let tokens = runtime.block_on(generate(VLLM, sidecar.listen, &format!("v-{i}"), 16));
        assert_eq!(tokens, Ok(16));
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(sidecar.proc.running(), "log:\n{}", sidecar.proc.log_text());
    assert_eq!(sidecar.proc.count_lines(" engine lost: "), 0);
    assert_eq!(sidecar.proc.count_lines(" WARN "), 0);
    assert_eq!(sidecar.state()["state"], "Serving");
    assert!(
        mock.stats()["load_calls"].as_u64().unwrap_or(0) > loads_before,
        "GetLoads keeps being asked"
    );
    sidecar.proc.stop_cleanly();
}

#[test]
fn vllm_not_serving_after_serving_is_a_polled_loss() {
    let dir = TempDir::new("vllm-notserving");
    let (mock, mut sidecar) = serving_kind(&dir, VLLM, &[], &[]);
    let id = sidecar.instance_id();
    mock.control("/liveness?status=2");
    let line = assert_engine_lost(&mut sidecar, "vLLM", &id, "liveness reported NOT_SERVING");
    assert!(line.ends_with(&format!(
        "vLLM engine lost: liveness reported NOT_SERVING (instance {id})"
    )));
}

#[test]
fn vllm_health_check_failing_is_a_loss() {
    let dir = TempDir::new("vllm-checkfails");
    let (mock, mut sidecar) = serving_kind(&dir, VLLM, &[], &[]);
    let id = sidecar.instance_id();
    // A service missing from the very first poll is an engine without one
    // (a warning, no loss): fail it only once a SERVING was read.
    wait_until(HANG, "the first polled SERVING", || {
        sidecar.metric("llm_sidecar_liveness_watch_status") == Some(1.0)
    });
    mock.control("/unregister");
    assert_engine_lost(&mut sidecar, "vLLM", &id, "health check failed: NOT_FOUND");
}

#[test]
fn vllm_connection_lost_is_a_loss_though_the_engine_runs_on() {
    let dir = TempDir::new("vllm-cut");
    let mock = Mock::start(&dir.0, free_addr(), &mock_args(VLLM, &[]));
    let relay = Relay::start(mock.grpc);
    let mut sidecar = Sidecar::start(&dir.0, relay.addr, &[]);
    sidecar.wait_serving();
    let id = sidecar.instance_id();
    relay.cut();
    assert_engine_lost(&mut sidecar, "vLLM", &id, "engine connection lost");
}

#[test]
fn vllm_get_loads_failing_is_a_stale_load_loss() {
    let dir = TempDir::new("vllm-stale");
    let (mock, mut sidecar) = serving_kind(&dir, VLLM, &[], &["--stale-after", "2s"]);
    let id = sidecar.instance_id();
    mock.control("/getload?mode=unavailable");
    assert_engine_lost(&mut sidecar, "vLLM", &id, "routing load stale for 2");
}

// ---- SGLang ------------------------------------------------------------------

#[test]
fn sglang_stall_turning_not_serving_is_a_loss() {
    let dir = TempDir::new("sglang-stall");
    let (mock, mut sidecar) = serving_kind(&dir, SGLANG, &[], &[]);
    let id = sidecar.instance_id();
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running(), "its one-message Watch is no loss");
    mock.control("/stall");
    assert_engine_lost(&mut sidecar, "SGLang", &id, "liveness reported NOT_SERVING");
}

#[test]
fn sglang_get_loads_stalling_is_a_stale_load_loss() {
    let dir = TempDir::new("sglang-stale");
    let (mock, mut sidecar) = serving_kind(&dir, SGLANG, &[], &["--stale-after", "2s"]);
    let id = sidecar.instance_id();
    mock.control("/getload?mode=stall");
    assert_engine_lost(&mut sidecar, "SGLang", &id, "routing load stale for 2");
}

/// The smg servicers' graceful stop (NOT_SERVING, then `server.stop(grace)`,
/// which says GOAWAY NO_ERROR): their connection goes before a Check sees
/// NOT_SERVING, and the loss line says the engine stopped, not that a
/// keepalive ping went unanswered; /metrics counts it as `engine_goaway`.
#[test]
fn a_graceful_stop_of_vllm_or_sglang_reads_as_the_stop_it_is() {
    for kind in [VLLM, SGLANG] {
        let dir = TempDir::new(&format!("graceful-{}", kind.flag));
        let (mock, mut sidecar) = serving_kind(&dir, kind, &[], &["--health-poll-interval", "5s"]);
        let id = sidecar.instance_id();
        mock.control("/stop?grace_ms=2000");
        let line = sidecar.proc.assert_engine_lost(
            kind.engine,
            &id,
            "engine stopped: it said GOAWAY (NO_ERROR), a graceful stop",
        );
        assert!(!line.contains("keepalive"), "{}: {line}", kind.flag);
    }
}

// ---- every kind: SIGKILL, and a SIGTERM drain with a call in flight ------------

fn sigkill_is_a_loss(kind: Kind, reasons: &[&str]) {
    let dir = TempDir::new(&format!("kill-{}", kind.flag));
    let (mock, mut sidecar) = serving_kind(&dir, kind, &[], &[]);
    let instance = match kind.flag {
        "openengine" | "vllm-native" | "sglang-native" => mock.instance_id(),
        _ => sidecar.instance_id(),
    };
    mock.proc.signal("KILL");
    let code = sidecar.proc.wait_exit(HANG);
    let log = sidecar.proc.log_text();
    assert_eq!(code, 1, "{log}");
    let line = log
        .lines()
        .find(|l| l.contains(" engine lost: "))
        .unwrap_or_else(|| panic!("no loss line:\n{log}"));
    assert!(
        reasons
            .iter()
            .any(|r| line.contains(&format!("{} engine lost: {r}", kind.engine))),
        "{line} is one of {reasons:?}"
    );
    assert!(line.ends_with(&format!("(instance {instance})")), "{line}");
    sidecar.proc.assert_withdrawn_before_exit(1);
    assert!(sidecar.records().is_empty());
}

#[test]
fn sigkill_of_trtllm_is_a_loss() {
    sigkill_is_a_loss(TRTLLM, &["liveness stream failed"]);
}

#[test]
fn sigkill_of_openengine_is_a_loss() {
    sigkill_is_a_loss(OPENENGINE, &["liveness stream failed"]);
}

#[test]
fn sigkill_of_vllm_is_a_loss_by_its_connection() {
    sigkill_is_a_loss(VLLM, &["engine connection lost", "health check failed"]);
}

#[test]
fn sigkill_of_sglang_is_a_loss_by_its_connection() {
    sigkill_is_a_loss(SGLANG, &["engine connection lost", "health check failed"]);
}

/// SIGTERM with a call in flight: withdrawn first, the kind's own health RPC
/// answered "draining" by the sidecar (never reaching the engine), the call
/// completes with every token, exit 0.
fn sigterm_drains_a_call(kind: Kind) {
    let dir = TempDir::new(&format!("drain-{}", kind.flag));
    let (_mock, mut sidecar) = serving_kind(
        &dir,
        kind,
        &["--token-delay", "10ms"],
        &["--router-grace", "1s", "--drain-timeout", "10s"],
    );
    let runtime = rt();
    runtime.block_on(async {
        // vLLM's native API has no health RPC of its own: its callers ask
        // grpc.health.v1 for vllm.Inference, which the sidecar answers itself.
        let own_health = kind.flag == "vllm-native";
        if own_health {
            assert_eq!(own_health_status(sidecar.listen, kind.service).await, 1);
        } else {
            assert_eq!(
                health_rpc(kind, sidecar.listen).await.map_err(|s| s.code()),
                Ok(())
            );
        }
        let listen = sidecar.listen;
        let long = tokio::spawn(async move { generate(kind, listen, "in-flight", 150).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        sidecar.proc.signal("TERM");
        wait_until(HANG, "the record to be withdrawn", || {
            sidecar.records().is_empty()
        });
        if own_health {
            assert_eq!(
                own_health_status(sidecar.listen, kind.service).await,
                2,
                "NOT_SERVING from the first moment of the drain"
            );
        } else {
            let refused = health_rpc(kind, sidecar.listen)
                .await
                .expect_err("the health RPC while draining");
            // "draining" is the sidecar's own answer: the engine never says it.
            assert_eq!(
                (refused.code(), refused.message()),
                (Code::Unavailable, "draining")
            );
        }
        assert_eq!(long.await.expect("join"), Ok(150), "every token delivered");
    });
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    sidecar.proc.assert_withdrawn_before_exit(0);
    assert_eq!(sidecar.proc.count_lines(" engine lost: "), 0);
}

#[test]
fn sigterm_drains_a_trtllm_call() {
    sigterm_drains_a_call(TRTLLM);
}

#[test]
fn sigterm_drains_an_openengine_call() {
    sigterm_drains_a_call(OPENENGINE);
}

#[test]
fn sigterm_drains_a_vllm_call() {
    sigterm_drains_a_call(VLLM);
}

#[test]
fn sigterm_drains_an_sglang_call() {
    sigterm_drains_a_call(SGLANG);
}

#[test]
fn sigterm_drains_a_vllm_native_call() {
    sigterm_drains_a_call(VLLM_NATIVE);
}

#[test]
fn sigterm_drains_an_sglang_native_call() {
    sigterm_drains_a_call(SGLANG_NATIVE);
}

// ---- the native servers: vLLM's Rust frontend, SGLang's --grpc-port ---------

#[test]
fn auto_finds_vllm_native_and_registers_its_instance_id() {
    let dir = TempDir::new("kind-vllm-native");
    let (mock, mut sidecar) = serving_kind(
        &dir,
        VLLM_NATIVE,
        &["--model-id", "acme/v-8b", "--engine-version", "0.33.0"],
        &[],
    );
    let r = sidecar.record(&sidecar.records()[0]);
    let instance = mock.instance_id();
    assert_eq!(r["engine"]["kind"], "vllm-native", "{r}");
    assert_eq!(r["engine"]["identity"], instance.as_str(), "{r}");
    assert_eq!(r["engine"]["version"], "0.33.0", "{r}");
    assert_eq!(r["model"]["name"], "acme/v-8b", "{r}");
    assert_eq!(r["model"]["max_seq_len"], 8192, "{r}");
    // Its Watch streams (tonic-health): seconds of serving are no loss.
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running(), "{}", sidecar.proc.log_text());
    sidecar.proc.stop_cleanly();
}

#[test]
fn auto_finds_sglang_native_and_reads_its_json_info() {
    let dir = TempDir::new("kind-sglang-native");
    let (mock, mut sidecar) = serving_kind(
        &dir,
        SGLANG_NATIVE,
        &["--model-id", "acme/s-8b", "--engine-version", "0.5.17"],
        &[],
    );
    let r = sidecar.record(&sidecar.records()[0]);
    assert_eq!(r["engine"]["kind"], "sglang-native", "{r}");
    // SGLang 0.5.23's gRPC API carries no version (its document has no key).
    assert_eq!(r["engine"]["version"], "unknown", "{r}");
    // WatchEngineState's instance_id is its identity.
    assert_eq!(r["engine"]["identity"], mock.instance_id().as_str(), "{r}");
    assert_eq!(r["model"]["name"], "acme/s-8b", "{r}");
    assert_eq!(r["model"]["max_input_len"], 4096, "{r}");
    assert_eq!(r["model"]["max_seq_len"], 8192, "{r}");
    assert_eq!(r["model"]["kv_cache_tokens"], 65_536, "{r}");
    // WatchEngineState streams: seconds of serving are no loss and no warning.
    std::thread::sleep(Duration::from_secs(2));
    assert!(sidecar.proc.running(), "{}", sidecar.proc.log_text());
    assert_eq!(
        sidecar.proc.count_lines(" WARN "),
        0,
        "{}",
        sidecar.proc.log_text()
    );
    sidecar.proc.stop_cleanly();
}

#[test]
fn vllm_native_not_serving_is_a_loss_named_by_its_instance_id() {
    let dir = TempDir::new("vllm-native-not-serving");
    let (mock, mut sidecar) = serving_kind(&dir, VLLM_NATIVE, &[], &[]);
    let instance = mock.instance_id();
    mock.control("/liveness?status=2");
    assert_engine_lost(
        &mut sidecar,
        "vLLM",
        &instance,
        "liveness reported NOT_SERVING",
    );
}

#[test]
fn sglang_native_unhealthy_is_a_loss_by_its_engine_state() {
    let dir = TempDir::new("sglang-native-not-serving");
    let (mock, mut sidecar) = serving_kind(&dir, SGLANG_NATIVE, &[], &[]);
    let instance = mock.instance_id();
    mock.control("/liveness?status=2");
    assert_engine_lost(
        &mut sidecar,
        "SGLang",
        &instance,
        "liveness reported NOT_SERVING",
    );
    let log = sidecar.proc.log_text();
    assert!(
        log.contains("the SGLang engine reports itself unhealthy (WatchEngineState)"),
        "{log}"
    );
}

#[test]
fn sglang_native_pause_is_said_and_no_loss() {
    let dir = TempDir::new("sglang-native-pause");
    let (mock, mut sidecar) = serving_kind(&dir, SGLANG_NATIVE, &[], &[]);
    mock.control("/pause?on=true");
    sidecar
        .proc
        .wait_for_line("the SGLang engine's generation is paused", HANG);
    mock.control("/pause?on=false");
    sidecar
        .proc
        .wait_for_line("the SGLang engine's generation continues", HANG);
    assert!(sidecar.proc.running(), "{}", sidecar.proc.log_text());
    assert_eq!(sidecar.records().len(), 1, "still registered");
    assert_eq!(sidecar.proc.count_lines(" engine lost: "), 0);
    sidecar.proc.stop_cleanly();
}

/// A native server older than WatchEngineState: its HealthCheck is polled and
/// its connection followed, said once; unhealthy is a loss, and so is its
/// process going (by the connection, before any stale-load window).
#[test]
fn sglang_native_without_its_state_stream_is_followed_by_health_check_and_connection() {
    for (fault, reasons) in [
        ("unhealthy", &["liveness reported NOT_SERVING"][..]),
        (
            "kill",
            &["engine connection lost", "health check failed"][..],
        ),
    ] {
        let dir = TempDir::new(&format!("sglang-native-older-{fault}"));
        let (mock, mut sidecar) = serving_kind(&dir, SGLANG_NATIVE, &["--no-health"], &[]);
        sidecar
            .proc
            .wait_for_line("does not serve WatchEngineState", HANG);
        let r = sidecar.record(&sidecar.records()[0]);
        assert!(
            r["engine"]["identity"]
                .as_str()
                .is_some_and(|i| i.starts_with("sglang unknown model=")),
            "no instance id: the self-description stands for it: {r}"
        );
        let id = sidecar.instance_id();
        if fault == "kill" {
            mock.proc.signal("KILL");
        } else {
            mock.control("/liveness?status=2");
        }
        let code = sidecar.proc.wait_exit(HANG);
        let log = sidecar.proc.log_text();
        assert_eq!(code, 1, "{fault}: {log}");
        let line = log
            .lines()
            .find(|l| l.contains(" engine lost: "))
            .unwrap_or_else(|| panic!("{fault}: no loss line:\n{log}"));
        assert!(
            reasons
                .iter()
                .any(|r| line.contains(&format!("SGLang engine lost: {r}"))),
            "{fault}: {line} is one of {reasons:?}"
        );
        assert!(line.ends_with(&format!("(instance {id})")), "{line}");
        assert!(sidecar.records().is_empty(), "{fault}: withdrawn");
    }
}

#[test]
fn sglang_native_engine_state_stream_ending_is_a_loss() {
    let dir = TempDir::new("sglang-native-state-end");
    let (mock, mut sidecar) = serving_kind(&dir, SGLANG_NATIVE, &[], &[]);
    let instance = mock.instance_id();
    mock.control("/watch/end");
    assert_engine_lost(&mut sidecar, "SGLang", &instance, "liveness stream ended");
}

#[test]
fn sglang_native_get_load_stalling_is_a_stale_load_loss() {
    let dir = TempDir::new("sglang-native-stale");
    let (mock, mut sidecar) = serving_kind(&dir, SGLANG_NATIVE, &[], &["--stale-after", "2s"]);
    let id = mock.instance_id();
    mock.control("/getload?mode=stall");
    assert_engine_lost(&mut sidecar, "SGLang", &id, "routing load stale for 2");
}

#[test]
fn sigkill_of_vllm_native_is_a_loss() {
    sigkill_is_a_loss(VLLM_NATIVE, &["liveness stream failed"]);
}

#[test]
fn sigkill_of_sglang_native_is_a_loss() {
    sigkill_is_a_loss(SGLANG_NATIVE, &["liveness stream failed"]);
}

#[test]
fn a_first_start_facing_not_serving_writes_no_record_then_registers_on_serving() {
    for kind in [TRTLLM, OPENENGINE, VLLM, SGLANG, VLLM_NATIVE, SGLANG_NATIVE] {
        let dir = TempDir::new(&format!("first-not-serving-{}", kind.flag));
        let mock = Mock::start(&dir.0, free_addr(), &mock_args(kind, &[]));
        mock.control("/liveness?status=2");
        let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &[]);
        let line = sidecar
            .proc
            .wait_for_line("not ready yet (warming up", HANG);
        // SGLang's native server says it through its own HealthCheck.
        let said = if kind.flag == "sglang-native" {
            "HealthCheck\" reports healthy=false"
        } else {
            "reports NOT_SERVING"
        };
        assert!(line.contains(said), "{}: {line}", kind.flag);
        std::thread::sleep(Duration::from_secs(1));
        assert!(
            sidecar.proc.running(),
            "{}: NOT_SERVING at start is no loss",
            kind.flag
        );
        assert!(
            sidecar.records().is_empty(),
            "{}: no record for an engine that is not SERVING",
            kind.flag
        );
        assert_eq!(sidecar.state()["state"], "Starting", "{}", kind.flag);

        mock.control("/liveness?status=1");
        sidecar.wait_serving();
        assert_detected(&sidecar, kind, mock.grpc);
        assert_eq!(
            sidecar.proc.count_lines(" engine lost: "),
            0,
            "{}: no flap",
            kind.flag
        );
        assert_eq!(
            sidecar.proc.count_lines("not ready yet (warming up"),
            1,
            "{}: said once",
            kind.flag
        );
        sidecar.proc.signal("TERM");
        assert_eq!(sidecar.proc.wait_exit(HANG), 0, "{}", kind.flag);
    }
}

#[test]
fn a_loss_inside_the_router_grace_closes_admission_at_once_and_ends_the_drain_with_its_calls() {
    let dir = TempDir::new("drain-loss-admission");
    let (mock, mut sidecar) = serving_kind(
        &dir,
        TRTLLM,
        &["--token-delay", "10ms"],
        &["--router-grace", "6s", "--drain-timeout", "20s"],
    );
    let runtime = rt();
    let listen = sidecar.listen;
    let long = runtime.spawn(async move { generate(TRTLLM, listen, "in-flight", 200).await });
    wait_until(HANG, "a call in flight", || {
        sidecar.metric("llm_sidecar_in_flight") == Some(1.0)
    });
    let signalled = std::time::Instant::now();
    sidecar.proc.signal("TERM");
    wait_until(HANG, "the record to be withdrawn", || {
        sidecar.records().is_empty()
    });
    std::thread::sleep(Duration::from_millis(500));
    // The engine says it cannot serve, but still streams the call in flight.
    mock.control("/liveness?status=2");
    sidecar.proc.wait_for_line("engine lost during drain", HANG);
    sidecar
        .proc
        .wait_for_line("admission closed at once: the engine is gone", HANG);
    let refused = runtime.block_on(generate(TRTLLM, listen, "after-the-loss", 4));
    assert_eq!(
        refused,
        Err((Code::Unavailable, "draining".to_string())),
        "a call after the loss is the sidecar's to refuse, never forwarded"
    );
    assert_eq!(
        runtime.block_on(long).expect("join"),
        Ok(200),
        "the call in flight drains"
    );
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    let took = signalled.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "exited {took:?} after SIGTERM: the drain ended with its call, not the 6 s router grace"
    );
    assert_eq!(sidecar.proc.count_lines(" engine lost: "), 0);
}

#[test]
fn an_engine_killed_inside_the_router_grace_ends_the_drain_at_once_with_exit_0() {
    let dir = TempDir::new("drain-kill");
    let (mock, mut sidecar) = serving_kind(&dir, TRTLLM, &[], &["--router-grace", "6s"]);
    sidecar.proc.signal("TERM");
    wait_until(HANG, "the record to be withdrawn", || {
        sidecar.records().is_empty()
    });
    std::thread::sleep(Duration::from_millis(500));
    let killed = std::time::Instant::now();
    mock.proc.signal("KILL");
    assert_eq!(sidecar.proc.wait_exit(HANG), 0);
    let took = killed.elapsed();
    println!("an engine killed 0.5 s into a 6 s router grace: exit 0 {took:?} after the kill");
    assert!(
        took < Duration::from_secs(3),
        "exited {took:?} after the kill: the rest of the 6 s router grace was served out"
    );
    let warn = sidecar.proc.wait_for_line("engine lost during drain", HANG);
    assert!(warn.ends_with("exit code stays 0"), "{warn}");
    sidecar.proc.assert_withdrawn_before_exit(0);
}

// ---- older servicers: a load RPC or an identity read they do not serve --------

/// A servicer older than its kind's load RPC (UNIMPLEMENTED from the start):
/// registered all the same, one WARN naming the RPC, no stale-load loss long
/// past the window, and a SIGKILL still a loss at once, by the connection.
/// OpenEngine runs without its health service too, so that the connection
/// the probe follows is the only thing that can notice the kill.
#[test]
fn a_servicer_without_its_load_rpc_registers_has_no_stale_loss_and_is_lost_by_its_connection() {
    for (kind, rpc, mock_extra) in [
        (OPENENGINE, "GetLoad", &["--no-health"][..]),
        (VLLM, "GetLoads", &[][..]),
        (SGLANG, "GetLoads", &[][..]),
    ] {
        let dir = TempDir::new(&format!("no-load-rpc-{}", kind.flag));
        let mut mock_args_ = vec!["--load-unimplemented"];
        mock_args_.extend_from_slice(mock_extra);
        let (mock, mut sidecar) = serving_kind(
            &dir,
            kind,
            &mock_args_,
            &["--stale-after", "1s", "--probe-interval", "200ms"],
        );
        let warning = format!(
            "{} engine does not serve its load RPC {rpc} (an older servicer): no stale-load rule \
             for it; its connection is followed instead",
            kind.engine
        );
        assert!(
            sidecar
                .proc
                .wait_for_line(&warning, HANG)
                .contains(" WARN "),
            "{}",
            kind.flag
        );
        std::thread::sleep(Duration::from_secs(3));
        assert!(
            sidecar.proc.running(),
            "{}: no stale-load loss three windows on; log:\n{}",
            kind.flag,
            sidecar.proc.log_text()
        );
        assert_eq!(
            sidecar.proc.count_lines(&warning),
            1,
            "{}: said once",
            kind.flag
        );
        assert_eq!(
            sidecar.metric("llm_sidecar_stale_load_rule"),
            Some(0.0),
            "{}",
            kind.flag
        );
        if kind.flag == "vllm" {
            // GetLoads carries vLLM's version: without it, the record says so.
            let r = sidecar.record(&sidecar.records()[0]);
            assert_eq!(r["engine"]["version"], "unknown", "{r}");
            assert_eq!(
                sidecar
                    .proc
                    .count_lines("does not serve GetLoads (an older servicer)"),
                1
            );
        }
        let killed = std::time::Instant::now();
        mock.proc.signal("KILL");
        assert_eq!(sidecar.proc.wait_exit(HANG), 1, "{}", kind.flag);
        let took = killed.elapsed();
        let log = sidecar.proc.log_text();
        let line = log
            .lines()
            .find(|l| l.contains(" engine lost: "))
            .unwrap_or_else(|| panic!("{}: no loss line:\n{log}", kind.flag));
        assert!(
            line.contains("engine connection lost") || line.contains("health check failed"),
            "{}: {line}",
            kind.flag
        );
        assert!(sidecar.records().is_empty(), "{}", kind.flag);
        sidecar.proc.assert_withdrawn_before_exit(1);
        println!("{}: SIGKILL to exit {took:?} without a load RPC", kind.flag);
    }
}

/// The load RPC turning UNIMPLEMENTED while serving (the engine swapped for an
/// older servicer behind a proxy, or the RPC switched off): one WARN, the
/// stale-load rule off, the worker stays registered.
#[test]
fn a_load_rpc_turning_unimplemented_later_warns_once_and_is_no_loss() {
    for kind in [OPENENGINE, SGLANG] {
        let dir = TempDir::new(&format!("load-rpc-later-{}", kind.flag));
        let (mock, mut sidecar) = serving_kind(
            &dir,
            kind,
            &[],
            &["--stale-after", "1s", "--probe-interval", "200ms"],
        );
        assert_eq!(sidecar.metric("llm_sidecar_stale_load_rule"), Some(1.0));
        mock.control("/getload?mode=unimplemented");
        sidecar
            .proc
            .wait_for_line("does not serve its load RPC", HANG);
        std::thread::sleep(Duration::from_secs(3));
        assert!(
            sidecar.proc.running(),
            "{}: log:\n{}",
            kind.flag,
            sidecar.proc.log_text()
        );
        assert_eq!(sidecar.proc.count_lines("does not serve its load RPC"), 1);
        assert_eq!(
            sidecar
                .proc
                .count_lines("stale-load probe got no fresh answer"),
            0
        );
        assert_eq!(
            sidecar.records().len(),
            1,
            "{}: still registered",
            kind.flag
        );
        sidecar.proc.signal("TERM");
        assert_eq!(sidecar.proc.wait_exit(HANG), 0, "{}", kind.flag);
    }
}

/// A server older than `GetServerInfo`: registered with what its other calls
/// said, version "unknown", said once.
#[test]
fn a_server_without_get_server_info_registers_with_what_is_known() {
    for kind in [TRTLLM, SGLANG] {
        let dir = TempDir::new(&format!("no-server-info-{}", kind.flag));
        let (_mock, mut sidecar) = serving_kind(&dir, kind, &["--server-info-unimplemented"], &[]);
        let r = sidecar.record(&sidecar.records()[0]);
        assert_eq!(r["engine"]["kind"], kind.flag, "{r}");
        assert_eq!(r["engine"]["version"], "unknown", "{r}");
        assert_eq!(r["model"]["name"], "mock/llama-3-8b-instruct", "{r}");
        let warning = format!(
            "the {} engine does not serve GetServerInfo (an older servicer)",
            kind.engine
        );
        assert_eq!(sidecar.proc.count_lines(&warning), 1, "{}", kind.flag);
        std::thread::sleep(Duration::from_secs(1));
        assert!(sidecar.proc.running(), "{}: the identity holds", kind.flag);
        sidecar.proc.signal("TERM");
        assert_eq!(sidecar.proc.wait_exit(HANG), 0, "{}", kind.flag);
    }
}
