//! Dynamo's `kubernetes` discovery: two workers and Dynamo 1.6.1's real
//! frontend, each with a pod of its own, registered through the fake API
//! server of [`crate::kube_api`] (which plays kubelet: a worker is routable
//! only while its Dynamo `/health` answers 200).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::kube_api::{FakeKube, Fault};
use crate::support::*;
use crate::{Backend, HANG, Setup, loss_moves_traffic_in, sigterm_drains_and_leaves_nothing};

/// A worker's loss, in this backend: its records leave its object at once,
/// its Dynamo `/health` turns 503 so its pod goes not ready, and the frontend
/// serves every later request from the other worker.
fn loss_in_kubernetes(name: &str, lose: impl FnOnce(&mut Setup), reason: &str) {
    let mut not_ready_after = None;
    let gone = loss_moves_traffic_in(
        Backend::Kube,
        name,
        |s| {
            let PodOf { name, system, .. } = s.workers[0].pod.clone().expect("a pod");
            let kube = s.store.kube();
            assert!(
                kube.pod_ready(&name),
                "kubelet found the pod ready while it served"
            );
            let lost_at = Instant::now();
            lose(s);
            wait_until(HANG, "Dynamo's /health to answer 503", || {
                llm_sidecar_loadgen::local::http_get(system, "/health", Duration::from_secs(5))
                    .is_some_and(|r| r.0 == 503)
            });
            not_ready_after = Some(lost_at.elapsed());
        },
        reason,
    );
    eprintln!(
        "{name}: object rewritten {gone:?} after the fault, /health 503 after {not_ready_after:?}"
    );
}

#[test]
fn in_kubernetes_a_killed_engine_takes_its_worker_out_of_its_object_and_its_pod_out_of_ready() {
    loss_in_kubernetes(
        "dyn-kube-killed",
        |s| s.engines[0].proc.signal("KILL"),
        "liveness stream",
    );
}

#[test]
fn in_kubernetes_an_engine_going_not_serving_takes_its_worker_out() {
    loss_in_kubernetes(
        "dyn-kube-not-serving",
        |s| s.engines[0].control("/liveness?status=2"),
        "liveness reported NOT_SERVING",
    );
}

/// SIGTERM: the request in flight finishes, the object holds none of the
/// worker's records, exit 0, and the pod went not ready on the way.
#[test]
fn in_kubernetes_sigterm_drains_and_leaves_no_record() {
    let mut s = Setup::start_in("dyn-kube-sigterm", Backend::Kube, 1, "10ms", &[], &[]);
    let pod = s.workers[0].pod.clone().expect("a pod").name;
    let kube = s.store.kube();
    let object = kube
        .object(&pod)
        .expect("the worker's DynamoWorkerMetadata");
    assert_eq!(
        object["metadata"]["ownerReferences"][0]["name"],
        pod.as_str(),
        "owned by its pod: {object}"
    );
    sigterm_drains_and_leaves_nothing(&s);
    let code = s.workers[0].proc.wait_exit(HANG);
    assert_eq!(code, 0, "log:\n{}", s.workers[0].proc.log_text());
    s.workers[0].proc.assert_withdrawn_before_exit(0);
    assert!(
        s.store.keys().is_empty(),
        "nothing left: {:?}",
        s.store.keys()
    );
    let kube = s.store.kube();
    // Kubelet's next probe finds nothing listening.
    wait_until(HANG, "the pod to go not ready", || !kube.pod_ready(&pod));
}

/// A pod deleted: the garbage collector removes its object, and the frontend
/// no longer lists the model once no worker serves it.
#[test]
fn in_kubernetes_a_deleted_pods_object_is_collected_and_its_model_leaves_the_frontend() {
    let s = Setup::start_in("dyn-kube-gc", Backend::Kube, 1, "2ms", &[], &[]);
    let pod = s.workers[0].pod.clone().expect("a pod").name;
    let kube = s.store.kube();
    kube.delete_pod(&pod);
    assert!(kube.object(&pod).is_none(), "collected with its pod");
    wait_until(HANG, "the frontend to drop the model", || {
        !s.frontend.models().contains(&s.model)
    });
}

/// Runs the worker in the `kubernetes` backend against `kube` (none: a
/// kubeconfig naming a closed port) with this environment; returns its exit
/// code and what it logged.
fn worker_alone(
    dir: &TempDir,
    kube: Option<&FakeKube>,
    env: &[(&str, &str)],
    deadline: &str,
) -> (i32, String) {
    let kubeconfig = match kube {
        Some(k) => k.kubeconfig().to_path_buf(),
        None => {
            let closed = free_addr();
            let path = dir.0.join("kubeconfig-closed");
            std::fs::write(
                &path,
                format!(
                    "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://{closed}\n\
                     users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n\
                     current-context: c\n"
                ),
            )
            .expect("kubeconfig");
            path
        }
    };
    let out = std::process::Command::new(worker_binary())
        .args([
            "--grpc-endpoint",
            &free_addr().to_string(),
            "--model-path",
            "/m",
            "--discovery-backend",
            "kubernetes",
            "--request-plane",
            "tcp",
            "--grpc-retry-interval-secs",
            "1",
            "--grpc-startup-deadline-secs",
            deadline,
        ])
        .env("KUBECONFIG", kubeconfig)
        .env_remove("POD_NAME")
        .env_remove("POD_UID")
        .env_remove("POD_NAMESPACE")
        .env_remove("DYN_KUBE_DISCOVERY_MODE")
        .env_remove("CONTAINER_NAME")
        .envs(env.iter().copied())
        .output()
        .expect("run the worker");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn in_kubernetes_a_missing_or_malformed_pod_field_exits_2_naming_it() {
    let dir = TempDir::new("dyn-kube-identity");
    let kube = FakeKube::start(&dir.0);
    for (env, named) in [
        (vec![("POD_UID", "u1")], "POD_NAME"),
        (vec![("POD_NAME", "w0")], "POD_UID"),
        (vec![("POD_NAME", "W_0"), ("POD_UID", "u1")], "POD_NAME"),
        (
            vec![
                ("POD_NAME", "w0"),
                ("POD_UID", "u1"),
                ("DYN_KUBE_DISCOVERY_MODE", "node"),
            ],
            "DYN_KUBE_DISCOVERY_MODE",
        ),
        (
            vec![
                ("POD_NAME", "w0"),
                ("POD_UID", "u1"),
                ("DYN_KUBE_DISCOVERY_MODE", "container"),
            ],
            "CONTAINER_NAME",
        ),
    ] {
        let (code, said) = worker_alone(&dir, Some(&kube), &env, "30");
        assert_eq!(code, 2, "{env:?}: {said}");
        assert!(said.contains(named), "{env:?} names {named}: {said}");
    }
    assert!(
        kube.keys().is_empty() && kube.object("w0").is_none(),
        "nothing written"
    );
}

/// An API server that forbids the calls, lacks the CRD, or is not there:
/// retried with a line that says which, then exit 3 at the start-up deadline.
#[test]
fn in_kubernetes_an_unusable_api_server_is_retried_with_the_reason_then_exits_3() {
    let dir = TempDir::new("dyn-kube-unusable");
    let kube = FakeKube::start(&dir.0);
    let pod = [("POD_NAME", "w0"), ("POD_UID", "u1")];
    for (fault, says) in [
        (Some(Fault::Forbidden), "forbids it (RBAC"),
        (
            Some(Fault::NoCrd),
            "CRD (dynamoworkermetadatas.nvidia.com) is not installed",
        ),
        (None, "unreachable"),
    ] {
        let (code, said) = match fault {
            Some(f) => {
                kube.fault(Some(f));
                worker_alone(&dir, Some(&kube), &pod, "3")
            }
            None => worker_alone(&dir, None, &pod, "3"),
        };
        assert_eq!(code, 3, "{fault:?}: {said}");
        assert!(
            said.contains("retrying") && said.contains(says),
            "{fault:?}: {said}"
        );
        assert!(
            said.contains("start-up deadline passed"),
            "{fault:?}: {said}"
        );
    }
}

/// The frontend's watches cut while a worker is lost (writes still served:
/// the object is rewritten, kubelet takes the pod out of ready), and the
/// change history compacted before the watches are back: each watch resumes
/// from a resource version the API server no longer holds, is told `410
/// Expired`, and lists again; the frontend, rebuilt from the lists, serves
/// every later request from the other worker.
#[test]
fn in_kubernetes_a_frontend_whose_watches_expired_across_a_loss_lists_again_and_routes_around_it() {
    loss_moves_traffic_in(
        Backend::Kube,
        "dyn-kube-expired",
        |s| {
            let kube = s.store.kube();
            let pod = s.workers[0].pod.clone().expect("a pod").name;
            kube.fault(Some(Fault::WatchesDown));
            s.engines[0].proc.signal("KILL");
            wait_until(HANG, "worker 0's records to leave its object", || {
                s.store.keys_of(&s.ids[0]).is_empty()
            });
            wait_until(HANG, "kubelet to take the pod out of ready", || {
                !kube.pod_ready(&pod)
            });
            let lists = kube.lists();
            kube.compact();
            kube.fault(None);
            // Both of the frontend's watches (its workers' objects, its
            // pods' EndpointSlices) are told, and both list again.
            wait_until(HANG, "the frontend's watches to be told 410", || {
                kube.expired_watches() >= 2
            });
            wait_until(HANG, "the frontend to list again", || {
                kube.lists() >= lists + 2
            });
            std::thread::sleep(Duration::from_secs(1));
        },
        "liveness stream",
    );
}

/// The API server down when the engine is lost: Dynamo's `/health` turns
/// 503 at once (kubelet takes the pod out of ready, which needs no API
/// write), the object's rewrite is retried, and once the API server is back
/// it holds none of the worker's records; exit 1.
#[test]
fn in_kubernetes_a_loss_while_the_api_server_is_down_is_withdrawn_when_it_is_back() {
    let mut s = Setup::start_in("dyn-kube-down", Backend::Kube, 1, "2ms", &[], &[]);
    let PodOf {
        name: pod, system, ..
    } = s.workers[0].pod.clone().expect("a pod");
    let kube = s.store.kube();
    assert!(!kube.keys().is_empty(), "registered");
    kube.fault(Some(Fault::Down));
    s.engines[0].proc.signal("KILL");
    wait_until(HANG, "Dynamo's /health to answer 503", || {
        llm_sidecar_loadgen::local::http_get(system, "/health", Duration::from_secs(5))
            .is_some_and(|r| r.0 == 503)
    });
    wait_until(HANG, "kubelet to take the pod out of ready", || {
        !kube.pod_ready(&pod)
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !kube.keys().is_empty(),
        "the object cannot have been rewritten while the API server was down"
    );
    let worker = &mut s.workers[0];
    worker.proc.wait_for_line("withdraw", HANG);
    kube.fault(None);
    wait_until(
        HANG,
        "the object to hold none of the worker's records",
        || kube.keys().is_empty(),
    );
    let code = worker.proc.wait_exit(HANG);
    assert_eq!(code, 1, "log:\n{}", worker.proc.log_text());
}

/// The worker's container restarted in its pod (after an engine loss, exit
/// 1): the new process registers under the same instance id (the pod name's
/// hash) with its new address, and the frontend routes to it again.
#[test]
fn in_kubernetes_a_container_restarted_in_its_pod_serves_again_under_the_same_id() {
    let mut s = Setup::start_in("dyn-kube-restart", Backend::Kube, 1, "2ms", &[], &[]);
    let pod = s.workers[0].pod.clone().expect("a pod");
    let first_id = s.ids[0].clone();
    let kube = s.store.kube();
    let first_object_uid = kube.object(&pod.name).expect("its object")["metadata"]["uid"].clone();
    s.engines[0].proc.signal("KILL");
    assert_eq!(s.workers[0].proc.wait_exit(HANG), 1);
    assert!(kube.keys().is_empty(), "withdrawn: {:?}", kube.keys());
    // The kubelet restarts both containers of the pod: a new engine (another
    // port here), a new worker process with the pod's identity and ports.
    let (engine, mut worker) = start_in_pod(&s, &pod);
    assert_eq!(worker.wait_registered(), first_id, "the same instance id");
    let object = kube.object(&pod.name).expect("its object");
    assert_eq!(
        object["metadata"]["uid"], first_object_uid,
        "the same object, rewritten"
    );
    wait_until(HANG, "the frontend to list the model again", || {
        s.frontend.models().contains(&s.model)
    });
    assert_served_by(&s, kube, &pod, &engine);
    worker.proc.stop_cleanly();
}

/// A pod lost with its node (worker and engine killed: nothing withdrawn),
/// then a pod of the same name with another uid, as a StatefulSet makes it,
/// before the garbage collector took the first pod's object: the new worker
/// has the same instance id (the pod name's hash), and the object it finds
/// still holds that id's records, owned by the first pod. It confirms its
/// registration only when its own write replaced them (the API server holds
/// each write 2 s here): never from the first incarnation's records. The
/// collector's later pass leaves the object, now the new pod's, and the
/// frontend routes to the new worker.
#[test]
fn in_kubernetes_a_second_incarnation_of_a_pod_never_takes_the_first_ones_records_for_its_own() {
    let mut s = Setup::start_in("dyn-kube-again", Backend::Kube, 1, "2ms", &[], &[]);
    let first = s.workers[0].pod.clone().expect("a pod");
    let first_id = s.ids[0].clone();
    let kube = s.store.kube();
    let owners = |object: &serde_json::Value| -> Vec<String> {
        object["metadata"]["ownerReferences"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|o| o["uid"].as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    s.workers[0].proc.signal("KILL");
    s.engines[0].proc.signal("KILL");
    s.workers[0].proc.wait_exit_or_signal(HANG);
    s.engines[0].proc.wait_exit_or_signal(HANG);
    let left = kube
        .object(&first.name)
        .expect("the first pod's object, never withdrawn");
    assert_eq!(owners(&left), vec![first.uid.clone()]);
    assert!(!kube.keys().is_empty(), "its records are still there");
    kube.remove_pod(&first.name);
    let second = s.store.new_pod(&first.name, first.system).expect("a pod");
    assert_ne!(second.uid, first.uid);
    kube.fault(Some(Fault::SlowApply(Duration::from_secs(2))));
    let (engine, mut worker) = start_in_pod(&s, &second);
    assert_eq!(worker.wait_registered(), first_id, "the same instance id");
    let object = kube.object(&first.name).expect("its object");
    assert_eq!(
        owners(&object),
        vec![second.uid.clone()],
        "registered only once its own write replaced the first pod's records"
    );
    kube.fault(None);
    kube.collect_garbage();
    assert!(
        kube.object(&first.name).is_some(),
        "the collector leaves the object of a pod that exists"
    );
    assert_served_by(&s, kube, &second, &engine);
    worker.proc.stop_cleanly();
}

/// The kubelet starting both containers of `pod`: a new engine (another port
/// here), a new worker process with the pod's identity and ports.
fn start_in_pod(s: &Setup, pod: &PodOf) -> (Engine, Worker) {
    let engine = Engine::start(&s._dir.0, "2ms");
    let worker = Worker::spawn_in(
        &[],
        &s._dir.0,
        &s.store,
        &engine,
        std::path::Path::new(&s.model),
        &["--router-grace".to_string(), "1s".to_string()],
        &[],
        Some(pod.clone()),
    );
    (engine, worker)
}

/// Kubelet finds `pod` ready, and the frontend serves a request there, by
/// `engine`.
fn assert_served_by(s: &Setup, kube: &FakeKube, pod: &PodOf, engine: &Engine) {
    wait_until(HANG, "kubelet to find the pod ready", || {
        kube.pod_ready(&pod.name)
    });
    let served = (0..50).any(|_| {
        let (status, _) = s
            .frontend
            .post("/v1/completions", &completion(&s.model, "w22", 2, false));
        if status != 200 {
            std::thread::sleep(Duration::from_millis(100));
        }
        status == 200
    });
    assert!(served, "served");
    assert!(
        engine.stats()["generate_started"].as_u64() > Some(0),
        "by the pod's engine"
    );
}

/// What an engine's SIGKILL looked like in Kubernetes discovery, from the
/// fault: when the worker's records left its object, when its Dynamo
/// `/health` answered 503, when kubelet took its pod out of ready (each
/// `None` if not within [`WATCHED`]); then the statuses of 20 requests sent
/// after that.
struct KillSeen {
    records_gone: Option<Duration>,
    health_503: Option<Duration>,
    not_ready: Option<Duration>,
    statuses: BTreeMap<u16, u32>,
}

/// How long a SIGKILL's effects are watched for.
const WATCHED: Duration = Duration::from_secs(5);

/// Two engines and two workers started by `under` (`&[]`: ours, with
/// exactly Dynamo's sidecar's arguments; [`DYNAMOS_OWN_SIDECAR`]: Dynamo's),
/// each in a pod of its own; both serve; engine 0 is SIGKILLed.
fn sigkill_seen_in_kubernetes(name: &str, under: &[&str]) -> KillSeen {
    let mut s = Setup::start_in(name, Backend::Kube, 0, "2ms", &[], &[]);
    let model = std::path::PathBuf::from(&s.model);
    for _ in 0..2 {
        let engine = Engine::start(&s._dir.0, "2ms");
        let worker = Worker::spawn(under, &s._dir.0, &s.store, &engine, &model, &[], &[]);
        s.engines.push(engine);
        s.workers.push(worker);
    }
    let kube = s.store.kube();
    let pods: Vec<PodOf> = s
        .workers
        .iter()
        .map(|w| w.pod.clone().expect("a pod"))
        .collect();
    let records = |pod: &PodOf| {
        kube.object(&pod.name)
            .and_then(|o| o["spec"]["data"]["endpoints"].as_object().map(|e| e.len()))
            .unwrap_or(0)
    };
    wait_until(HANG, "both workers' records, both pods ready", || {
        pods.iter()
            .all(|p| records(p) > 0 && kube.pod_ready(&p.name))
    });
    wait_until(HANG, "the frontend to list the model", || {
        s.frontend.models().contains(&s.model)
    });
    s.serve_from_every_engine();

    let killed = Instant::now();
    s.engines[0].proc.signal("KILL");
    let (mut records_gone, mut health_503, mut not_ready) = (None, None, None);
    while killed.elapsed() < WATCHED {
        let at = Some(killed.elapsed());
        if records_gone.is_none() && records(&pods[0]) == 0 {
            records_gone = at;
        }
        if health_503.is_none()
            && llm_sidecar_loadgen::local::http_get(
                pods[0].system,
                "/health",
                Duration::from_secs(1),
            )
            .is_some_and(|r| r.0 == 503)
        {
            health_503 = at;
        }
        if not_ready.is_none() && !kube.pod_ready(&pods[0].name) {
            not_ready = at;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut statuses = BTreeMap::new();
    for _ in 0..20 {
        let (status, _) = s.frontend.post(
            "/v1/completions",
            &completion(&s.model, "w20 w21", 4, false),
        );
        *statuses.entry(status).or_insert(0) += 1;
    }
    KillSeen {
        records_gone,
        health_503,
        not_ready,
        statuses,
    }
}

/// The peer baseline, side by side: the same pods, the same fake API
/// server and Dynamo 1.6.1's real frontend, first with this worker, then
/// with Dynamo's own TensorRT-LLM sidecar given the same arguments. Both
/// register through the fake API server and serve (Dynamo's own runtime
/// writing to it is a check of the fake too); after the engine's SIGKILL
/// this worker leaves (records out, `/health` 503, pod not ready) and every
/// later request is served. What Dynamo's sidecar does is printed, not
/// asserted: it is the baseline, not the product.
#[test]
fn in_kubernetes_an_engine_sigkill_beside_dynamos_own_sidecar() {
    let ours = sigkill_seen_in_kubernetes("dyn-kube-peer-ours", &[]);
    let theirs = sigkill_seen_in_kubernetes("dyn-kube-peer-dynamo", DYNAMOS_OWN_SIDECAR);
    for (who, seen) in [("llm-sidecar-dynamo", &ours), ("Dynamo's sidecar", &theirs)] {
        eprintln!(
            "engine SIGKILL in Kubernetes, {who}: records out {:?}, /health 503 {:?}, \
             pod not ready {:?} (None: not within {WATCHED:?}); 20 requests after: {:?}",
            seen.records_gone, seen.health_503, seen.not_ready, seen.statuses
        );
    }
    assert!(ours.records_gone.is_some(), "our records left the object");
    assert!(ours.health_503.is_some(), "our /health answered 503");
    assert!(ours.not_ready.is_some(), "our pod went not ready");
    assert_eq!(
        ours.statuses,
        BTreeMap::from([(200, 20)]),
        "every request after our worker left was served"
    );
}
