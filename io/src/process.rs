//! What every process of the sidecar runs on (`llm-sidecar`'s subcommands and
//! `llm-sidecar-dynamo`): logging to stderr, the async runtime, and the
//! signals that ask the sidecar to stop.

use llm_sidecar_core::ExitReason;
use tokio::sync::mpsc;

/// How a process of either binary ends, by what its status tells a
/// supervisor: the one home of the exit codes of `llm-sidecar` and
/// `llm-sidecar-dynamo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The lifecycle's own end: 0 after a signal, 1 the engine lost (restart
    /// the pod), 3 start-up not done by its deadline.
    Lifecycle(ExitReason),
    /// 2: bad usage or configuration; nothing was contacted.
    Usage,
    /// 71 (sysexits' EX_OSERR): the async runtime could not start (the OS
    /// refused its threads). Never 1, which means "engine lost".
    Runtime,
    /// A subcommand's own code, documented with it (`probe`:
    /// grpc_health_probe's; `copy-binary`'s 73).
    Own(u8),
}

impl Exit {
    /// 0: done, nothing went wrong.
    pub const SUCCESS: Exit = Exit::Lifecycle(ExitReason::Clean);
    /// 3: a start-up step that runs before the lifecycle does (the Dynamo
    /// worker's connection to discovery) did not complete: the lifecycle's
    /// start-up failure.
    pub const STARTUP_FAILED: Exit = Exit::Lifecycle(ExitReason::StartupFailed);

    /// The process exit status.
    pub const fn code(self) -> u8 {
        match self {
            // 0, 1 or 3.
            Exit::Lifecycle(reason) => reason.as_i32() as u8,
            Exit::Usage => 2,
            Exit::Runtime => 71,
            Exit::Own(code) => code,
        }
    }
}

impl From<ExitReason> for Exit {
    fn from(reason: ExitReason) -> Exit {
        Exit::Lifecycle(reason)
    }
}

impl From<Exit> for std::process::ExitCode {
    fn from(exit: Exit) -> std::process::ExitCode {
        std::process::ExitCode::from(exit.code())
    }
}

/// Sets up tracing to stderr, one JSON object per line when `json`;
/// `RUST_LOG` overrides the default `info`.
pub fn init_logging(json: bool) {
    init_logging_throttled(json, Vec::new());
}

/// As [`init_logging`], with lines that a library may write in a storm
/// (another crate's accept loop failing for want of file descriptors) held to
/// one per interval each, every one of them counted.
pub fn init_logging_throttled(json: bool, throttles: Vec<Throttle>) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,h2=warn,hyper=warn,tower=warn")
    });
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(Throttles(throttles));
    if json {
        registry.with(fmt.json().flatten_event(true)).init();
    } else {
        registry.with(fmt).init();
    }
}

/// A kind of log line written at most once per `every`; each occurrence is
/// counted in `count`, written or not.
#[derive(Debug, Clone)]
pub struct Throttle {
    /// The event's target (its module path).
    pub target: &'static str,
    /// How its message begins.
    pub message: &'static str,
    /// At most one such line per this long.
    pub every: std::time::Duration,
    /// Every occurrence.
    pub count: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// When one was last written.
    last: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

impl Throttle {
    /// Lines from `target` whose message begins with `message`, one per `every`.
    pub fn new(target: &'static str, message: &'static str, every: std::time::Duration) -> Self {
        Throttle {
            target,
            message,
            every,
            count: Default::default(),
            last: Default::default(),
        }
    }

    /// Whether this occurrence is written (each is counted).
    fn let_through(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.count.fetch_add(1, Relaxed);
        let now = std::time::Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let due = last.is_none_or(|at| now.saturating_duration_since(at) >= self.every);
        if due {
            *last = Some(now);
        }
        due
    }
}

/// The layer that applies [`Throttle`]s.
struct Throttles(Vec<Throttle>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Throttles {
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        let target = event.metadata().target();
        if !self.0.iter().any(|t| t.target == target) {
            return true;
        }
        let mut message = MessageStart(String::new());
        event.record(&mut message);
        self.0
            .iter()
            .filter(|t| t.target == target && message.0.starts_with(t.message))
            .all(Throttle::let_through)
    }
}

/// The `message` field of an event, as text.
struct MessageStart(String);

impl tracing::field::Visit for MessageStart {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_string();
        }
    }
}

/// The runtime: current-thread for one worker, else multi-threaded with
/// `worker_threads` workers (tokio's default, one per core, when `None`). On failure the process exits
/// [`Exit::Runtime`]
/// with a line that says why.
///
/// tokio reports some failures as an error and panics on others (the OS
/// refusing a worker thread), so both are caught; the panic's own message is
/// kept for the line instead of a backtrace.
pub fn runtime(worker_threads: Option<u16>) -> tokio::runtime::Runtime {
    let mut builder = match worker_threads {
        // One thread: the current-thread scheduler. Its run queue is plain
        // FIFO: a relay that wakes its connection's writer does not run that
        // writer at once (the multi-thread scheduler's LIFO slot does), so
        // every stream that got a token in this turn queues its frame first
        // and the writer sends them in one write. docs/PERFORMANCE-LOG.md has the
        // figures.
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(usize::from(n));
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        builder.enable_all().build()
    }));
    std::panic::set_hook(quiet);
    let why = match built {
        Ok(Ok(rt)) => return rt,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_else(|| "the runtime panicked while starting".to_string()),
    };
    eprintln!("error: cannot start the async runtime: {why}");
    std::process::exit(i32::from(Exit::Runtime.code()));
}

/// The signals that start the SIGTERM path (withdraw, router grace, drain,
/// exit 0): a supervisor's stop (TERM), an operator's (INT, QUIT), a lost
/// terminal or a reload that this sidecar does not support (HUP), the CPU-time
/// soft limit (XCPU, before the kernel's SIGKILL) and a power failure (PWR).
const STOP: [(i32, &str); 6] = [
    (15, "SIGTERM"),
    (2, "SIGINT"),
    (1, "SIGHUP"),
    (3, "SIGQUIT"),
    (24, "SIGXCPU"),
    (30, "SIGPWR"),
];

/// The signals whose default action would end the process without a word or
/// a withdrawal, and that mean nothing to the sidecar: they are ignored, with
/// one WARN per kind. (SIGPIPE is ignored by Rust's runtime already: a write
/// to a closed socket is an error, not a death. The fault signals SIGSEGV,
/// SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGTRAP and SIGSYS mean the process itself
/// is broken and keep their default.)
const IGNORED: [(i32, &str); 8] = [
    (10, "SIGUSR1"),
    (12, "SIGUSR2"),
    (14, "SIGALRM"),
    (16, "SIGSTKFLT"),
    (25, "SIGXFSZ"),
    (26, "SIGVTALRM"),
    (27, "SIGPROF"),
    (29, "SIGIO"),
];

/// The real-time signals (glibc keeps 32 and 33 for itself); their default
/// action ends the process too, so they are ignored like the ones above.
const REALTIME: std::ops::RangeInclusive<i32> = 34..=64;

/// One item per stop signal, for as long as the process runs; the ignored
/// signals are caught (and said once) so that none of them ends the process.
pub fn shutdown_signals() -> mpsc::UnboundedReceiver<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, rx) = mpsc::unbounded_channel();
    for (number, name) in STOP {
        let Ok(mut stream) = signal(SignalKind::from_raw(number)) else {
            tracing::error!("cannot install a {name} handler; stop the sidecar with SIGTERM");
            continue;
        };
        let tx = tx.clone();
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                tracing::info!("{name} received");
                if tx.send(()).is_err() {
                    return;
                }
            }
        });
    }
    let realtime = REALTIME.map(|n| (n, "a real-time signal"));
    for (number, name) in IGNORED.into_iter().chain(realtime) {
        let Ok(mut stream) = signal(SignalKind::from_raw(number)) else {
            continue;
        };
        tokio::spawn(async move {
            let mut said = false;
            while stream.recv().await.is_some() {
                if !said {
                    said = true;
                    tracing::warn!(
                        signal = number,
                        "ignoring {name} ({number}): it means nothing to the sidecar; stop it \
                         with SIGTERM"
                    );
                }
            }
        });
    }
    rx
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Duration;

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    /// Counts the events that reach the layer below the throttles.
    #[derive(Clone, Default)]
    struct Written(std::sync::Arc<std::sync::atomic::AtomicU64>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Written {
        fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            self.0.fetch_add(1, Relaxed);
        }
    }

    #[test]
    fn a_throttled_line_is_written_once_per_interval_and_every_one_is_counted() {
        let throttle = Throttle::new(module_path!(), "accept failed", Duration::from_secs(3600));
        let written = Written::default();
        let subscriber = tracing_subscriber::registry()
            .with(Throttles(vec![throttle.clone()]))
            .with(written.clone());
        tracing::subscriber::with_default(subscriber, || {
            for e in 0..1_000 {
                tracing::error!("accept failed: Too many open files ({e})");
            }
            tracing::error!("another line");
            tracing::warn!(target: "elsewhere", "accept failed: not ours");
        });
        assert_eq!(throttle.count.load(Relaxed), 1_000);
        assert_eq!(
            written.0.load(Relaxed),
            3,
            "one of the storm, and the other two"
        );
    }
}
