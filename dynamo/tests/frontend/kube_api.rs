//! A fake Kubernetes API server on loopback: the calls Dynamo 1.6.1's
//! `kubernetes` discovery makes (kube-client 2.0.1), and the cluster's parts
//! that discovery depends on.
//!
//! Served: `DynamoWorkerMetadata` list (with `resourceVersion`), watch
//! (newline-delimited `{"type","object"}` events from a resource version),
//! metadata-only list (`as=PartialObjectMetadataList`), get, server-side
//! apply (`PATCH`, creates or replaces) and delete; `EndpointSlice` list and
//! watch. Played: kubelet (probes each pod's readiness URL every
//! [`PROBE_EVERY`] and sets its endpoint's `conditions.ready`), the
//! EndpointSlice controller (one slice per pod, labelled as Dynamo's operator
//! labels its Services) and the garbage collector (a pod deleted takes the
//! objects it owns). Faults on demand: 403 and 404 on every
//! `DynamoWorkerMetadata` call, the server down (connections accepted and
//! dropped, open watches cut), watches alone down, slow writes; and a
//! compaction of the change history, after which a watch from an older
//! resource version is told it is too old (`410 Expired`), as Kubernetes'
//! watch cache tells it.
//!
//! Real clients sit on both ends: Dynamo's frontend (Python, Dynamo's Rust
//! runtime inside) and `llm-sidecar-dynamo`, each with a kubeconfig naming
//! this server.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// How often the kubelet here probes each pod's readiness (Kubernetes'
/// smallest `periodSeconds` is 1; a failure threshold of 1).
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

const DWM: &str = "/apis/nvidia.com/v1alpha1/namespaces/";
const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/";

/// What the server does wrong, when asked to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// 403 on every `DynamoWorkerMetadata` call (RBAC).
    Forbidden,
    /// 404 on every `DynamoWorkerMetadata` call (no CRD).
    NoCrd,
    /// Connections accepted and dropped at once; open watches cut.
    Down,
    /// Every server-side apply held this long before it is stored (an API
    /// server under load).
    SlowApply(Duration),
    /// Open watches cut and new ones answered 503, every other call served:
    /// the watchers miss changes and, once watches are back, resume from the
    /// resource version they last saw.
    WatchesDown,
}

/// A pod, as kubelet and the EndpointSlice controller see it.
struct Pod {
    uid: String,
    /// Where its readiness probe goes (`GET /health`).
    probe: SocketAddr,
    ready: bool,
}

#[derive(Default)]
struct State {
    version: u64,
    /// Objects by (collection, name): "dwm" or "slice".
    objects: BTreeMap<(&'static str, String), Value>,
    /// Every change since the last compaction, for watches that start from
    /// a resource version.
    history: Vec<(u64, &'static str, Value)>,
    /// The resource version of the last compaction: a watch from an older
    /// one cannot be resumed.
    compacted: u64,
    /// Watches answered `410 Expired`.
    expired: u64,
    /// Lists served whole (not metadata-only): a watcher's first, or its
    /// next after an expired watch.
    lists: u64,
    watchers: Vec<(&'static str, mpsc::UnboundedSender<Bytes>)>,
    pods: BTreeMap<String, Pod>,
    fault: Option<Fault>,
    /// Bumped to cut every open connection (the server going down).
    cut: Option<tokio::sync::watch::Sender<u64>>,
}

impl State {
    fn event(&mut self, kind: &'static str, change: &str, object: Value) {
        let line = json!({"type": change, "object": object});
        let version = self.version;
        self.history.push((version, kind, line.clone()));
        let mut bytes = serde_json::to_vec(&line).expect("JSON");
        bytes.push(b'\n');
        let bytes = Bytes::from(bytes);
        self.watchers
            .retain(|(k, tx)| *k != kind || tx.send(bytes.clone()).is_ok());
    }

    /// Stores `object` under `name`, stamped with a new resource version.
    fn put(&mut self, kind: &'static str, name: &str, mut object: Value) -> Value {
        self.version += 1;
        let existed = self.objects.get(&(kind, name.to_string())).cloned();
        let meta = &mut object["metadata"];
        meta["name"] = json!(name);
        meta["namespace"] = json!("default");
        meta["resourceVersion"] = json!(self.version.to_string());
        let uid = existed
            .as_ref()
            .and_then(|e| e["metadata"]["uid"].as_str().map(str::to_string))
            .unwrap_or_else(|| format!("obj-{}", self.version));
        meta["uid"] = json!(uid);
        meta["creationTimestamp"] = json!("2026-12-06T00:00:00Z");
        let generation = existed
            .as_ref()
            .and_then(|e| e["metadata"]["generation"].as_i64())
            .unwrap_or(0)
            + 1;
        meta["generation"] = json!(generation);
        self.objects
            .insert((kind, name.to_string()), object.clone());
        self.event(
            kind,
            if existed.is_some() {
                "MODIFIED"
            } else {
                "ADDED"
            },
            object.clone(),
        );
        object
    }

    fn remove(&mut self, kind: &'static str, name: &str) -> Option<Value> {
        let mut object = self.objects.remove(&(kind, name.to_string()))?;
        self.version += 1;
        object["metadata"]["resourceVersion"] = json!(self.version.to_string());
        self.event(kind, "DELETED", object.clone());
        Some(object)
    }

    /// The EndpointSlice of `pod`: one endpoint, ready as kubelet found it.
    fn slice(name: &str, pod: &Pod) -> Value {
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": format!("{name}-slice"),
                "labels": {
                    "nvidia.com/dynamo-discovery-backend": "kubernetes",
                    "nvidia.com/dynamo-discovery-enabled": "true",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": pod.ready},
                "targetRef": {"kind": "Pod", "namespace": "default", "name": name, "uid": pod.uid},
            }],
            "ports": [],
        })
    }
}

/// The fake API server; stops when dropped.
pub struct FakeKube {
    state: Arc<Mutex<State>>,
    kubeconfig: PathBuf,
    _runtime: tokio::runtime::Runtime,
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: u16, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .expect("a response")
}

fn status(code: u16, reason: &str, message: &str) -> Response<Body> {
    full(
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code}),
    )
}

fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl FakeKube {
    /// Starts the server and its kubelet; writes a kubeconfig naming it into `dir`.
    pub fn start(dir: &Path) -> FakeKube {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let state = Arc::new(Mutex::new(State::default()));
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("a port");
        let addr = listener.local_addr().expect("its address");
        runtime.spawn(serve(listener, state.clone()));
        runtime.spawn(kubelet(state.clone()));
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\n\
                 users:\n- name: fake\n  user:\n    token: fake\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
                 current-context: fake\n"
            ),
        )
        .expect("kubeconfig");
        FakeKube {
            state,
            kubeconfig,
            _runtime: runtime,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the kubeconfig is.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Creates a pod whose readiness kubelet probes at `probe` (`/health`).
    pub fn add_pod(&self, name: &str, uid: &str, probe: SocketAddr) {
        let mut s = self.state();
        let pod = Pod {
            uid: uid.to_string(),
            probe,
            ready: false,
        };
        let slice = State::slice(name, &pod);
        s.pods.insert(name.to_string(), pod);
        s.put("slice", &format!("{name}-slice"), slice);
    }

    /// Deletes a pod: its slice goes, and the garbage collector removes every
    /// object it owns.
    pub fn delete_pod(&self, name: &str) {
        self.remove_pod(name);
        self.collect_garbage();
    }

    /// Deletes a pod and its slice, and nothing else yet: the garbage
    /// collector runs later, apart from the deletion, as Kubernetes' does.
    pub fn remove_pod(&self, name: &str) {
        let mut s = self.state();
        if s.pods.remove(name).is_some() {
            s.remove("slice", &format!("{name}-slice"));
        }
    }

    /// The garbage collector's pass: every object none of whose owners is a
    /// pod that exists (by uid) is removed.
    pub fn collect_garbage(&self) {
        let mut s = self.state();
        let live: std::collections::BTreeSet<&str> =
            s.pods.values().map(|p| p.uid.as_str()).collect();
        // Kubernetes' collector takes an object with owners only, once none
        // of them exists.
        let orphan = |o: &Value| {
            let owners = o["metadata"]["ownerReferences"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            !owners.is_empty()
                && !owners
                    .iter()
                    .any(|r| r["uid"].as_str().is_some_and(|u| live.contains(u)))
        };
        let orphans: Vec<String> = s
            .objects
            .iter()
            .filter(|((kind, _), o)| *kind == "dwm" && orphan(o))
            .map(|((_, name), _)| name.clone())
            .collect();
        for name in orphans {
            s.remove("dwm", &name);
        }
    }

    /// Whether kubelet last found the pod ready.
    pub fn pod_ready(&self, name: &str) -> bool {
        self.state().pods.get(name).is_some_and(|p| p.ready)
    }

    /// Sets (or clears) a fault.
    pub fn fault(&self, fault: Option<Fault>) {
        let mut s = self.state();
        s.fault = fault;
        if matches!(fault, Some(Fault::Down | Fault::WatchesDown)) {
            // Dropping a watch's sender ends its response.
            s.watchers.clear();
        }
        if fault == Some(Fault::Down)
            && let Some(cut) = &s.cut
        {
            cut.send_modify(|n| *n += 1);
        }
    }

    /// Compacts the change history as etcd does: a watch from a resource
    /// version older than the current one is then answered `410 Expired`
    /// and its watcher must list again.
    pub fn compact(&self) {
        let mut s = self.state();
        s.compacted = s.version;
        s.history.clear();
    }

    /// How many watches were answered `410 Expired`.
    pub fn expired_watches(&self) -> u64 {
        self.state().expired
    }

    /// How many whole lists were served.
    pub fn lists(&self) -> u64 {
        self.state().lists
    }

    /// The `DynamoWorkerMetadata` object of this name, if any.
    pub fn object(&self, name: &str) -> Option<Value> {
        self.state()
            .objects
            .get(&("dwm", name.to_string()))
            .cloned()
    }

    /// Every record every object holds, as Dynamo's file store would name
    /// it: `v1/<instances|mdc|event_channels|event_sources>/<ns>/<component>/<endpoint or topic>/<id hex>`.
    pub fn keys(&self) -> Vec<String> {
        let s = self.state();
        let mut keys = Vec::new();
        for ((kind, _), object) in &s.objects {
            if *kind != "dwm" {
                continue;
            }
            let data = &object["spec"]["data"];
            for (section, prefix) in [
                ("endpoints", "instances"),
                ("model_cards", "mdc"),
                ("event_channels", "event_channels"),
                ("event_sources", "event_sources"),
            ] {
                let Some(records) = data[section].as_object() else {
                    continue;
                };
                for (path, record) in records {
                    let id = record["instance_id"]
                        .as_u64()
                        .or_else(|| record["publisher_id"].as_u64())
                        .unwrap_or(0);
                    keys.push(format!("v1/{prefix}/{path}/{id:x}"));
                }
            }
        }
        keys
    }
}

async fn serve(listener: tokio::net::TcpListener, state: Arc<Mutex<State>>) {
    let (cut, _) = tokio::sync::watch::channel(0u64);
    state.lock().unwrap().cut = Some(cut.clone());
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        if state.lock().unwrap().fault == Some(Fault::Down) {
            drop(stream);
            continue;
        }
        let state = state.clone();
        let mut cut = cut.subscribe();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(answer(req, state).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                _ = cut.changed() => {}
            }
        });
    }
}

async fn answer(req: Request<Incoming>, state: Arc<Mutex<State>>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let q = query(&req);
    let method = req.method().clone();
    let metadata_only = req
        .headers()
        .get("accept")
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("PartialObjectMetadataList"));
    let (kind, name) = if let Some(rest) = path.strip_prefix(DWM) {
        let fault = state.lock().unwrap().fault;
        match fault {
            Some(Fault::Forbidden) => {
                return status(
                    403,
                    "Forbidden",
                    "dynamoworkermetadatas.nvidia.com is forbidden: User \"system:serviceaccount:default:worker\" cannot list resource",
                );
            }
            Some(Fault::NoCrd) => {
                return status(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                );
            }
            _ => {}
        }
        let mut parts = rest.splitn(3, '/');
        let _ns = parts.next();
        if parts.next() != Some("dynamoworkermetadatas") {
            return status(404, "NotFound", "no such path");
        }
        ("dwm", parts.next().map(str::to_string))
    } else if let Some(rest) = path.strip_prefix(SLICES) {
        let mut parts = rest.splitn(3, '/');
        let _ns = parts.next();
        if parts.next() != Some("endpointslices") {
            return status(404, "NotFound", "no such path");
        }
        ("slice", parts.next().map(str::to_string))
    } else {
        return status(404, "NotFound", "no such path");
    };
    match (method.as_str(), name) {
        ("GET", None) if q.get("watch").map(String::as_str) == Some("true") => {
            let from: u64 = q
                .get("resourceVersion")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let (tx, rx) = mpsc::unbounded_channel();
            {
                let mut s = state.lock().unwrap();
                if s.fault == Some(Fault::WatchesDown) {
                    return status(503, "ServiceUnavailable", "watches unavailable");
                }
                if from != 0 && from < s.compacted {
                    // What Kubernetes' watch cache answers: the response
                    // starts, and its one event is the error.
                    s.expired += 1;
                    let line = json!({"type": "ERROR", "object": {
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "reason": "Expired", "code": 410,
                        "message": format!("too old resource version: {from} ({})", s.compacted),
                    }});
                    let mut bytes = serde_json::to_vec(&line).expect("JSON");
                    bytes.push(b'\n');
                    return Response::builder()
                        .status(200)
                        .header("content-type", "application/json")
                        .body(BodyExt::boxed(Full::new(Bytes::from(bytes))))
                        .expect("a response");
                }
                for (version, k, line) in &s.history {
                    if *k == kind && *version > from {
                        let mut bytes = serde_json::to_vec(line).expect("JSON");
                        bytes.push(b'\n');
                        let _ = tx.send(Bytes::from(bytes));
                    }
                }
                s.watchers.push((kind, tx));
            }
            let stream = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv()
                    .await
                    .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
            });
            Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(BodyExt::boxed(StreamBody::new(stream)))
                .expect("a response")
        }
        ("GET", None) => {
            let mut s = state.lock().unwrap();
            if !metadata_only {
                s.lists += 1;
            }
            let items: Vec<Value> = s
                .objects
                .iter()
                .filter(|((k, _), _)| *k == kind)
                .map(|(_, o)| {
                    if metadata_only {
                        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": o["metadata"]})
                    } else {
                        o.clone()
                    }
                })
                .collect();
            let (api_version, list_kind) = match (metadata_only, kind) {
                (true, _) => ("meta.k8s.io/v1", "PartialObjectMetadataList"),
                (false, "dwm") => ("nvidia.com/v1alpha1", "DynamoWorkerMetadataList"),
                (false, _) => ("discovery.k8s.io/v1", "EndpointSliceList"),
            };
            full(
                200,
                json!({"apiVersion": api_version, "kind": list_kind,
                       "metadata": {"resourceVersion": s.version.to_string()}, "items": items}),
            )
        }
        ("GET", Some(name)) => match state.lock().unwrap().objects.get(&(kind, name.clone())) {
            Some(o) => full(200, o.clone()),
            None => status(404, "NotFound", &format!("\"{name}\" not found")),
        },
        ("PATCH", Some(name)) if kind == "dwm" => {
            let Ok(body) = req.into_body().collect().await else {
                return status(400, "BadRequest", "body");
            };
            let Ok(object) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
                return status(415, "UnsupportedMediaType", "JSON apply patches only");
            };
            let fault = state.lock().unwrap().fault;
            if let Some(Fault::SlowApply(held)) = fault {
                tokio::time::sleep(held).await;
            }
            let stored = state.lock().unwrap().put("dwm", &name, object);
            full(200, stored)
        }
        ("DELETE", Some(name)) if kind == "dwm" => match state.lock().unwrap().remove("dwm", &name)
        {
            Some(o) => full(200, o),
            None => status(404, "NotFound", &format!("\"{name}\" not found")),
        },
        _ => status(405, "MethodNotAllowed", "not served by this fake"),
    }
}

/// Kubelet and the EndpointSlice controller: each pod's readiness probed,
/// its slice rewritten when it changes.
async fn kubelet(state: Arc<Mutex<State>>) {
    loop {
        tokio::time::sleep(PROBE_EVERY).await;
        let pods: Vec<(String, SocketAddr)> = state
            .lock()
            .unwrap()
            .pods
            .iter()
            .map(|(n, p)| (n.clone(), p.probe))
            .collect();
        for (name, probe) in pods {
            let ready = probe_ready(probe).await;
            let mut s = state.lock().unwrap();
            let Some(pod) = s.pods.get_mut(&name) else {
                continue;
            };
            if pod.ready == ready {
                continue;
            }
            pod.ready = ready;
            let slice = State::slice(&name, pod);
            s.put("slice", &format!("{name}-slice"), slice);
        }
    }
}

/// `GET /health`: ready on 200, as a kubelet HTTP probe counts 200–399.
async fn probe_ready(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream
            .write_all(b"GET /health HTTP/1.0\r\nHost: pod\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.ok()?;
        let code: u16 = std::str::from_utf8(&head[9..12]).ok()?.parse().ok()?;
        Some((200..400).contains(&code))
    };
    tokio::time::timeout(Duration::from_secs(1), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
