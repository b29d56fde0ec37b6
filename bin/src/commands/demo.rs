//! `llm-sidecar demo`: the whole lifecycle on this machine, in one command.
//!
//! Starts the mock engine and a sidecar (file discovery in a temporary
//! directory) as child processes of this same binary, sends calls through the
//! sidecar, makes the engine lose liveness with a call in flight, and prints a
//! timeline of what an operator would see. Cleans up after itself.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use llm_sidecar_io::engine::EngineKind;
use llm_sidecar_loadgen::generate::{generate, tokens_of};
use llm_sidecar_loadgen::local::{free_loopback_addr, http_get, poll_until, record_files};

use crate::shared::{Exit, engine_kind};

/// Flags of `llm-sidecar demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Which engine the mock plays: trtllm, openengine, vllm, sglang, vllm-native or sglang-native. The
    /// sidecar is not told: it finds out (--engine-kind auto).
    #[arg(long, default_value = "trtllm", value_parser = engine_kind)]
    pub engine_kind: EngineKind,
}

/// How often the demo looks: often enough to time the withdrawal in milliseconds.
const POLL: Duration = Duration::from_millis(2);

/// How long the mock's control endpoint may take to answer.
const HTTP_READ: Duration = Duration::from_secs(5);

struct Demo {
    start: Instant,
    dir: PathBuf,
    children: Vec<Child>,
}

impl Demo {
    fn say(&self, text: impl AsRef<str>) {
        outln!(
            "[{:>6} ms] {}",
            self.start.elapsed().as_millis(),
            text.as_ref()
        );
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spawn(exe: &Path, args: &[String], log: &Path) -> std::io::Result<Child> {
    Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .spawn()
}

/// Runs the demo; returns the process exit code (0 if it showed what it should).
pub fn run(args: DemoArgs) -> Exit {
    match demo(args.engine_kind) {
        Ok(()) => Exit::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e}");
            Exit::Own(1)
        }
    }
}

/// The loopback addresses of one demo.
struct Addrs {
    engine: SocketAddr,
    control: SocketAddr,
    listen: SocketAddr,
    admin: SocketAddr,
}

fn demo(kind: EngineKind) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let dir = std::env::temp_dir().join(format!("llm-sidecar-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut demo = Demo {
        start: Instant::now(),
        dir: dir.clone(),
        children: Vec::new(),
    };
    let addr = || free_loopback_addr().map_err(|e| format!("no free loopback port: {e}"));
    let addrs = Addrs {
        engine: addr()?,
        control: addr()?,
        listen: addr()?,
        admin: addr()?,
    };
    let discovery = dir.join("discovery");
    let sidecar_log = dir.join("sidecar.log");

    start_engine_and_sidecar(&mut demo, &exe, kind, &addrs, &discovery, &sidecar_log)?;
    let record = show_registration(&demo, &discovery, &sidecar_log)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let long_call = serve_calls(&demo, &runtime, kind, addrs.listen)?;
    fail_the_engine(&demo, &runtime, kind, &addrs, &record)?;
    let long = runtime.block_on(long_call).map_err(|e| e.to_string())?;
    match long {
        Ok(n) => demo.say(format!(
            "the in-flight call drained: all {n} tokens delivered"
        )),
        Err(s) => demo.say(format!(
            "the in-flight call ended with {:?}: {}",
            s.code(),
            s.message()
        )),
    }
    let code = wait_for_exit(&mut demo, &sidecar_log)?;
    let _ = http_get(addrs.control, "/stop", HTTP_READ);
    if code != 1 {
        return Err(format!(
            "expected exit code 1 after the engine loss, got {code}"
        ));
    }
    Ok(())
}

/// Starts the mock engine of `kind` and a sidecar beside it that is not told
/// the kind.
fn start_engine_and_sidecar(
    demo: &mut Demo,
    exe: &Path,
    kind: EngineKind,
    addrs: &Addrs,
    discovery: &Path,
    sidecar_log: &Path,
) -> Result<(), String> {
    let profile = kind.profile();
    let engine_name = profile.display_name;
    let Addrs {
        engine,
        control,
        listen,
        admin,
    } = addrs;
    outln!(
        "llm-sidecar demo: a mock {engine_name} engine ({}), the sidecar beside it, and an engine failure.\n",
        profile.service
    );
    demo.say(format!(
        "starting the mock {engine_name} engine on {engine}"
    ));
    let mock = spawn(
        exe,
        &[
            "mock-engine",
            "--kind",
            profile.name,
            "--listen",
            &engine.to_string(),
            "--control-listen",
            &control.to_string(),
            "--token-delay",
            "5ms",
        ]
        .map(String::from),
        &demo.dir.join("mock.log"),
    )
    .map_err(|e| format!("cannot start the mock engine: {e}"))?;
    demo.children.push(mock);
    demo.say(format!(
        "starting llm-sidecar: engine {engine} (kind: auto), request plane {listen}, admin {admin}"
    ));
    let sidecar = spawn(
        exe,
        &[
            "run",
            "--engine-endpoint",
            &engine.to_string(),
            "--listen",
            &listen.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--discovery",
            &format!("file:{}", discovery.display()),
            "--retry-interval",
            "100ms",
            "--router-grace",
            "1s",
            "--drain-timeout",
            "5s",
        ]
        .map(String::from),
        sidecar_log,
    )
    .map_err(|e| format!("cannot start the sidecar: {e}"))?;
    demo.children.push(sidecar);
    Ok(())
}

/// Waits for the record and shows what the sidecar detected and registered.
fn show_registration(demo: &Demo, discovery: &Path, sidecar_log: &Path) -> Result<PathBuf, String> {
    if !poll_until(Duration::from_secs(30), POLL, || {
        record_files(discovery).len() == 1
    }) {
        return Err(format!(
            "the sidecar did not register; see {}",
            sidecar_log.display()
        ));
    }
    let record = record_files(discovery).remove(0);
    if let Some(line) = std::fs::read_to_string(sidecar_log).ok().and_then(|log| {
        log.lines()
            .find(|l| l.contains("following it as"))
            .map(str::to_string)
    }) {
        demo.say(format!(
            "detected: {}",
            line.split_once("INFO ")
                .map_or(line.as_str(), |(_, l)| l.trim())
        ));
    }
    demo.say(format!(
        "serving: the worker is registered in discovery at\n           {}",
        record.display()
    ));
    if let Ok(text) = std::fs::read_to_string(&record) {
        for line in text.lines().filter(|l| {
            l.contains("\"address\"") || l.contains("\"name\"") || l.contains("\"instance_id\"")
        }) {
            outln!("           {}", line.trim());
        }
    }
    Ok(record)
}

/// A long call still streaming when the engine fails.
type LongCall = tokio::task::JoinHandle<Result<usize, tonic::Status>>;

/// Three calls answered through the sidecar, then a long one left in flight.
fn serve_calls(
    demo: &Demo,
    runtime: &tokio::runtime::Runtime,
    kind: EngineKind,
    listen: SocketAddr,
) -> Result<LongCall, String> {
    let (answered, long_call) = runtime.block_on(async {
        let channel = llm_sidecar_loadgen::connect(&listen.to_string())
            .await
            .map_err(|e| e.to_string())?;
        let mut tokens = 0;
        for i in 0..3 {
            let call = async {
                tokens_of(generate(kind, channel.clone(), format!("demo-{i}"), 16, 32).await?).await
            };
            tokens += call.await.map_err(|e| format!("call {i}: {e}"))?;
        }
        let long_call = tokio::spawn(async move {
            tokens_of(generate(kind, channel, "demo-long".into(), 16, 200).await?).await
        });
        Ok::<_, String>((tokens, long_call))
    })?;
    demo.say(format!(
        "3 Generate calls answered through the sidecar ({answered} tokens streamed)"
    ));
    Ok(long_call)
}

/// The engine's health turns NOT_SERVING: the record goes, a new call is
/// refused.
fn fail_the_engine(
    demo: &Demo,
    runtime: &tokio::runtime::Runtime,
    kind: EngineKind,
    addrs: &Addrs,
    record: &Path,
) -> Result<(), String> {
    std::thread::sleep(Duration::from_millis(200));
    demo.say(format!(
        "a long call (200 tokens) is in flight; now the engine fails: its health service {:?} turns NOT_SERVING",
        kind.profile().liveness_service
    ));
    let flipped = Instant::now();
    http_get(addrs.control, "/liveness?status=2", HTTP_READ)
        .ok_or("the mock's control endpoint did not answer")?;
    if !poll_until(Duration::from_secs(10), POLL, || !record.exists()) {
        return Err("the record was not withdrawn".into());
    }
    let withdrawn_after = flipped.elapsed();
    demo.say(format!(
        "loss detected; record withdrawn {:.1} ms after the failure: routers stop sending work here",
        withdrawn_after.as_secs_f64() * 1000.0
    ));
    let refused = runtime.block_on(async {
        let channel = llm_sidecar_loadgen::connect(&addrs.listen.to_string())
            .await
            .ok()?;
        match generate(kind, channel, "demo-late".into(), 4, 4).await {
            Ok(pieces) => tokens_of(pieces).await.err(),
            Err(status) => Some(status),
        }
    });
    if let Some(status) = refused {
        demo.say(format!(
            "a new call now gets {:?} \"{}\": the caller retries on another worker",
            status.code(),
            status.message()
        ));
    }
    Ok(())
}

/// Waits for the sidecar's exit, shows its log lines that matter and what a
/// supervisor does next; returns the exit code.
fn wait_for_exit(demo: &mut Demo, sidecar_log: &Path) -> Result<i32, String> {
    let sidecar = demo.children.last_mut().ok_or("no sidecar")?;
    let mut code = None;
    poll_until(Duration::from_secs(15), POLL, || {
        code = sidecar.try_wait().ok().flatten().and_then(|s| s.code());
        code.is_some()
    });
    let code = code.ok_or("the sidecar did not exit")?;
    demo.say(format!("the sidecar exited with code {code}"));
    outln!();
    if let Ok(log) = std::fs::read_to_string(sidecar_log) {
        outln!("the sidecar's log, as an operator sees it:");
        for line in log
            .lines()
            .filter(|l| l.contains("ERROR") || l.contains("withdrawn") || l.contains("exiting"))
        {
            outln!("  {line}");
        }
    }
    outln!();
    outln!(
        "exit code {code} means the engine was lost. A supervisor restarts the worker: systemd\n\
         restarts the unit (Restart=on-failure), the kubelet the container; the sidecar waits for the\n\
         engine and registers a new instance once it serves. With --on-engine-loss rejoin (as in\n\
         deploy/kubernetes/) it does that without exiting. Exit 0 would mean a clean shutdown after\n\
         SIGTERM; 3, a start-up that never completed; 2, bad flags."
    );
    Ok(code)
}
