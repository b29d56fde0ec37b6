//! Process-test support: the real `llm-sidecar` binary (sidecar and mock
//! engine) on loopback, file discovery in a temporary directory, and what an
//! operator would look at: the record, the exit code, the log lines.

pub use llm_sidecar_testkit::certs::Certs;
pub use llm_sidecar_testkit::proc::{HANG, Proc, TempDir, wait_until};
pub use llm_sidecar_testkit::{etcd, free_addr};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_llm-sidecar")
}

pub use llm_sidecar_loadgen::local::{files_under, record_files};

/// The value of the first line starting with `name` on the `/metrics` of the
/// admin server at `admin`.
pub fn metric_at(admin: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = http_get(admin, "/metrics")?;
    body.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The sidecar's own grpc.health.v1 status for `service` (a `Check` on its
/// request port `listen`, on a connection of its own), raw.
pub async fn own_health_status(listen: SocketAddr, service: &str) -> i32 {
    let channel = llm_sidecar_loadgen::connect(&listen.to_string())
        .await
        .expect("connect to the request plane");
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .expect("the sidecar's own health answers")
        .into_inner()
        .status
}

/// `GET path` over HTTP/1.0; returns (status, body). `None` if nothing answers.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    llm_sidecar_loadgen::local::http_get(addr, path, Duration::from_secs(10))
}

/// A process's resident memory, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    llm_sidecar_loadgen::local::rss_kib(pid, false)
}

/// A process's peak resident memory, KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    llm_sidecar_loadgen::local::rss_kib(pid, true)
}

/// `llm-sidecar bench --target <target> --json <args>`, started.
pub fn bench_spawn(target: SocketAddr, args: &[&str]) -> Child {
    Command::new(binary())
        .args(["bench", "--target", &target.to_string(), "--json"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start bench")
}

/// A started bench's JSON report, once it ends.
pub fn bench_report(child: Child) -> serde_json::Value {
    let out = child.wait_with_output().expect("bench output");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "bench report is JSON: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// `llm-sidecar` with these arguments, its stderr to `log`.
pub fn spawn_sidecar(args: &[String], log: PathBuf) -> Proc {
    Proc::spawn_program(binary(), args, log)
}

/// Checks a loss the way an operator would: the one ERROR line
/// `<engine> engine lost: <reason…> (instance <instance>)`, the record withdrawn
/// before the process ended, exit code 1. Returns the line.
pub fn assert_engine_lost(
    sidecar: &mut Sidecar,
    engine: &str,
    instance: &str,
    reason_prefix: &str,
) -> String {
    let line = sidecar
        .proc
        .assert_engine_lost(engine, instance, reason_prefix);
    assert!(sidecar.records().is_empty(), "no record is left behind");
    line
}

/// The mock engine.
pub struct Mock {
    pub proc: Proc,
    pub grpc: SocketAddr,
    pub control: SocketAddr,
}

impl Mock {
    pub fn start(dir: &Path, grpc: SocketAddr, extra: &[&str]) -> Self {
        // Ports come from `free_addr`, which another test may grab first: a bind
        // failure of the control port is retried on a fresh one.
        for attempt in 0..5 {
            let control = free_addr();
            let mut args = vec![
                "mock-engine".to_string(),
                "--listen".into(),
                grpc.to_string(),
                "--control-listen".into(),
                control.to_string(),
            ];
            args.extend(extra.iter().map(|s| s.to_string()));
            let log = dir.join(format!("mock-{}-{attempt}.log", grpc.port()));
            let mut proc = spawn_sidecar(&args, log);
            wait_until(HANG, "the mock engine to answer or exit", || {
                http_get(control, "/stats").is_some() || !proc.running()
            });
            if proc.running() {
                return Mock {
                    proc,
                    grpc,
                    control,
                };
            }
            let text = proc.log_text();
            assert!(
                text.contains("cannot listen on") && text.contains("(control)"),
                "mock engine failed:\n{text}"
            );
        }
        panic!("no free control port after 5 attempts");
    }

    /// A mock that journals every Generate event (the engine's side of the call
    /// account), with a small token delay so that calls overlap the faults.
    pub fn start_journaled(dir: &Path, grpc: SocketAddr, extra: &[&str]) -> (Self, PathBuf) {
        let journal = dir.join("engine.journal");
        let journal_arg = journal.display().to_string();
        let mut args = vec!["--token-delay", "5ms", "--journal", &journal_arg];
        args.extend_from_slice(extra);
        (Mock::start(dir, grpc, &args), journal)
    }

    pub fn control(&self, path: &str) -> String {
        let (status, body) = http_get(self.control, path).expect("mock control answers");
        assert_eq!(status, 200, "mock control {path}: {body}");
        body
    }

    /// The engine process's own instance id (OpenEngine's and vLLM's native
    /// servers name themselves with it), as the mock reports it.
    pub fn instance_id(&self) -> String {
        self.stats()["instance_id"]
            .as_str()
            .expect("the mock reports its instance id")
            .to_string()
    }

    pub fn stats(&self) -> serde_json::Value {
        serde_json::from_str(&self.control("/stats")).expect("stats are JSON")
    }
}

/// The sidecar under test, with file discovery in its own directory.
pub struct Sidecar {
    pub proc: Proc,
    pub admin: SocketAddr,
    pub listen: SocketAddr,
    pub discovery: PathBuf,
}

/// Flags that keep tests quick without changing behaviour.
pub const FAST: &[&str] = &[
    "--retry-interval",
    "200ms",
    "--connect-attempt-timeout",
    "3s",
    "--probe-interval",
    "500ms",
    "--stale-after",
    "5s",
    "--router-grace",
    "0s",
    "--drain-timeout",
    "5s",
];

/// The arguments of `llm-sidecar run` for a test: the given ports, a file
/// registry in `discovery` (unless `extra` names one), the [`FAST`] timings
/// (except those `extra` sets itself: clap refuses repeats), then `extra`.
pub fn run_args(
    engine: SocketAddr,
    listen: SocketAddr,
    admin: SocketAddr,
    discovery: &Path,
    extra: &[&str],
) -> Vec<String> {
    let mut args = vec![
        "run".to_string(),
        "--engine-endpoint".into(),
        engine.to_string(),
        "--listen".into(),
        listen.to_string(),
        "--admin-listen".into(),
        admin.to_string(),
    ];
    if !extra.contains(&"--discovery") {
        args.extend([
            "--discovery".to_string(),
            format!("file:{}", discovery.display()),
        ]);
    }
    for pair in FAST.chunks(2) {
        if !extra.contains(&pair[0]) {
            args.extend(pair.iter().map(|s| s.to_string()));
        }
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A mock engine and a sidecar in front of it, registered and serving.
pub fn serving(dir: &Path, mock_args: &[&str], sidecar_args: &[&str]) -> (Mock, Sidecar) {
    let mock = Mock::start(dir, free_addr(), mock_args);
    let sidecar = Sidecar::start(dir, mock.grpc, sidecar_args);
    sidecar.wait_serving();
    (mock, sidecar)
}

impl Sidecar {
    /// Waits until the worker is registered and serving: its record is written
    /// (file discovery) and the line says so.
    pub fn wait_serving(&self) {
        if !self.uses_etcd() {
            self.wait_for_record(HANG);
        }
        self.proc.wait_for_line("registered; serving", HANG);
    }

    fn uses_etcd(&self) -> bool {
        self.proc.args.iter().any(|a| a.starts_with("etcd://"))
    }

    pub fn start(dir: &Path, engine: SocketAddr, extra: &[&str]) -> Self {
        Sidecar::start_program(binary(), dir, engine, extra)
    }

    /// The same with another build of the sidecar (a benchmark's baseline).
    pub fn start_program(program: &str, dir: &Path, engine: SocketAddr, extra: &[&str]) -> Self {
        let discovery = dir.join("discovery");
        for attempt in 0..5 {
            let admin = free_addr();
            let listen = free_addr();
            let args = run_args(engine, listen, admin, &discovery, extra);
            let log = dir.join(format!("sidecar-{}-{attempt}.log", admin.port()));
            let mut proc = Proc::spawn_program(program, &args, log);
            // Ports come from `free_addr`, which another test may grab first: a
            // bind failure is retried on fresh ports; anything else is the test's.
            wait_until(
                HANG,
                "the sidecar's admin server to answer or the sidecar to exit",
                || http_get(admin, "/live").is_some() || !proc.running(),
            );
            let text = proc.log_text();
            if proc.running() || !text.contains("cannot listen on") {
                return Sidecar {
                    proc,
                    admin,
                    listen,
                    discovery,
                };
            }
        }
        panic!("no free ports for the sidecar after 5 attempts");
    }

    /// Every record file under the discovery directory.
    pub fn records(&self) -> Vec<PathBuf> {
        record_files(&self.discovery)
    }

    /// The value of the first `/metrics` line starting with `name`.
    pub fn metric(&self, name: &str) -> Option<f64> {
        metric_at(self.admin, name)
    }

    pub fn wait_for_record(&self, limit: Duration) -> PathBuf {
        wait_until(limit, "the discovery record", || self.records().len() == 1);
        self.records().remove(0)
    }

    pub fn record(&self, path: &Path) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(path).expect("read record")).expect("record is JSON")
    }

    pub fn state(&self) -> serde_json::Value {
        let (_, body) = http_get(self.admin, "/state").expect("admin answers");
        serde_json::from_str(&body).expect("state is JSON")
    }

    pub fn instance_id(&self) -> String {
        self.state()["instance_id"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// Sidecar flags: keepalive 11 s (just above the engine's ping floor) with a
/// 2 s timeout, and a long stale-load window, so that only keepalive can
/// notice a silent network.
pub const KEEPALIVE_ONLY: &[&str] = &[
    "--keepalive-interval",
    "11s",
    "--keepalive-timeout",
    "2s",
    "--stale-after",
    "120s",
];

/// A runtime for a test's own gRPC and h2 callers: two threads, as many as
/// the machine the suite is sized for.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

pub mod account;
pub use llm_sidecar_testkit::raw_h2;
pub mod relay;

/// A small tmpfs mounted over a directory (the tests run as root in CI): a
/// discovery directory that can be made read-only or full. Unmounted when dropped.
pub struct Tmpfs {
    pub dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (e.g. "64k") on `dir`; panics with the reason
    /// if this machine cannot (the fault tests need root, as CI has).
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).expect("create mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs needs root (CI runs as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs {
            dir: dir.to_path_buf(),
        }
    }

    /// Remounts read-only (`true`) or read-write (`false`).
    pub fn set_read_only(&self, ro: bool) {
        let opt = if ro { "remount,ro" } else { "remount,rw" };
        let ok = Command::new("mount")
            .args(["-o", opt])
            .arg(&self.dir)
            .status()
            .expect("run mount")
            .success();
        assert!(ok, "mount -o {opt} {}", self.dir.display());
    }

    /// Files whose name ends in `.tmp` anywhere below: half-written records.
    pub fn temp_files(&self) -> Vec<PathBuf> {
        files_under(&self.dir, &|p| p.to_string_lossy().ends_with(".tmp"))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

impl Sidecar {
    /// The sidecar's own account of calls, from its log line at exit.
    pub fn account(&self) -> account::SidecarAccount {
        account::SidecarAccount::from_log(&self.proc.log_text()).unwrap_or_else(|| {
            panic!(
                "no 'request plane account at exit' line in {}:\n{}",
                self.proc.log.display(),
                self.proc.log_text()
            )
        })
    }
}
