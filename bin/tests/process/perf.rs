//! Performance, side by side (issue 6). Measurements, not assertions.
//!
//! `bash scripts/bench.sh` runs both (it installs nginx and builds release first).
//! Alone: `cargo test --release -p llm-sidecar --test process perf:: -- --ignored --nocapture --test-threads 1`
//! Knobs: PERF_SECS (5), PERF_REPS (3), PERF_STREAMS ("1,16,64,256"), DETECT_RUNS (20);
//! the paced run: PACE_MS (by default per point, see `paced_latency_side_by_side`),
//! PACE_TOKENS (64), PACE_STREAMS ("64,512,2048,8192");
//! both: PERF_SIDECAR_THREADS, PERF_BASELINE_BIN (another llm-sidecar build
//! measured beside this one, e.g. the commit before a change, or the same
//! binary) and PERF_BASELINE_THREADS (its --worker-threads).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::etcd::Etcd;
use crate::support::*;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) of a process and, for nginx, its workers.
fn cpu_seconds(pids: &[u32]) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / tick)
        })
        .sum()
}

fn children_of(parent: u32) -> Vec<u32> {
    let mut out = vec![parent];
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
            if ppid == Some(parent) {
                out.push(pid);
            }
        }
    }
    out
}

/// Peak resident memory of a process and its children (nginx's workers), KiB.
fn peak_rss_of(pids: &[u32]) -> u64 {
    pids.iter().map(|pid| peak_rss_kib(*pid)).sum()
}

fn bench(target: SocketAddr, streams: usize, secs: u64) -> serde_json::Value {
    bench_tokens(target, streams, secs, 256)
}

/// `llm-sidecar bench` against `target`: `streams` streams spread over one
/// connection per 64 (as a router spreads them), `tokens` per call.
fn bench_tokens(target: SocketAddr, streams: usize, secs: u64, tokens: u32) -> serde_json::Value {
    let (streams, secs, connections, tokens) = (
        streams.to_string(),
        format!("{secs}s"),
        (streams / 64).max(1).to_string(),
        tokens.to_string(),
    );
    let args = [
        "-c",
        &streams,
        "-n",
        &tokens,
        "-d",
        &secs,
        "--connections",
        &connections,
    ];
    bench_report(bench_spawn(target, &args))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// nginx's master; stopped with SIGTERM so that it stops its workers too
/// (the support `Proc` would SIGKILL the master and orphan them).
struct Nginx(Proc);

impl std::ops::Deref for Nginx {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.0
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        if self.0.running() {
            self.0.signal("TERM");
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                wait_until(HANG, "nginx to stop", || !self.0.running())
            }));
        }
    }
}

/// nginx as a plain gRPC reverse proxy (HTTP/2 both sides), or None if not installed.
fn start_nginx(dir: &std::path::Path, engine: SocketAddr) -> Option<(Nginx, SocketAddr)> {
    let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let listen = free_addr();
    let d = dir.join("nginx");
    std::fs::create_dir_all(d.join("tmp")).ok()?;
    let conf = format!(
        "worker_processes 2;\ndaemon off;\nmaster_process on;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 8192; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/tmp;\n  proxy_temp_path {d}/tmp;\n  fastcgi_temp_path {d}/tmp;\n  uwsgi_temp_path {d}/tmp;\n  scgi_temp_path {d}/tmp;\n\
         http2_max_concurrent_streams 4096;\n  keepalive_requests 10000000;\n  keepalive_timeout 300s;\n\
         upstream engine {{ server {engine}; keepalive 128; keepalive_requests 10000000; keepalive_timeout 300s; }}\n\
         server {{ listen {listen} http2; location / {{ grpc_pass grpc://engine; grpc_read_timeout 300s; grpc_send_timeout 300s; }} }}\n}}\n",
        d = d.display()
    );
    std::fs::write(d.join("nginx.conf"), conf).ok()?;
    let args = vec![
        "-c".to_string(),
        d.join("nginx.conf").display().to_string(),
        "-p".into(),
        d.display().to_string(),
    ];
    let proc = Nginx(Proc::spawn_program(nginx, &args, d.join("stderr.log")));
    wait_until(HANG, "nginx to listen", || {
        std::net::TcpStream::connect(listen).is_ok()
    });
    Some((proc, listen))
}

/// `--worker-threads <n>` when `threads` names a count, else nothing.
fn threads_flags(threads: &str) -> Vec<&str> {
    if threads.is_empty() {
        vec![]
    } else {
        vec!["--worker-threads", threads]
    }
}

/// `PERF_BASELINE_BIN`: another build of llm-sidecar (say, the commit before a
/// change) in front of the same engine, measured in the same run as its own
/// row; `PERF_BASELINE_THREADS` sets its --worker-threads (else `flags`).
fn start_baseline(dir: &TempDir, engine: SocketAddr, flags: &[&str]) -> Option<Sidecar> {
    let program = std::env::var("PERF_BASELINE_BIN").ok()?;
    let base_dir = dir.0.join("baseline");
    std::fs::create_dir_all(&base_dir).expect("baseline dir");
    let threads = std::env::var("PERF_BASELINE_THREADS").unwrap_or_default();
    let own = threads_flags(&threads);
    let flags = if own.is_empty() { flags } else { &own };
    let b = Sidecar::start_program(&program, &base_dir, engine, flags);
    b.wait_for_record(HANG);
    Some(b)
}

/// One path's runs at one concurrency: tokens/s, calls/s, TTFT p50/p99, ITL
/// p50/p99, proxy CPU seconds per million messages, and the error count.
#[derive(Default)]
struct Samples(
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    u64,
);

#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn proxy_cost_side_by_side() {
    let secs: u64 = env_or("PERF_SECS", 5);
    let reps: usize = env_or("PERF_REPS", 3);
    let streams: Vec<usize> = std::env::var("PERF_STREAMS")
        .unwrap_or_else(|_| "1,16,64,256".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let dir = TempDir::new("perf");
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let threads = std::env::var("PERF_SIDECAR_THREADS").unwrap_or_default();
    let sidecar_flags = threads_flags(&threads);
    let sidecar = Sidecar::start(&dir.0, mock.grpc, &sidecar_flags);
    sidecar.wait_for_record(HANG);
    let nginx = start_nginx(&dir.0, mock.grpc);
    let idle_sidecar = peak_rss_of(&[sidecar.proc.pid()]);
    let mut targets: Vec<(&str, SocketAddr, Vec<u32>)> = vec![
        ("direct", mock.grpc, vec![]),
        ("llm-sidecar", sidecar.listen, vec![sidecar.proc.pid()]),
    ];
    let baseline = start_baseline(&dir, mock.grpc, &sidecar_flags);
    if let Some(b) = &baseline {
        targets.push(("llm-sidecar baseline", b.listen, vec![b.proc.pid()]));
    }
    if let Some((p, addr)) = &nginx {
        targets.push(("nginx", *addr, children_of(p.pid())));
    }
    let mut report = String::new();
    let _ = writeln!(
        report,
        "machine: {} cores; {secs}s per run, median of {reps} runs, 256 tokens per call, mock per-token delay 0\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let _ = writeln!(
        report,
        "| streams | path | tokens/s | calls/s | vs direct | vs nginx | TTFT p50/p99 (us) | ITL p50/p99 (us) | proxy CPU s per 1M msgs | proxy peak RSS (MiB) | errors |"
    );
    let _ = writeln!(report, "|---|---|---|---|---|---|---|---|---|---|---|");
    for &c in &streams {
        let mut rows: BTreeMap<&str, Samples> = BTreeMap::new();
        for _ in 0..reps {
            for (name, addr, pids) in &targets {
                let pids = if *name == "nginx" {
                    nginx
                        .as_ref()
                        .map(|(p, _)| children_of(p.pid()))
                        .unwrap_or_default()
                } else {
                    pids.clone()
                };
                let cpu0 = cpu_seconds(&pids);
                let r = bench(*addr, c, secs);
                let cpu = cpu_seconds(&pids) - cpu0;
                let calls = r["calls_ok"].as_f64().unwrap_or(0.0);
                let msgs = calls * 258.0; // request + 256 chunks + complete
                let e = rows.entry(name).or_default();
                e.0.push(r["tokens_per_s"].as_f64().unwrap_or(0.0));
                e.1.push(r["calls_per_s"].as_f64().unwrap_or(0.0));
                e.2.push(r["ttft"]["p50_us"].as_f64().unwrap_or(0.0));
                e.3.push(r["ttft"]["p99_us"].as_f64().unwrap_or(0.0));
                e.4.push(r["itl"]["p50_us"].as_f64().unwrap_or(0.0));
                e.5.push(r["itl"]["p99_us"].as_f64().unwrap_or(0.0));
                if !pids.is_empty() && msgs > 0.0 {
                    e.6.push(cpu / msgs * 1e6);
                }
                e.7 += r["errors"]
                    .as_object()
                    .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
            }
        }
        let tok = |n: &str| rows.get(n).map_or(f64::NAN, |r| median(r.0.clone()));
        for (name, _, _) in &targets {
            let r = &rows[name];
            let t = median(r.0.clone());
            let rss = match *name {
                "llm-sidecar" => {
                    format!("{:.1}", peak_rss_of(&[sidecar.proc.pid()]) as f64 / 1024.0)
                }
                "llm-sidecar baseline" => baseline.as_ref().map_or("-".into(), |b| {
                    format!("{:.1}", peak_rss_of(&[b.proc.pid()]) as f64 / 1024.0)
                }),
                "nginx" => nginx.as_ref().map_or("-".into(), |(p, _)| {
                    format!("{:.1}", peak_rss_of(&children_of(p.pid())) as f64 / 1024.0)
                }),
                _ => "-".into(),
            };
            let cpu = if r.6.is_empty() {
                "-".to_string()
            } else {
                format!("{:.1}", median(r.6.clone()))
            };
            let _ = writeln!(
                report,
                "| {c} | {name} | {t:.0} | {:.0} | {:.2} | {} | {:.0}/{:.0} | {:.0}/{:.0} | {cpu} | {rss} | {} |",
                median(r.1.clone()),
                t / tok("direct"),
                if nginx.is_some() {
                    format!("{:.2}", t / tok("nginx"))
                } else {
                    "-".into()
                },
                median(r.2.clone()),
                median(r.3.clone()),
                median(r.4.clone()),
                median(r.5.clone()),
                r.7
            );
        }
    }
    let _ = writeln!(
        report,
        "\nllm-sidecar idle peak RSS before the load: {:.1} MiB",
        idle_sidecar as f64 / 1024.0
    );
    if nginx.is_none() {
        let _ = writeln!(
            report,
            "\nnginx not installed: run scripts/bench.sh, which installs it"
        );
    }
    println!("{report}");
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/perf-proxy.md"),
        &report,
    );
}

/// The engine at a real engine's pace, `PACE_TOKENS` (64) per call, at
/// `PACE_STREAMS` ("64,512,2048,8192") streams over one connection per 64,
/// all from one address as a router sends: what the sidecar and nginx *add*
/// to the first token and to each gap between tokens, and what each costs in
/// CPU, against the engine direct, side by side in one run.
///
/// The pace is `PACE_MS` per token where it is set; else each point gets the
/// slowest of 20 ms and what keeps the engine's whole output within 20,000
/// tokens/s per core of this machine (rounded up to 10 ms), so that the
/// engine and the load generator still fit beside the proxy: on 2 cores,
/// 8,192 streams run at 210 ms per token. Each pace gets an engine, sidecar
/// and nginx of its own.
#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn paced_latency_side_by_side() {
    let tokens: u32 = env_or("PACE_TOKENS", 64);
    let secs: u64 = env_or("PERF_SECS", 10);
    let reps: usize = env_or("PERF_REPS", 3);
    let streams: Vec<usize> = std::env::var("PACE_STREAMS")
        .unwrap_or_else(|_| "64,512,2048,8192".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pace_of = |streams: usize| -> u64 {
        std::env::var("PACE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                let fits = (streams as u64 * 1000).div_ceil(20_000 * cores as u64);
                fits.div_ceil(10).max(2) * 10
            })
    };
    let threads = std::env::var("PERF_SIDECAR_THREADS").unwrap_or_default();
    let mut report = String::new();
    let _ = writeln!(
        report,
        "machine: {cores} cores; {tokens} tokens per call, one bench connection per 64 streams, \
         one address; {secs}s per run, median of {reps} runs; llm-sidecar {} thread(s), default \
         flags otherwise; nginx 2 workers\n",
        if threads.is_empty() { "1" } else { &threads },
    );
    let _ = writeln!(
        report,
        "| streams | ms per token | path | tokens/s | vs direct | TTFT p50/p99 (ms) | added TTFT p50/p99 (ms) | ITL p50/p99 (ms) | added ITL p50/p99 (ms) | proxy CPU s per s | proxy CPU s per 1M msgs | errors | peak RSS (MiB) |"
    );
    let _ = writeln!(
        report,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut paces: Vec<u64> = streams.iter().map(|&c| pace_of(c)).collect();
    paces.dedup();
    for pace_ms in paces {
        let points: Vec<usize> = streams
            .iter()
            .copied()
            .filter(|&c| pace_of(c) == pace_ms)
            .collect();
        paced_points(
            &mut report,
            pace_ms,
            &points,
            (tokens, secs, reps),
            &threads,
        );
    }
    println!("{report}");
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/perf-paced.md"),
        &report,
    );
}

/// The rows of `points` at one pace, each path measured side by side.
fn paced_points(
    report: &mut String,
    pace_ms: u64,
    points: &[usize],
    (tokens, secs, reps): (u32, u64, usize),
    threads: &str,
) {
    let dir = TempDir::new("paced");
    let delay = format!("{pace_ms}ms");
    let mock = Mock::start(&dir.0, free_addr(), &["--token-delay", &delay]);
    let sidecar_flags = threads_flags(threads);
    let sidecar = Sidecar::start(&dir.0, mock.grpc, &sidecar_flags);
    sidecar.wait_for_record(HANG);
    let nginx = start_nginx(&dir.0, mock.grpc);
    let baseline = start_baseline(&dir, mock.grpc, &sidecar_flags);
    let mut targets: Vec<(&str, SocketAddr)> =
        vec![("direct", mock.grpc), ("llm-sidecar", sidecar.listen)];
    if let Some(b) = &baseline {
        targets.push(("llm-sidecar baseline", b.listen));
    }
    if let Some((_, addr)) = &nginx {
        targets.push(("nginx", *addr));
    }
    let pids_of = |name: &str| -> Vec<u32> {
        match name {
            "llm-sidecar" => vec![sidecar.proc.pid()],
            "llm-sidecar baseline" => baseline.iter().map(|b| b.proc.pid()).collect(),
            "nginx" => nginx
                .as_ref()
                .map(|(p, _)| children_of(p.pid()))
                .unwrap_or_default(),
            _ => vec![],
        }
    };
    for &c in points {
        // tokens/s, ttft p50, p99, itl p50, p99, cpu per s, cpu per 1M, errors
        let mut rows: BTreeMap<&str, [Vec<f64>; 7]> = BTreeMap::new();
        let mut errors: BTreeMap<&str, u64> = BTreeMap::new();
        for _ in 0..reps {
            for (name, addr) in &targets {
                let pids = pids_of(name);
                let cpu0 = cpu_seconds(&pids);
                let started = Instant::now();
                let r = bench_tokens(*addr, c, secs, tokens);
                let wall = started.elapsed().as_secs_f64();
                let cpu = cpu_seconds(&pids) - cpu0;
                let msgs = r["calls_ok"].as_f64().unwrap_or(0.0) * f64::from(tokens + 2);
                let e = rows.entry(name).or_default();
                e[0].push(r["tokens_per_s"].as_f64().unwrap_or(0.0));
                e[1].push(r["ttft"]["p50_us"].as_f64().unwrap_or(0.0) / 1000.0);
                e[2].push(r["ttft"]["p99_us"].as_f64().unwrap_or(0.0) / 1000.0);
                e[3].push(r["itl"]["p50_us"].as_f64().unwrap_or(0.0) / 1000.0);
                e[4].push(r["itl"]["p99_us"].as_f64().unwrap_or(0.0) / 1000.0);
                if !pids.is_empty() && msgs > 0.0 {
                    e[5].push(cpu / wall);
                    e[6].push(cpu / msgs * 1e6);
                }
                *errors.entry(name).or_default() += r["errors"]
                    .as_object()
                    .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
            }
        }
        let med = |name: &str, i: usize| rows.get(name).map_or(f64::NAN, |r| median(r[i].clone()));
        for (name, _) in &targets {
            let added = |i: usize| {
                if *name == "direct" {
                    "-".to_string()
                } else {
                    format!("{:+.2}", med(name, i) - med("direct", i))
                }
            };
            let cpu = |i: usize| {
                if rows[name][i].is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.3}", med(name, i))
                }
            };
            let pids = pids_of(name);
            let rss = if pids.is_empty() {
                "-".to_string()
            } else {
                format!("{:.1}", peak_rss_of(&pids) as f64 / 1024.0)
            };
            let _ = writeln!(
                report,
                "| {c} | {pace_ms} | {name} | {:.0} | {:.3}× | {:.2}/{:.2} | {}/{} | {:.2}/{:.2} | {}/{} | {} | {} | {} | {rss} |",
                med(name, 0),
                med(name, 0) / med("direct", 0),
                med(name, 1),
                med(name, 2),
                added(1),
                added(2),
                med(name, 3),
                med(name, 4),
                added(3),
                added(4),
                cpu(5),
                if rows[name][6].is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.2}", med(name, 6))
                },
                errors[name]
            );
        }
    }
    if nginx.is_none() {
        let _ = writeln!(
            report,
            "\nnginx not installed: run scripts/bench.sh, which installs it"
        );
    }
}

/// What to do to the engine, and the flags that make the sidecar notice.
#[derive(Clone, Copy)]
enum Fault {
    NotServing,
    WatchEnds,
    Kill,
    Stop,
    HealthCheckStalls,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::NotServing => "liveness NOT_SERVING",
            Fault::WatchEnds => "Watch ends (graceful stop)",
            Fault::Kill => "engine SIGKILL",
            Fault::Stop => "engine SIGSTOP (keepalive 11s + 2s)",
            Fault::HealthCheckStalls => "HealthCheck stalls (stale after 3s, probe 1s)",
        }
    }

    fn flags(self) -> &'static [&'static str] {
        match self {
            Fault::Stop => &[
                "--keepalive-interval",
                "11s",
                "--keepalive-timeout",
                "2s",
                "--stale-after",
                "60s",
            ],
            Fault::HealthCheckStalls => &["--probe-interval", "1s", "--stale-after", "3s"],
            Fault::NotServing | Fault::WatchEnds | Fault::Kill => &[],
        }
    }

    fn inject(self, mock: &Mock) {
        match self {
            Fault::NotServing => drop(mock.control("/liveness?status=2")),
            Fault::WatchEnds => drop(mock.control("/watch/end")),
            Fault::Kill => mock.proc.signal("KILL"),
            Fault::Stop => mock.proc.signal("STOP"),
            Fault::HealthCheckStalls => drop(mock.control("/healthcheck?mode=stall")),
        }
    }
}

fn fmt_ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn detection_latency_per_fault() {
    let runs: usize = env_or("DETECT_RUNS", 20);
    let dir = TempDir::new("detect");
    let etcd = Etcd::started(&dir.0);
    let mut report = String::new();
    let _ = writeln!(
        report,
        "fault injected -> record gone (file: the file removed; etcd: the key deleted), {runs} runs each\n"
    );
    let _ = writeln!(report, "| fault | discovery | median | p90 | worst |");
    let _ = writeln!(report, "|---|---|---|---|---|");
    for fault in [
        Fault::NotServing,
        Fault::WatchEnds,
        Fault::Kill,
        Fault::HealthCheckStalls,
        Fault::Stop,
    ] {
        for discovery in ["file", "etcd"] {
            let mut samples = Vec::with_capacity(runs);
            for _ in 0..runs {
                let mock = Mock::start(&dir.0, free_addr(), &[]);
                let endpoint = etcd.endpoint();
                let mut flags: Vec<&str> = fault.flags().to_vec();
                if discovery == "etcd" {
                    flags.extend(["--discovery", endpoint.as_str()]);
                }
                let mut sidecar = Sidecar::start(&dir.0, mock.grpc, &flags);
                sidecar.proc.wait_for_line("registered; serving", HANG);
                let gone: Box<dyn Fn() -> bool> = if discovery == "file" {
                    let path = sidecar.wait_for_record(HANG);
                    Box::new(move || !path.exists())
                } else {
                    wait_until(HANG, "the key", || etcd.keys().len() == 1);
                    let key = etcd.keys().remove(0);
                    let etcd = &etcd;
                    Box::new(move || etcd.get(&key).is_none())
                };
                std::thread::sleep(Duration::from_millis(300));
                let start = Instant::now();
                fault.inject(&mock);
                while !gone() {
                    assert!(
                        start.elapsed() < Duration::from_secs(60),
                        "{} never detected",
                        fault.name()
                    );
                    std::thread::sleep(Duration::from_micros(200));
                }
                samples.push(start.elapsed());
                assert_eq!(sidecar.proc.wait_exit(HANG), 1);
                if matches!(fault, Fault::Stop) {
                    mock.proc.signal("KILL");
                }
            }
            samples.sort();
            let p = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
            let _ = writeln!(
                report,
                "| {} | {discovery} | {} | {} | {} |",
                fault.name(),
                fmt_ms(p(0.5)),
                fmt_ms(p(0.9)),
                fmt_ms(samples[samples.len() - 1])
            );
            println!(
                "{} / {discovery}: median {}, worst {}",
                fault.name(),
                fmt_ms(p(0.5)),
                fmt_ms(samples[samples.len() - 1])
            );
        }
    }
    println!("{report}");
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/perf-detection.md"),
        &report,
    );
}

/// One kind's runs of one fault, file discovery: sorted fault-to-withdrawal
/// times, and the loss reasons seen.
fn detect_runs(kind: &str, fault: Fault, runs: usize) -> (Vec<Duration>, BTreeMap<String, usize>) {
    let dir = TempDir::new(&format!("detect-{kind}"));
    let mut samples = Vec::with_capacity(runs);
    let mut reasons = BTreeMap::new();
    for run in 0..runs {
        let mock = Mock::start(&dir.0, free_addr(), &["--kind", kind]);
        let mut sidecar = Sidecar::start(&dir.0, mock.grpc, fault.flags());
        let path = sidecar.wait_for_record(HANG);
        sidecar.proc.wait_for_line("registered; serving", HANG);
        // The polls start at registration: a fault at a fixed time after it
        // would always fall at the same point between two polls. Spread the
        // runs over the interval (37 ms steps, modulo 100 ms).
        std::thread::sleep(Duration::from_millis(300 + (run as u64 * 37) % 100));
        let start = Instant::now();
        fault.inject(&mock);
        while path.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{kind}: {} never detected",
                fault.name()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        samples.push(start.elapsed());
        assert_eq!(sidecar.proc.wait_exit(HANG), 1);
        let line = sidecar.proc.wait_for_line(" engine lost: ", HANG);
        let reason = line
            .split_once(" engine lost: ")
            .map(|(_, r)| r.split([':', '(']).next().unwrap_or(r).trim().to_string())
            .unwrap_or_default();
        *reasons.entry(reason).or_insert(0) += 1;
        if matches!(fault, Fault::Stop) {
            mock.proc.signal("KILL");
        }
    }
    samples.sort();
    (samples, reasons)
}

/// Every kind, at default settings except where the fault needs a flag: a
/// NOT_SERVING (streamed for TensorRT-LLM, polled for vLLM and SGLang), a
/// SIGKILL, a SIGSTOP. The SIGSTOP runs of the four kinds go side by side
/// (they wait on timers, not on the CPU); the others one after another.
/// DETECT_KINDS (`vllm,sglang`) and DETECT_FAULTS (`not_serving,kill,stop`)
/// narrow the run.
#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn detection_latency_per_kind() {
    let runs: usize = env_or("DETECT_RUNS", 20);
    // DETECT_KINDS and DETECT_FAULTS (not_serving, kill, stop) narrow the run.
    let chosen = |var: &str, all: &[&'static str]| -> Vec<(usize, &'static str)> {
        let wanted = std::env::var(var).unwrap_or_default();
        all.iter()
            .copied()
            .enumerate()
            .filter(|(_, x)| wanted.is_empty() || wanted.split(',').any(|w| w == *x))
            .collect()
    };
    let kinds = chosen("DETECT_KINDS", &["trtllm", "openengine", "vllm", "sglang"]);
    let fault_names = chosen("DETECT_FAULTS", &["not_serving", "kill", "stop"]);
    let fault_of = |name: &str| match name {
        "not_serving" => Fault::NotServing,
        "kill" => Fault::Kill,
        _ => Fault::Stop,
    };
    let mut rows: BTreeMap<(usize, usize), String> = BTreeMap::new();
    let row =
        |kind: &str, fault: Fault, samples: &[Duration], reasons: &BTreeMap<String, usize>| {
            let p = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
            let reasons: Vec<String> = reasons.iter().map(|(r, n)| format!("{r} ×{n}")).collect();
            format!(
                "| {kind} | {} | {} | {} | {} | {} |",
                fault.name(),
                fmt_ms(p(0.5)),
                fmt_ms(p(0.9)),
                fmt_ms(samples[samples.len() - 1]),
                reasons.join(", ")
            )
        };
    for &(f, name) in fault_names.iter().filter(|(_, n)| *n != "stop") {
        for &(k, kind) in &kinds {
            let (samples, reasons) = detect_runs(kind, fault_of(name), runs);
            let line = row(kind, fault_of(name), &samples, &reasons);
            println!("{line}");
            rows.insert((k, f), line);
        }
    }
    if fault_names.iter().any(|(_, n)| *n == "stop") {
        let stopped: Vec<_> = kinds
            .iter()
            .map(|&(k, kind)| {
                (
                    k,
                    kind,
                    std::thread::spawn(move || detect_runs(kind, Fault::Stop, runs)),
                )
            })
            .collect();
        for (k, kind, handle) in stopped {
            let (samples, reasons) = handle.join().expect("SIGSTOP runs");
            let line = row(kind, Fault::Stop, &samples, &reasons);
            println!("{line}");
            rows.insert((k, 2), line);
        }
    }
    let mut report = format!(
        "fault injected -> record file gone, file discovery, {runs} runs each\n\n\
         | kind | fault | median | p90 | worst | loss reasons |\n|---|---|---|---|---|---|\n"
    );
    for line in rows.values() {
        let _ = writeln!(report, "{line}");
    }
    println!("{report}");
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/perf-detection-kinds.md"),
        &report,
    );
}
