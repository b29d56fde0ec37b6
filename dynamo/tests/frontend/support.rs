//! Dynamo's real frontend (Python, from PyPI `ai-dynamo` 1.6.1), the mock
//! OpenEngine engine (`llm-sidecar mock-engine`), and `llm-sidecar-dynamo`
//! between them, on loopback with file, etcd or Kubernetes (a fake API
//! server) discovery in a temporary directory; and a plain HTTP/1.1 client for the frontend's OpenAI API.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use crate::kube_api::FakeKube;
pub use llm_sidecar_testkit::etcd::Etcd;

/// Makes each pod uid of a test run its own (a pod made again under the
/// same name is another incarnation).
static POD_INCARNATION: AtomicU64 = AtomicU64::new(0);
pub use llm_sidecar_testkit::proc::{HANG, Proc, TempDir, wait_until};

pub use llm_sidecar_testkit::free_addr;

/// A free loopback address for Dynamo's system port: Dynamo 1.6.1 reads
/// `DYN_SYSTEM_PORT` as an i16, so the port must be below 32,768, where
/// [`free_addr`]'s ports are (below Linux's ephemeral range).
pub fn free_system_addr() -> SocketAddr {
    let addr = free_addr();
    assert!(addr.port() < 32_768, "a free port below 32768: {addr}");
    addr
}

/// `llm-sidecar-dynamo`, as cargo built it for this test.
pub fn worker_binary() -> &'static str {
    env!("CARGO_BIN_EXE_llm-sidecar-dynamo")
}

/// The target directory this test binary was built in.
fn target_dir() -> PathBuf {
    // …/target/<profile>/llm-sidecar-dynamo
    Path::new(worker_binary())
        .parent()
        .and_then(Path::parent)
        .expect("the binary is inside the target directory")
        .to_path_buf()
}

/// `llm-sidecar` (for its mock engine), built beside this crate's binary.
pub fn sidecar_binary() -> PathBuf {
    let path = Path::new(worker_binary()).with_file_name("llm-sidecar");
    assert!(
        path.exists(),
        "{} is missing: build it first (`cargo build -p llm-sidecar`; `cargo test --workspace` \
         and scripts/test.sh do)",
        path.display()
    );
    path
}

/// The Python with Dynamo installed: `DYNAMO_PYTHON`, or the venv that
/// scripts/test.sh makes in the target directory.
pub fn python() -> PathBuf {
    let path = std::env::var_os("DYNAMO_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("dynamo-venv/bin/python"));
    assert!(
        path.exists(),
        "{} is missing: run `bash scripts/test.sh` (it installs ai-dynamo 1.6.1 into \
         target/dynamo-venv) or point DYNAMO_PYTHON at a Python that has it",
        path.display()
    );
    path
}

/// A tokenizer directory the frontend can load offline: a word-level
/// tokenizer whose word `w<i>` is token `i` for every id the mock engine
/// produces (below 32,000), a chat template that joins the messages'
/// contents, and a config.json.
pub fn write_tokenizer(dir: &Path) -> PathBuf {
    let tok = dir.join("tokenizer");
    std::fs::create_dir_all(&tok).expect("tokenizer dir");
    let mut vocab = serde_json::Map::new();
    for (i, special) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert((*special).into(), i.into());
    }
    for i in 3..32_000u32 {
        vocab.insert(format!("w{i}"), i.into());
    }
    let added: Vec<serde_json::Value> = ["<unk>", "<s>", "</s>"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    let config = serde_json::json!({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    });
    let model = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "max_position_embeddings": 4096, "eos_token_id": 2, "bos_token_id": 1,
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "intermediate_size": 128,
    });
    for (name, value) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config),
        ("config.json", model),
    ] {
        std::fs::write(tok.join(name), value.to_string()).expect("write tokenizer file");
    }
    tok
}

/// The mock engine's `i`-th token for a prompt: the same formula as the
/// mock's (mock-engine/src/generate.rs, `--seed-by-prompt`, which every
/// engine of these tests runs with), so a test can say what the engine
/// will produce before the frontend names the request.
pub fn mock_token(prompt: &[u32], i: u32) -> u32 {
    let mut seed: u64 = 17;
    for id in prompt {
        seed = seed.wrapping_mul(31).wrapping_add(u64::from(*id));
    }
    ((seed
        .wrapping_mul(2_654_435_761)
        .wrapping_add(u64::from(i) * 7_919))
        % 32_000) as u32
}

/// The mock's first `n` tokens for a prompt.
pub fn mock_tokens(prompt: &[u32], n: u32) -> Vec<u32> {
    (0..n).map(|i| mock_token(prompt, i)).collect()
}

/// The text the frontend makes of token ids (the word-level tokenizer).
pub fn words(tokens: &[u32]) -> String {
    tokens.iter().map(|t| format!(" w{t}")).collect()
}

/// Whether any of these tokens is special (no text: `<unk>`, `<s>`, `</s>`,
/// the last of them the end of sequence, where the frontend stops).
pub fn any_special(tokens: &[u32]) -> bool {
    tokens.iter().any(|t| *t < 3)
}

/// The mock's logprob of a token's `rank`-th candidate (0: the token
/// itself) and that candidate's id (mock-engine/src/kinds/openengine.rs).
pub fn mock_logprob(token: u32, rank: u32) -> f64 {
    -f64::from(token % 50) / 10.0 - 0.25 - f64::from(rank) * 0.5
}

/// See [`mock_logprob`].
pub fn mock_candidate(token: u32, rank: u32) -> u32 {
    let id = (token + 97 * rank) % 32_000;
    if id < 3 { id + 3 } else { id }
}

/// A worker's pod in Kubernetes.
#[derive(Clone, Debug)]
pub struct PodOf {
    pub name: String,
    pub uid: String,
    /// Dynamo's system port, which kubelet probes (`/health`).
    pub system: SocketAddr,
}

/// Where the workers register: a file store, a real etcd, or Kubernetes
/// (the fake API server of [`crate::kube_api`]).
pub enum Store {
    File(PathBuf),
    Etcd(Box<Etcd>),
    Kube(Box<FakeKube>),
}

impl Store {
    /// The environment and flags every Dynamo process of this test gets.
    fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![("HF_HUB_OFFLINE", "1".to_string())];
        match self {
            Store::File(dir) => env.push(("DYN_FILE_KV", dir.display().to_string())),
            Store::Etcd(etcd) => env.push(("ETCD_ENDPOINTS", format!("http://{}", etcd.client))),
            Store::Kube(kube) => {
                env.push(("KUBECONFIG", kube.kubeconfig().display().to_string()));
                env.push(("POD_NAMESPACE", "default".to_string()));
            }
        }
        env
    }

    /// The fake API server of a Kubernetes setup.
    pub fn kube(&self) -> &FakeKube {
        match self {
            Store::Kube(kube) => kube,
            Store::File(_) | Store::Etcd(_) => panic!("not a Kubernetes setup"),
        }
    }

    /// A new pod in Kubernetes named `name`, made in the fake API server
    /// (`system` is where kubelet probes its readiness: Dynamo's system port).
    pub fn new_pod(&self, name: &str, system: SocketAddr) -> Option<PodOf> {
        let Store::Kube(kube) = self else {
            return None;
        };
        let uid = format!(
            "uid-{name}-{}",
            POD_INCARNATION.fetch_add(1, Ordering::Relaxed)
        );
        kube.add_pod(name, &uid, system);
        Some(PodOf {
            name: name.to_string(),
            uid,
            system,
        })
    }

    /// A process's pod as the downward API gives it, and Dynamo's system
    /// port; the frontend's pod (`None`) has a name and uid only.
    fn pod_env(&self, name: &str, pod: Option<&PodOf>) -> Vec<(&'static str, String)> {
        if !matches!(self, Store::Kube(_)) {
            return Vec::new();
        }
        let Some(pod) = pod else {
            return vec![
                ("POD_NAME", name.to_string()),
                ("POD_UID", format!("uid-{name}")),
            ];
        };
        vec![
            ("POD_NAME", pod.name.clone()),
            ("POD_UID", pod.uid.clone()),
            ("DYN_SYSTEM_HOST", pod.system.ip().to_string()),
            ("DYN_SYSTEM_PORT", pod.system.port().to_string()),
        ]
    }

    fn backend(&self) -> &'static str {
        match self {
            Store::File(_) => "file",
            Store::Etcd(_) => "etcd",
            Store::Kube(_) => "kubernetes",
        }
    }

    /// Every key the store holds: instance records, model cards, anything.
    pub fn keys(&self) -> Vec<String> {
        match self {
            Store::File(dir) => llm_sidecar_loadgen::local::files_under(dir, &|_| true)
                .into_iter()
                .map(|p| {
                    p.strip_prefix(dir)
                        .unwrap_or(&p)
                        .display()
                        .to_string()
                        .replace("%2F", "/")
                })
                .collect(),
            Store::Etcd(etcd) => etcd.keys(),
            Store::Kube(kube) => kube.keys(),
        }
    }

    /// The keys of one worker (instance id in hex).
    pub fn keys_of(&self, instance_hex: &str) -> Vec<String> {
        self.keys()
            .into_iter()
            .filter(|k| k.ends_with(&format!("/{instance_hex}")))
            .collect()
    }

    /// Every key that names one worker anywhere, its id in hex or in decimal:
    /// instance records, model cards, event channels and sources, whatever
    /// else Dynamo may write.
    pub fn keys_naming(&self, instance_hex: &str) -> Vec<String> {
        let decimal = u64::from_str_radix(instance_hex, 16)
            .expect("an instance id in hex")
            .to_string();
        self.keys()
            .into_iter()
            .filter(|k| k.contains(instance_hex) || k.contains(&decimal))
            .collect()
    }
}

/// Dynamo's frontend: `python -m dynamo.frontend` on a free HTTP port.
pub struct Frontend {
    pub proc: Proc,
    pub http: SocketAddr,
}

impl Frontend {
    /// The frontend discovering through `store`, with these of its flags.
    pub fn start_with(dir: &Path, store: &Store, extra: &[&str]) -> Self {
        let http = free_addr();
        let mut args: Vec<String> = [
            "-m",
            "dynamo.frontend",
            "--discovery-backend",
            store.backend(),
            "--request-plane",
            "tcp",
            "--http-port",
            &http.port().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut env = store.env();
        env.extend(store.pod_env(&format!("frontend-{}", http.port()), None));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let python = python();
        let proc = Proc::spawn_with_env(
            python.to_str().expect("UTF-8 path"),
            &args,
            &env,
            dir.join(format!("frontend-{}.log", http.port())),
        );
        let mut f = Frontend { proc, http };
        wait_until(Duration::from_secs(60), "the frontend to answer", || {
            assert!(f.proc.running(), "frontend exited:\n{}", f.proc.log_text());
            llm_sidecar_loadgen::local::http_get(f.http, "/v1/models", Duration::from_secs(5))
                .is_some()
        });
        f
    }

    /// The model names `/v1/models` lists.
    pub fn models(&self) -> Vec<String> {
        let Some((200, body)) =
            llm_sidecar_loadgen::local::http_get(self.http, "/v1/models", Duration::from_secs(5))
        else {
            return Vec::new();
        };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["data"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The frontend's own `/metrics` page (its router's among them).
    pub fn metrics(&self) -> String {
        llm_sidecar_loadgen::local::http_get(self.http, "/metrics", Duration::from_secs(10))
            .map(|r| r.1)
            .unwrap_or_default()
    }

    /// `POST path` with a JSON body; the status and the (de-chunked) body.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, String) {
        let mut s = self.open_post(path, body);
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("read the answer");
        parse_response(&raw)
    }

    /// Sends a streaming `POST path` and waits for the answer's first bytes
    /// (the request is in flight); returns the connection and those bytes.
    pub fn open_stream(&self, path: &str, body: &serde_json::Value) -> (TcpStream, Vec<u8>) {
        let mut stream = self.open_post(path, body);
        let mut first = [0u8; 256];
        let n = stream
            .read(&mut first)
            .expect("the first bytes of the answer");
        assert!(n > 0, "the frontend answered {path}");
        (stream, first[..n].to_vec())
    }

    /// Sends `POST path` and returns the connection, to read (or drop) as it comes.
    pub fn open_post(&self, path: &str, body: &serde_json::Value) -> TcpStream {
        let mut s = TcpStream::connect(self.http).expect("connect to the frontend");
        s.set_read_timeout(Some(HANG)).expect("timeout");
        let body = body.to_string();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .expect("send the request");
        s
    }
}

/// Reads a streamed answer to its end after the `first` bytes
/// [`Frontend::open_stream`] returned; its status and (de-chunked) body.
pub fn read_rest(mut stream: TcpStream, first: Vec<u8>) -> (u16, String) {
    let mut raw = first;
    stream
        .read_to_end(&mut raw)
        .expect("the rest of the answer");
    parse_response(&raw)
}

/// Status and body of an HTTP/1.1 answer, chunked or not.
pub fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    if !chunked {
        return (status, body.to_string());
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            out.push_str(&after[..n.min(after.len())]);
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].strip_prefix("\r\n").unwrap_or(&after[n..]);
    }
    (status, out)
}

/// The mock OpenEngine engine.
pub struct Engine {
    pub proc: Proc,
    pub grpc: SocketAddr,
    pub control: SocketAddr,
}

impl Engine {
    /// The mock engine at this pace. Its tokens follow from the prompt alone
    /// (`--seed-by-prompt`), and each stream ends a token's time after its
    /// final message (`--end-delay`), as a real engine's trailers follow its
    /// last output: a worker that drops the stream at the final message
    /// cancels a finished generation, and the mock counts it.
    pub fn start(dir: &Path, token_delay: &str) -> Self {
        let grpc = free_addr();
        let control = free_addr();
        let args: Vec<String> = [
            "mock-engine",
            "--kind",
            "openengine",
            "--model-id",
            "tiny",
            "--token-delay",
            token_delay,
            "--end-delay",
            token_delay,
            "--seed-by-prompt",
            "--listen",
            &grpc.to_string(),
            "--control-listen",
            &control.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let program = sidecar_binary();
        let proc = Proc::spawn_program(
            program.to_str().expect("UTF-8 path"),
            &args,
            dir.join(format!("engine-{}.log", grpc.port())),
        );
        let mut e = Engine {
            proc,
            grpc,
            control,
        };
        wait_until(HANG, "the mock engine to answer", || {
            assert!(e.proc.running(), "engine exited:\n{}", e.proc.log_text());
            e.try_stats().is_some()
        });
        e
    }

    fn try_stats(&self) -> Option<serde_json::Value> {
        let (status, body) =
            llm_sidecar_loadgen::local::http_get(self.control, "/stats", Duration::from_secs(5))?;
        (status == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// What the engine was last asked for the request with this prompt.
    pub fn asked_for(&self, prompt: &[u32]) -> serde_json::Value {
        let stats = self.stats();
        stats["asked"]
            .as_array()
            .expect("asked")
            .iter()
            .rev()
            .find(|a| a["prompt"] == serde_json::json!(prompt))
            .cloned()
            .unwrap_or_else(|| panic!("the engine saw prompt {prompt:?}: {stats}"))
    }

    pub fn stats(&self) -> serde_json::Value {
        self.try_stats().expect("the mock's /stats answers")
    }

    pub fn control(&self, path: &str) {
        let answer = llm_sidecar_loadgen::local::http_get(self.control, path, HANG);
        assert!(
            matches!(answer, Some((200, _))),
            "mock control {path}: {answer:?}"
        );
    }
}

/// `llm-sidecar-dynamo` in front of an engine, registered in `store`.
pub struct Worker {
    pub proc: Proc,
    /// llm-sidecar's admin port, when the worker was given one.
    pub admin: Option<SocketAddr>,
    /// In Kubernetes: its pod (name, uid, Dynamo's system port: the pod's
    /// readiness probe).
    pub pod: Option<PodOf>,
}

/// As `under`, Dynamo 1.6.1's own TensorRT-LLM sidecar in place of the
/// worker (`python -m dynamo.trtllm.sidecar`, Dynamo's Python): the peer
/// baseline, given the same arguments and environment.
pub const DYNAMOS_OWN_SIDECAR: &[&str] = &["python", "-m", "dynamo.trtllm.sidecar"];

impl Worker {
    /// A worker with an admin port and the test's short timings, plus
    /// `extra` and the environment `env`, run by the command `under` (see
    /// [`Worker::spawn`]; none: `&[]`).
    pub fn start(
        under: &[&str],
        dir: &Path,
        store: &Store,
        engine: &Engine,
        model: &Path,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> Self {
        let admin = free_addr();
        let mut args: Vec<String> = [
            "--admin-listen",
            &admin.to_string(),
            "--grpc-retry-interval-secs",
            "1",
            "--probe-interval",
            "1s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // No test here is about a stale load but the KV flood's, which asks
        // for 3 s: beside that flood a loaded 2-core machine can hold any
        // worker's probe back that long.
        if !extra.contains(&"--stale-after") {
            args.extend(["--stale-after".to_string(), "10s".to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut w = Self::spawn(under, dir, store, engine, model, &args, env);
        w.admin = Some(admin);
        w
    }

    /// A worker started with exactly Dynamo's own sidecar's arguments
    /// (`--grpc-endpoint`, `--model-path`, `--discovery-backend`,
    /// `--request-plane`) and `args` after them, run by the command `under`
    /// (its program and arguments, the worker's command line after them:
    /// `prlimit --nofile=…`; none: `&[]`; [`DYNAMOS_OWN_SIDECAR`]: Dynamo's
    /// own sidecar in the worker's place).
    pub fn spawn(
        under: &[&str],
        dir: &Path,
        store: &Store,
        engine: &Engine,
        model: &Path,
        args: &[String],
        env: &[(&str, String)],
    ) -> Self {
        let pod = store.new_pod(
            &format!("worker-{}", engine.grpc.port()),
            free_system_addr(),
        );
        Self::spawn_in(under, dir, store, engine, model, args, env, pod)
    }

    /// As [`Worker::spawn`], in this pod (in Kubernetes: a container
    /// restarted in its pod keeps the pod's name, uid and ports).
    #[allow(clippy::too_many_arguments)]
    pub fn spawn_in(
        under: &[&str],
        dir: &Path,
        store: &Store,
        engine: &Engine,
        model: &Path,
        args: &[String],
        env: &[(&str, String)],
        pod: Option<PodOf>,
    ) -> Self {
        let mut all: Vec<String> = under.iter().skip(1).map(|s| s.to_string()).collect();
        if !under.is_empty() && under != DYNAMOS_OWN_SIDECAR {
            all.push(worker_binary().to_string());
        }
        all.extend(
            [
                "--grpc-endpoint",
                &engine.grpc.to_string(),
                "--model-path",
                model.to_str().expect("UTF-8 path"),
                "--discovery-backend",
                store.backend(),
                "--request-plane",
                "tcp",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        all.extend(args.iter().cloned());
        let mut vars = store.env();
        if let Some(pod) = &pod {
            vars.extend(store.pod_env(&pod.name, Some(pod)));
        }
        vars.extend(env.iter().map(|(k, v)| (*k, v.clone())));
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let python;
        let program = if under == DYNAMOS_OWN_SIDECAR {
            python = self::python();
            python.to_str().expect("UTF-8 path")
        } else {
            under.first().copied().unwrap_or(worker_binary())
        };
        let proc = Proc::spawn_with_env(
            program,
            &all,
            &vars,
            dir.join(format!("worker-{}.log", engine.grpc.port())),
        );
        Worker {
            proc,
            admin: None,
            pod,
        }
    }

    /// Waits until the worker says its records are written; returns its
    /// instance id (hex), as the log's first line names it.
    pub fn wait_registered(&mut self) -> String {
        wait_until(Duration::from_secs(60), "the worker's records", || {
            let log = self.proc.log_text();
            assert!(self.proc.running(), "the worker exited:\n{log}");
            log.contains("record written to discovery")
        });
        let start = self.proc.wait_for_line("starting: instance ", HANG);
        start
            .split("starting: instance ")
            .nth(1)
            .and_then(|rest| rest.split(',').next())
            .expect("the start line names the instance")
            .to_string()
    }
}

/// A chat request for `model` with this prompt text.
pub fn chat(model: &str, text: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// A completion request for `model`.
pub fn completion(model: &str, prompt: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
    })
}

/// The text of an answer, streamed (SSE `data:` events) or not.
pub fn answer_text(body: &str) -> String {
    if body.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(body).expect("a JSON answer");
        let choice = &v["choices"][0];
        return choice["message"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
            .unwrap_or_default()
            .to_string();
    }
    let mut text = String::new();
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data.trim() == "[DONE]" {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(data).expect("an SSE event is JSON");
        let choice = &v["choices"][0];
        if let Some(t) = choice["delta"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
        {
            text.push_str(t);
        }
    }
    text
}
