//! What the suites share to run processes: a child process with its log, a
//! temporary directory, and waits that only stop a hang.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Generous bound for waits that only exist to stop a hang.
pub const HANG: Duration = Duration::from_secs(30);

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "llm-sidecar-test-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // KEEP_TEST_DIRS=1 keeps a failed test's logs and journals for reading.
        if std::thread::panicking() && std::env::var_os("KEEP_TEST_DIRS").is_some() {
            eprintln!("kept {}", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls `check` until it is true; panics with `what` after `limit`.
pub fn wait_until(limit: Duration, what: &str, check: impl FnMut() -> bool) {
    let held = llm_sidecar_loadgen::local::poll_until(limit, Duration::from_millis(20), check);
    assert!(held, "timed out after {limit:?} waiting for {what}");
}

/// A child process whose stderr goes to a log file; killed when dropped.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
    pub status: Option<ExitStatus>,
    /// The arguments it was started with.
    pub args: Vec<String>,
}

impl Proc {
    pub fn spawn_program(program: &str, args: &[String], log: PathBuf) -> Self {
        Proc::spawn_with_env(program, args, &[], log)
    }

    /// The same with these environment variables set.
    pub fn spawn_with_env(
        program: &str,
        args: &[String],
        env: &[(&str, &str)],
        log: PathBuf,
    ) -> Self {
        let file = std::fs::File::create(&log).expect("create log file");
        let child = Command::new(program)
            .args(args)
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        Proc {
            child,
            log,
            status: None,
            args: args.to_vec(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([format!("-{sig}"), self.pid().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{sig} {} failed", self.pid());
    }

    /// Still running?
    pub fn running(&mut self) -> bool {
        if self.status.is_some() {
            return false;
        }
        match self.child.try_wait().expect("try_wait") {
            Some(s) => {
                self.status = Some(s);
                false
            }
            None => true,
        }
    }

    /// SIGTERM, and the exit 0 that follows it (the log in the failure
    /// otherwise): a process stopped as its supervisor stops it.
    pub fn stop_cleanly(&mut self) {
        self.signal("TERM");
        let code = self.wait_exit(HANG);
        assert_eq!(code, 0, "exit after SIGTERM; log:\n{}", self.log_text());
    }

    /// Waits for the exit; returns the exit code.
    pub fn wait_exit(&mut self, limit: Duration) -> i32 {
        wait_until(limit, "the process to exit", || !self.running());
        self.status
            .and_then(|s| s.code())
            .expect("exited with a code, not a signal")
    }

    /// Waits for the process to end, by exit or by signal.
    pub fn wait_exit_or_signal(&mut self, limit: Duration) {
        wait_until(limit, "the process to end", || !self.running());
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_lines(&self) -> Vec<String> {
        self.log_text().lines().map(str::to_string).collect()
    }

    /// Index of the first log line containing `needle`.
    pub fn line_index(&self, needle: &str) -> Option<usize> {
        self.log_lines().iter().position(|l| l.contains(needle))
    }

    /// How many log lines contain `needle`.
    pub fn count_lines(&self, needle: &str) -> usize {
        self.log_lines()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// The exit path's order: the withdrawal is logged before `exiting <code>:`.
    pub fn assert_withdrawn_before_exit(&self, code: i32) {
        let withdrawn = self.line_index("withdrawn from discovery");
        let exiting = self.line_index(&format!("exiting {code}:"));
        assert!(
            withdrawn.is_some() && exiting.is_some() && withdrawn < exiting,
            "the record is withdrawn before the process exits {code}; log:\n{}",
            self.log_text()
        );
    }

    /// Checks a loss the way an operator would: the process exits 1, its log
    /// has one ERROR line `<engine> engine lost: <reason…> (instance
    /// <instance>)`, and the withdrawal is logged before the exit. Returns the line.
    pub fn assert_engine_lost(
        &mut self,
        engine: &str,
        instance: &str,
        reason_prefix: &str,
    ) -> String {
        let code = self.wait_exit(HANG);
        let log = self.log_text();
        assert_eq!(code, 1, "exit code after an engine loss; log:\n{log}");
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(" engine lost: "))
            .collect();
        assert_eq!(lines.len(), 1, "one loss line; log:\n{log}");
        let line = lines[0].to_string();
        assert!(line.contains("ERROR"), "loss is logged at ERROR: {line}");
        assert!(
            line.contains(&format!("{engine} engine lost: {reason_prefix}")),
            "loss {engine:?} {reason_prefix:?} in {line}"
        );
        assert!(
            line.ends_with(&format!("(instance {instance})")),
            "instance id {instance} in {line}"
        );
        self.assert_withdrawn_before_exit(1);
        line
    }

    pub fn wait_for_line(&self, needle: &str, limit: Duration) -> String {
        let mut found = None;
        wait_until(
            limit,
            &format!("log line {needle:?} in {}", self.log.display()),
            || {
                found = self.log_lines().into_iter().find(|l| l.contains(needle));
                found.is_some()
            },
        );
        found.unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
