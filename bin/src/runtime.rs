//! What every subcommand runs on: logging to stderr, the async runtime, and
//! the signals that ask the sidecar to stop.

use tokio::sync::mpsc;

use crate::cli::LogFormat;

/// Exit code when the async runtime cannot start (the OS refused its threads):
/// sysexits' EX_OSERR. Never 1, which means "engine lost" to a supervisor.
pub const EXIT_RUNTIME: i32 = 71;

/// Sets up tracing to stderr; `RUST_LOG` overrides the default `info`.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,h2=warn,hyper=warn,tower=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// The multi-threaded runtime, with `worker_threads` workers (tokio's default,
/// one per core, when `None`). On failure the process exits [`EXIT_RUNTIME`]
/// with a line that says why.
///
/// tokio reports some failures as an error and panics on others (the OS
/// refusing a worker thread), so both are caught; the panic's own message is
/// kept for the line instead of a backtrace.
pub fn runtime(worker_threads: Option<u16>) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = worker_threads {
        builder.worker_threads(usize::from(n));
    }
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
    std::process::exit(EXIT_RUNTIME);
}

/// One item per SIGTERM or SIGINT, for as long as the process runs.
pub fn shutdown_signals() -> mpsc::UnboundedReceiver<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!(
                "cannot install SIGTERM/SIGINT handlers; stop the sidecar with SIGKILL"
            );
            return;
        };
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    rx
}
