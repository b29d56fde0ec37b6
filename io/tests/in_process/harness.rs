//! The in-process harness: the mock engine and the sidecar (`llm_sidecar_io::run`,
//! the driver and the request plane as `llm-sidecar run` starts them) in the
//! test's own runtime, on loopback ports, with a file registry in a directory
//! of the test's own. What a process test reads from the outside (the
//! record, `/metrics`, the engine's `/stats`) is read here the same way; what
//! only a process shows (an exit code, a signal, a log line, threads, memory)
//! stays in the process suite (`bin/tests/process`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use llm_sidecar_core::{ExitReason, OnEngineLoss};
use llm_sidecar_io::discovery::DiscoveryUri;
use llm_sidecar_io::engine::EngineChoice;
use llm_sidecar_io::request_plane::Limits;
use llm_sidecar_io::{RunConfig, RunError, Timings};
use llm_sidecar_loadgen::local::{http_get, record_files};
use llm_sidecar_mock_engine::MockConfig;
use llm_sidecar_testkit::free_addr;
use llm_sidecar_testkit::proc::TempDir;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Generous: only stops a hang.
pub const HANG: Duration = Duration::from_secs(60);

/// `GET path` on `addr` (HTTP/1.0), off the runtime's threads; the body if
/// it answered 200.
async fn get(addr: SocketAddr, path: &'static str) -> Option<String> {
    tokio::task::spawn_blocking(move || http_get(addr, path, Duration::from_secs(10)))
        .await
        .expect("the GET ran")
        .and_then(|(status, body)| (status == 200).then_some(body))
}

/// Polls `done` every 20 ms until it holds; panics after `limit`, naming `what`.
pub async fn wait_until<F: std::future::Future<Output = bool>>(
    limit: Duration,
    what: &str,
    mut done: impl FnMut() -> F,
) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The mock engine, `llm-sidecar mock-engine` in this runtime.
pub struct Engine {
    /// Its gRPC address.
    pub grpc: SocketAddr,
    control: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<Result<(), llm_sidecar_mock_engine::MockError>>,
}

impl Engine {
    /// The mock's defaults as `tweak` changes them; listening when this returns.
    pub async fn start(tweak: impl FnOnce(&mut MockConfig)) -> Engine {
        let mut config = MockConfig::at(free_addr(), free_addr());
        tweak(&mut config);
        let (grpc, control) = (config.listen, config.control_listen);
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(llm_sidecar_mock_engine::run(config, async move {
            stopped.cancelled().await
        }));
        let engine = Engine {
            grpc,
            control,
            stop,
            task,
        };
        wait_until(HANG, "the mock engine to listen", || async {
            assert!(!engine.task.is_finished(), "the mock engine stopped");
            tokio::net::TcpStream::connect(grpc).await.is_ok()
        })
        .await;
        engine
    }

    /// What the mock saw (`/stats` of its control port).
    pub async fn stats(&self) -> serde_json::Value {
        let body = get(self.control, "/stats")
            .await
            .expect("the mock's /stats");
        serde_json::from_str(&body).expect("JSON stats")
    }

    /// Waits (bounded) until the engine saw call `id` reset.
    pub async fn wait_for_reset(&self, id: &str) {
        wait_until(
            Duration::from_secs(5),
            "the engine to see the reset",
            || async {
                self.stats().await["cancelled_ids"]
                    .as_array()
                    .is_some_and(|ids| ids.iter().any(|i| i == id))
            },
        )
        .await;
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The sidecar, `llm_sidecar_io::run` in this runtime.
pub struct Worker {
    /// The request plane's address.
    pub listen: SocketAddr,
    admin: SocketAddr,
    registry: TempDir,
    signals: mpsc::UnboundedSender<()>,
    run: JoinHandle<Result<ExitReason, RunError>>,
}

impl Worker {
    /// `llm-sidecar run`'s defaults in front of `engine`, with the process
    /// suite's quick timings (`FAST` there), as `tweak` changes them;
    /// registered and serving when this returns.
    pub async fn start(engine: SocketAddr, tweak: impl FnOnce(&mut RunConfig)) -> Worker {
        let registry = TempDir::new("registry");
        let listen = free_addr();
        let admin = free_addr();
        let mut config = RunConfig {
            engine_endpoint: engine.to_string(),
            engine: EngineChoice::Auto,
            listen,
            advertise: listen.to_string(),
            admin_listen: Some(admin),
            discovery: DiscoveryUri::File(registry.0.clone()),
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            liveness_service: None,
            timings: Timings {
                retry_interval: Duration::from_millis(200),
                connect_attempt_timeout: Duration::from_secs(3),
                probe_interval: Duration::from_millis(500),
                stale_after: Duration::from_secs(5),
                router_grace: Duration::ZERO,
                drain_timeout: Duration::from_secs(5),
                ..Timings::default()
            },
            limits: Limits::DEFAULT,
            tls: None,
            etcd_tls: None,
            on_engine_loss: OnEngineLoss::Exit,
            worker_threads: 1,
        };
        tweak(&mut config);
        let (signals, shutdown) = mpsc::unbounded_channel();
        let run = tokio::spawn(llm_sidecar_io::run(config, shutdown));
        let worker = Worker {
            listen,
            admin,
            registry,
            signals,
            run,
        };
        wait_until(HANG, "the worker to register and serve", || async {
            assert!(!worker.run.is_finished(), "the worker stopped");
            !record_files(&worker.registry.0).is_empty()
                && get(worker.admin, "/ready").await.is_some()
        })
        .await;
        worker
    }

    /// The value of the first `/metrics` line starting with `name`.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let body = get(self.admin, "/metrics").await?;
        body.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// The admin server's status for `GET path`; `None` if nothing answers.
    pub async fn admin_status(&self, path: &'static str) -> Option<u16> {
        let admin = self.admin;
        tokio::task::spawn_blocking(move || http_get(admin, path, Duration::from_secs(10)))
            .await
            .expect("the GET ran")
            .map(|(status, _)| status)
    }

    /// Whether the worker still runs.
    pub fn running(&self) -> bool {
        !self.run.is_finished()
    }

    /// A shutdown signal; the worker must withdraw its record and end clean.
    pub async fn stop_cleanly(self) {
        self.signals
            .send(())
            .expect("the worker listens for signals");
        let reason = tokio::time::timeout(HANG, self.run)
            .await
            .expect("the worker stopped")
            .expect("the worker's task ran")
            .expect("the worker ran");
        assert_eq!(reason, ExitReason::Clean);
        assert_eq!(record_files(&self.registry.0), Vec::<PathBuf>::new());
    }
}

/// A mock engine and a sidecar in front of it, registered and serving.
pub async fn serving(
    engine: impl FnOnce(&mut MockConfig),
    worker: impl FnOnce(&mut RunConfig),
) -> (Engine, Worker) {
    let engine = Engine::start(engine).await;
    let worker = Worker::start(engine.grpc, worker).await;
    (engine, worker)
}
