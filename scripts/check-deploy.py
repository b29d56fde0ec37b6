#!/usr/bin/env python3
"""Checks deploy/ against the binary it deploys and the engines it starts.

For every rendered Kubernetes overlay (`kubectl kustomize
deploy/kubernetes/overlays/<kind>`, one file per kind) and the systemd unit:
- every llm-sidecar flag it passes exists (read from `llm-sidecar run --help`);
- the stop budget fits: --router-grace + --drain-timeout (the binary's
  defaults when a flag is absent) + the exit bound (CONNECTIONS_CLOSE in
  io/src/exit_bounds.rs) + the engine's own stop grace (5 s, every kind), plus
  5 s of margin, within terminationGracePeriodSeconds (TimeoutStopSec for the
  unit, where the engine is a unit of its own and stops after);
- the pieces agree: the engine probe asks the kind and address the sidecar
  follows, the readiness probe asks the sidecar's --listen port, the HTTP
  probes reach an --admin-listen that is not loopback; the binary is copied
  (init container sidecar-binary) before the engine starts;
- the engine side matches ENGINES below: the image is one that serves the API
  the kind follows, at or above the version that has it, and the engine's
  command uses only flags this table knows for that program.

The Dynamo worker (`kubectl kustomize deploy/kubernetes/dynamo`, checked with
--dynamo): its flags exist (`llm-sidecar-dynamo --help`), the stop budget fits
the same way, the Role grants exactly what Dynamo's kubernetes discovery calls,
the pod's identity comes from the downward API, readiness is Dynamo's /health
on DYN_SYSTEM_PORT, and the Service carries the discovery labels and no
publishNotReadyAddresses.

usage: check-deploy.py <llm-sidecar binary> <rendered>.yaml ...   (exit 1 on any finding)
       check-deploy.py --dynamo <llm-sidecar-dynamo binary> <rendered>.yaml
       check-deploy.py --self-test <llm-sidecar binary> <rendered>.yaml ...
         (each way a manifest can go wrong, made on purpose: every one must be found)
"""
import copy
import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINE_STOP_GRACE = 5.0  # every engine's server.stop(grace=5)
MARGIN = 5.0
findings = []

# The engine side, per kind: the image that serves the API the kind follows,
# the oldest version that serves it, the program and the flags it must be
# started with, and every flag of that program a manifest may use. Each fact
# names its source (read with the search tools, late 2026; docs/ENGINES.md).
ENGINES = {
    "trtllm": {
        # `trtllm-serve --grpc` serves trtllm.TrtllmService: TensorRT-LLM PR
        # #11037 (January 2026, no 1.2.x release); first good image 1.3.0rc21,
        # rc22 broken (NVIDIA Dynamo's TensorRT-LLM sidecar README).
        "repository": "nvcr.io/nvidia/tensorrt-llm/release",
        "minimum": "1.3.0rc21",
        "broken": {"1.3.0rc22"},
        "program": ["trtllm-serve"],
        "needs": [["--grpc"]],
        "refuses": [["--grpc-protocol", "openengine"]],
        "flags": {"--host", "--port", "--grpc", "--grpc-protocol", "--backend", "--tp_size",
                  "--pp_size", "--ep_size", "--max_batch_size", "--max_num_tokens",
                  "--max_seq_len", "--kv_cache_free_gpu_memory_fraction",
                  "--trust_remote_code", "--extra_llm_api_options", "--tokenizer"},
    },
    "openengine": {
        # `--grpc --grpc-protocol openengine`: TensorRT-LLM PR #17084 (July 2026),
        # its RPCs PR #17992 (merged 2026-08-20), extra tensorrt_llm[openengine].
        # No published release image ships it (Dynamo's sidecar README): an
        # image built from main, never nvcr.io's release images.
        "repository": None,
        "not_repository": "nvcr.io/nvidia/tensorrt-llm/release",
        "program": ["trtllm-serve"],
        "needs": [["--grpc"], ["--grpc-protocol", "openengine"]],
        "refuses": [],
        "flags": {"--host", "--port", "--grpc", "--grpc-protocol", "--backend", "--tp_size",
                  "--pp_size", "--ep_size", "--max_batch_size", "--max_num_tokens",
                  "--max_seq_len", "--kv_cache_free_gpu_memory_fraction",
                  "--trust_remote_code", "--extra_llm_api_options", "--tokenizer"},
    },
    "vllm": {
        # `vllm serve --grpc`: vLLM PR #36169 (March 2026; v0.17.0's image has no
        # gRPC, smg PR #843), which imports smg-grpc-servicer; GetLoads from smg
        # PR #1630 (June 2026; 0.14.1 has it). Stock images lack the servicer:
        # deploy/engines/vllm.Containerfile adds it; the tag names both versions.
        "repository": None,
        "not_repository": "vllm/vllm-openai",
        "containerfile": "deploy/engines/vllm.Containerfile",
        "minimum": "0.18.0",
        "servicer_minimum": "0.14.1",
        "program": ["vllm", "serve"],
        "needs": [["--grpc"]],
        "refuses": [],
        "flags": {"--host", "--port", "--grpc", "--served-model-name", "--tensor-parallel-size",
                  "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs",
                  "--dtype", "--trust-remote-code", "--tokenizer"},
    },
    "vllm-native": {
        # `vllm-rs serve <model> --grpc-port N`: vLLM's Rust frontend
        # (vllm.Inference, vllm.Control, tonic-health). The stock image ships
        # the binary inside the vllm package, off PATH (NVIDIA Dynamo's vLLM
        # sidecar README and deploy/agg.yaml, which run v0.26.0): a shell
        # resolves it.
        "repository": "vllm/vllm-openai",
        "minimum": "0.26.0",
        "broken": set(),
        "program": ["/bin/sh", "-c"],
        "script": ["vllm-rs", "serve"],
        "needs": [["--grpc-port"]],
        "refuses": [],
        "flags": {"--host", "--port", "--grpc-port", "--served-model-name",
                  "--tensor-parallel-size", "--max-model-len", "--gpu-memory-utilization"},
    },
    "sglang-native": {
        # `--grpc-port N` starts the native server (sglang.runtime.v1.SglangService)
        # beside HTTP, from v0.5.16 (NVIDIA Dynamo's SGLang sidecar README).
        "repository": "lmsysorg/sglang",
        "minimum": "0.5.16",
        "broken": set(),
        "program": ["python3", "-m", "sglang.launch_server"],
        "needs": [["--grpc-port"]],
        "refuses": [["--grpc-mode"]],
        "flags": {"--model-path", "--host", "--port", "--grpc-port", "--served-model-name",
                  "--tp-size", "--dp-size", "--context-length", "--mem-fraction-static",
                  "--trust-remote-code", "--tokenizer-path"},
    },
    "sglang": {
        # `--grpc-mode` serves sglang.grpc.scheduler.SglangScheduler (sglang PR
        # #11564); GetLoads from sglang PR #17087 (January 2026): v0.5.6 and
        # older lack it.
        "repository": "lmsysorg/sglang",
        "minimum": "0.5.7",
        "broken": set(),
        "program": ["python3", "-m", "sglang.launch_server"],
        "needs": [["--grpc-mode"]],
        "refuses": [["--grpc-port"]],
        "flags": {"--model-path", "--host", "--port", "--grpc-mode", "--served-model-name",
                  "--tp-size", "--dp-size", "--context-length", "--mem-fraction-static",
                  "--trust-remote-code", "--tokenizer-path"},
    },
}


def seconds(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    return float(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m[2]]


def run_help(binary):
    text = subprocess.run([binary, "run", "--help"], check=True, capture_output=True,
                          text=True).stdout
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", text, re.M))
    defaults = {}
    for flag in ("--router-grace", "--drain-timeout"):
        block = text.split(f"  {flag} ", 1)[1]
        defaults[flag] = seconds(re.search(r"\[default: ([^\]]+)\]", block)[1])
    return flags, defaults


def exit_bound():
    src = (ROOT / "io/src/exit_bounds.rs").read_text()
    return float(re.search(r"CONNECTIONS_CLOSE: Duration = Duration::from_secs\((\d+)\)", src)[1])


def parse_args(args):
    """`run --a=b --c d` → {'--a': 'b', '--c': 'd'}"""
    out, i = {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a.split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                k, v = a, args[i + 1]
                i += 1
            else:
                k, v = a, ""
            out[k] = v
        i += 1
    return out


def version_key(text):
    """`v1.3.0rc21` → comparable; a release sorts after its release candidates."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?(?:[-.].*)?", text)
    if not m:
        return None
    rc = int(m[4]) if m[4] is not None else 1 << 30
    return (int(m[1]), int(m[2]), int(m[3]), rc)


def split_image(image):
    repository, _, tag = image.rpartition(":")
    if "/" in tag or not repository:
        return image, ""
    return repository.removeprefix("docker.io/"), tag


def contains(words, seq):
    return any(words[i:i + len(seq)] == seq for i in range(len(words) - len(seq) + 1))


def at_least(where, what, version, minimum):
    key = version_key(version)
    if key is None:
        findings.append(f"{where}: {what} version {version!r} is not a version check-deploy reads")
    elif key < version_key(minimum):
        findings.append(f"{where}: {what} {version} is older than {minimum}, the first that serves "
                        f"the API this kind follows")


def check_engine(where, kind, engine):
    spec = ENGINES.get(kind)
    if spec is None:
        findings.append(f"{where}: no engine table row for kind {kind}")
        return
    image = engine.get("image", "")
    repository, tag = split_image(image)
    if spec.get("repository"):
        if repository != spec["repository"]:
            findings.append(f"{where}: engine image {image} is not {spec['repository']}")
        else:
            at_least(where, "engine image", tag, spec["minimum"])
            if tag in spec["broken"]:
                findings.append(f"{where}: engine image {image} is a known broken release")
    if spec.get("not_repository") and repository == spec["not_repository"]:
        findings.append(f"{where}: engine image {image}: no {spec['not_repository']} image serves "
                        f"this kind's API as shipped (see the engine table in check-deploy.py)")
    if spec.get("containerfile"):
        text = (ROOT / spec["containerfile"]).read_text()
        base = re.search(r"^FROM\s+(\S+)", text, re.M)[1]
        _, base_tag = split_image(base)
        servicer = re.search(r"smg-grpc-servicer\[vllm\]==([\w.]+)", text)
        at_least(spec["containerfile"], "vLLM base image", base_tag, spec["minimum"])
        if not servicer:
            findings.append(f"{spec['containerfile']}: smg-grpc-servicer[vllm] is not pinned")
        else:
            at_least(spec["containerfile"], "smg-grpc-servicer", servicer[1], spec["servicer_minimum"])
            if tag != f"{base_tag}-smg{servicer[1]}":
                findings.append(f"{where}: engine image tag {tag!r} does not name what "
                                f"{spec['containerfile']} builds ({base_tag}-smg{servicer[1]})")
    command = engine.get("command", []) + engine.get("args", [])
    program = spec["program"]
    if command[:len(program)] != program:
        findings.append(f"{where}: the engine runs {command[:len(program)]}, not {program}")
    if spec.get("script"):
        # A shell script: its words are what the checks below read.
        script = " ".join(command[len(program):])
        for word in spec["script"]:
            if word not in script.split() and not re.search(rf"\b{re.escape(word)}\b", script):
                findings.append(f"{where}: the engine's script does not run {word}")
        command = program + script.split()
    for need in spec["needs"]:
        if not contains(command, need):
            findings.append(f"{where}: the engine command lacks {' '.join(need)}")
    for refuse in spec["refuses"]:
        if contains(command, refuse):
            findings.append(f"{where}: the engine command has {' '.join(refuse)}, another kind's API")
    for word in command[len(program):]:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in spec["flags"]:
            findings.append(f"{where}: engine flag {flag} is not one check-deploy knows for "
                            f"{' '.join(program)} (add it to ENGINES with its source)")


def port(addr):
    return int(addr.rsplit(":", 1)[1])


def check_flags(where, flags, known):
    for f in flags:
        if f not in known:
            findings.append(f"{where}: llm-sidecar run has no flag {f}")


def budget(flags, defaults):
    grace = seconds(flags["--router-grace"]) if "--router-grace" in flags else defaults["--router-grace"]
    drain = seconds(flags["--drain-timeout"]) if "--drain-timeout" in flags else defaults["--drain-timeout"]
    return grace + drain + exit_bound()


def check_manifest(path, docs, known, defaults):
    name = path.name
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    if len(deployments) != 1:
        findings.append(f"{name}: expected one Deployment, found {len(deployments)}")
        return
    if not any(d["kind"] == "PodDisruptionBudget" for d in docs):
        findings.append(f"{name}: no PodDisruptionBudget")
    pod = deployments[0]["spec"]["template"]["spec"]
    annotations = deployments[0]["spec"]["template"]["metadata"].get("annotations", {})
    sidecar = next(c for c in pod["containers"] if c["name"] == "llm-sidecar")
    args = sidecar["args"]
    if args[0] != "run":
        findings.append(f"{name}: the main container does not `run`")
    flags = parse_args(args[1:])
    check_flags(name, flags, known)
    # Flags given through the environment (SIDECAR_<FLAG>), as the overlays
    # give --engine-kind.
    for env in sidecar.get("env", []):
        if env["name"].startswith("SIDECAR_") and "value" in env:
            flag = "--" + env["name"].removeprefix("SIDECAR_").lower().replace("_", "-")
            if flag in flags:
                findings.append(f"{name}: {flag} given both as a flag and as {env['name']}")
            flags[flag] = env["value"]
            check_flags(name, {flag: env["value"]}, known)

    need = budget(flags, defaults) + ENGINE_STOP_GRACE + MARGIN
    have = pod.get("terminationGracePeriodSeconds", 30)
    if have < need:
        findings.append(f"{name}: terminationGracePeriodSeconds {have} < {need:g} "
                        f"(router grace + drain + exit bound + engine stop 5 s + margin 5 s)")

    kind = path.stem
    if flags.get("--engine-kind") != kind:
        findings.append(f"{name}: --engine-kind is {flags.get('--engine-kind')}, not {kind}")
    inits = [c["name"] for c in pod.get("initContainers", [])]
    engine = next((c for c in pod.get("initContainers", []) if c["name"] == "engine"), None)
    if engine is None or engine.get("restartPolicy") != "Always":
        findings.append(f"{name}: the engine is not a native sidecar (init container, restartPolicy Always)")
        return
    if "sidecar-binary" not in inits or inits.index("sidecar-binary") > inits.index("engine"):
        findings.append(f"{name}: init containers {inits}: sidecar-binary must run before the "
                        f"engine, whose probes run the binary it copies")
    check_engine(name, kind, engine)
    admin_port = str(port(flags.get("--admin-listen", "127.0.0.1:9090")))
    if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/port") != admin_port:
        findings.append(f"{name}: the pod is not annotated for scraping /metrics on the admin port {admin_port}")
    for probe in ("startupProbe", "livenessProbe"):
        cmd = engine.get(probe, {}).get("exec", {}).get("command", [])
        if "probe" not in cmd:
            findings.append(f"{name}: engine {probe} is not `llm-sidecar probe`")
            continue
        p = parse_args(cmd[cmd.index("probe") + 1:])
        if p.get("--engine") != flags.get("--engine-endpoint"):
            findings.append(f"{name}: engine {probe} asks {p.get('--engine')}, the sidecar follows {flags.get('--engine-endpoint')}")
        if p.get("--engine-kind") != kind:
            findings.append(f"{name}: engine {probe} asks kind {p.get('--engine-kind')}")
        timeout = seconds(p.get("--timeout", "1s"))
        if timeout >= engine[probe].get("timeoutSeconds", 1):
            findings.append(f"{name}: engine {probe}: --timeout {timeout:g}s is not under timeoutSeconds")

    ready = sidecar.get("readinessProbe", {}).get("grpc")
    if not ready or ready["port"] != port(flags["--listen"]):
        findings.append(f"{name}: readiness is not a grpc probe on the --listen port")
    admin = flags.get("--admin-listen", "127.0.0.1:9090")
    if admin.startswith("127.") or admin.startswith("localhost"):
        findings.append(f"{name}: --admin-listen {admin} is loopback; the kubelet's HTTP probes reach the pod IP")
    named = {p["name"]: p["containerPort"] for p in sidecar.get("ports", [])}
    for probe in ("startupProbe", "livenessProbe"):
        get = sidecar.get(probe, {}).get("httpGet")
        if not get or get["path"] != "/live":
            findings.append(f"{name}: sidecar {probe} is not GET /live")
            continue
        p = named.get(get["port"], get["port"])
        if p != port(admin):
            findings.append(f"{name}: sidecar {probe} port {p} is not --admin-listen's {port(admin)}")


def check_unit(path, known, defaults):
    text = path.read_text()
    exec_start = re.search(r"^ExecStart=(.*?)(?<!\\)$", text, re.M | re.S)[1]
    words = exec_start.replace("\\\n", " ").split()
    flags = parse_args(words[words.index("run") + 1:])
    check_flags(path.name, flags, known)
    need = budget(flags, defaults) + MARGIN
    have = seconds(re.search(r"^TimeoutStopSec=(\S+)", text, re.M)[1])
    if have < need:
        findings.append(f"{path.name}: TimeoutStopSec {have:g}s < {need:g}s (router grace + drain + exit bound + margin)")
    if not re.search(r"^RestartPreventExitStatus=.*\b2\b", text, re.M):
        findings.append(f"{path.name}: exit 2 (bad flags) should not be restarted")


def load(paths):
    return {pathlib.Path(p): [d for d in yaml.safe_load_all(pathlib.Path(p).read_text()) if d]
            for p in paths}


def engine_of(docs):
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return next(c for c in deployment["spec"]["template"]["spec"]["initContainers"]
                if c["name"] == "engine")


# Each way a manifest can go wrong on the engine side, made on purpose:
# (kind, what was done, the change). Every one must give a finding.
def _set_image(image):
    return lambda docs: engine_of(docs).__setitem__("image", image)


def _drop(words):
    def change(docs):
        engine = engine_of(docs)
        command = engine["command"]
        for i in range(len(command) - len(words) + 1):
            if command[i:i + len(words)] == words:
                del command[i:i + len(words)]
                return
    return change


def _add(words):
    return lambda docs: engine_of(docs)["command"].extend(words)


def _engine_first(docs):
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["initContainers"].sort(key=lambda c: c["name"] != "engine")


BREAKAGES = [
    ("trtllm", "the engine started before the binary its probes run is copied", _engine_first),
    ("trtllm", "TensorRT-LLM 1.2.0, before trtllm-serve --grpc", _set_image("nvcr.io/nvidia/tensorrt-llm/release:1.2.0")),
    ("trtllm", "TensorRT-LLM 1.3.0rc22, known broken", _set_image("nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc22")),
    ("trtllm", "--grpc dropped", _drop(["--grpc"])),
    ("trtllm", "--grpc-protocol openengine added", _add(["--grpc-protocol", "openengine"])),
    ("openengine", "--grpc-protocol openengine dropped", _drop(["--grpc-protocol", "openengine"])),
    ("openengine", "a published release image", _set_image("nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc21")),
    ("vllm", "vllm/vllm-openai:v0.12.0, before vllm serve --grpc", _set_image("vllm/vllm-openai:v0.12.0")),
    ("vllm", "a tag that is not what the Containerfile builds", _set_image("registry.example.com/vllm-grpc:v0.12.0-smg0.4.2")),
    ("vllm", "--grpc dropped", _drop(["--grpc"])),
    ("sglang", "lmsysorg/sglang:v0.5.6, before GetLoads", _set_image("lmsysorg/sglang:v0.5.6")),
    ("sglang", "--grpc-mode dropped", _drop(["--grpc-mode"])),
    ("sglang", "an engine flag nobody knows", _add(["--frobnicate", "1"])),
    ("sglang-native", "lmsysorg/sglang:v0.5.6, before --grpc-port", _set_image("lmsysorg/sglang:v0.5.6")),
    ("sglang-native", "--grpc-port dropped", _drop(["--grpc-port", "50051"])),
    ("vllm-native", "vllm/vllm-openai:v0.12.0, before vllm-rs", _set_image("vllm/vllm-openai:v0.12.0")),
    ("vllm-native", "a script that does not run vllm-rs", lambda docs: engine_of(docs)["command"].__setitem__(2, "exec vllm serve /models/model --grpc")),
]


def self_test(known, defaults, rendered):
    global findings
    by_kind = {p.stem: (p, docs) for p, docs in rendered.items()}
    missed = []
    for kind, what, change in BREAKAGES:
        path, docs = by_kind[kind]
        broken = copy.deepcopy(docs)
        change(broken)
        findings = []
        check_manifest(path, broken, known, defaults)
        print(f"check-deploy --self-test: {kind}, {what}: "
              f"{findings[0] if findings else 'NOT FOUND'}")
        if not findings:
            missed.append(f"{kind}: {what}")
    findings = missed
    return missed


# What Dynamo 1.6.1's kubernetes discovery calls (docs/DYNAMO.md), as Role rules.
DYNAMO_RULES = {
    ("nvidia.com", "dynamoworkermetadatas"): {"create", "get", "list", "watch", "update", "patch",
                                              "delete"},
    ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "endpoints"): {"get", "list", "watch"},
}


def check_dynamo(binary, path):
    """The Dynamo worker's rendered manifest (see the module's docstring)."""
    text = subprocess.run([binary, "--help"], check=True, capture_output=True, text=True).stdout
    known = set(re.findall(r"^\s+(?:-[a-zA-Z], )?(--[a-z0-9-]+)", text, re.M))
    docs = [d for d in yaml.safe_load_all(pathlib.Path(path).read_text()) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    where = f"{path}"
    rules = {}
    for role in by_kind.get("Role", []):
        for r in role["rules"]:
            for g in r["apiGroups"]:
                for res in r["resources"]:
                    rules.setdefault((g, res), set()).update(r["verbs"])
    if rules != DYNAMO_RULES:
        findings.append(f"{where}: Role grants {rules}, Dynamo's kubernetes discovery needs {DYNAMO_RULES}")
    for svc in by_kind.get("Service", []):
        labels = svc["metadata"].get("labels", {})
        if labels.get("nvidia.com/dynamo-discovery-backend") != "kubernetes" or \
                labels.get("nvidia.com/dynamo-discovery-enabled") != "true":
            findings.append(f"{where}: Service {svc['metadata']['name']} lacks the discovery labels")
        if svc["spec"].get("publishNotReadyAddresses"):
            findings.append(f"{where}: Service {svc['metadata']['name']} publishes not-ready addresses")
    for dep in by_kind.get("Deployment", []):
        pod = dep["spec"]["template"]["spec"]
        main = next((c for c in pod["containers"] if "--grpc-endpoint" in " ".join(c.get("args", []))), None)
        if main is None:
            findings.append(f"{where}: no container runs llm-sidecar-dynamo (--grpc-endpoint)")
            continue
        args = parse_args(main.get("args", []))
        for flag in args:
            if flag not in known:
                findings.append(f"{where}: {flag} is not a flag of llm-sidecar-dynamo")
        env = {e["name"]: e for e in main.get("env", [])}
        if env.get("DYN_DISCOVERY_BACKEND", {}).get("value") != "kubernetes":
            findings.append(f"{where}: DYN_DISCOVERY_BACKEND is not kubernetes")
        for var, field in (("POD_NAME", "metadata.name"), ("POD_UID", "metadata.uid"),
                           ("POD_NAMESPACE", "metadata.namespace")):
            got = env.get(var, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if got != field:
                findings.append(f"{where}: {var} must come from the downward API ({field}), not {got}")
        port = env.get("DYN_SYSTEM_PORT", {}).get("value")
        ports = {p["name"]: str(p["containerPort"]) for p in main.get("ports", [])}
        probe = main.get("readinessProbe", {}).get("httpGet", {})
        if probe.get("path") != "/health" or ports.get(probe.get("port"), str(probe.get("port"))) != port:
            findings.append(f"{where}: readiness must be Dynamo's /health on DYN_SYSTEM_PORT ({port})")
        if pod.get("serviceAccountName") not in {r["metadata"]["name"] for r in by_kind.get("ServiceAccount", [])}:
            findings.append(f"{where}: the pod runs under no ServiceAccount of this manifest")
        budget = seconds(args.get("--router-grace", "5s")) + seconds(args.get("--drain-timeout", "30s")) \
            + exit_bound() + ENGINE_STOP_GRACE + MARGIN
        if pod.get("terminationGracePeriodSeconds", 30) < budget:
            findings.append(f"{where}: terminationGracePeriodSeconds below the stop budget {budget}s")
    for f in findings:
        print(f"check-deploy: {f}", file=sys.stderr)
    print(f"check-deploy --dynamo: {path}: {'ok' if not findings else f'{len(findings)} finding(s)'}")
    sys.exit(1 if findings else 0)


def main():
    args = sys.argv[1:]
    if args[:1] == ["--dynamo"]:
        check_dynamo(args[1], args[2])
    testing = args[:1] == ["--self-test"]
    if testing:
        args = args[1:]
    binary, paths = args[0], args[1:]
    known, defaults = run_help(binary)
    rendered = load(paths)
    overlays = {p.name for p in (ROOT / "deploy/kubernetes/overlays").iterdir() if p.is_dir()}
    kinds = {p.stem for p in rendered}
    if overlays != set(ENGINES) or kinds != set(ENGINES):
        findings.append(f"deploy/kubernetes: overlays {sorted(overlays)}, rendered {sorted(kinds)}; "
                        f"want one per engine kind {sorted(ENGINES)}")
    if testing:
        missed = self_test(known, defaults, rendered)
        print(f"check-deploy --self-test: {len(BREAKAGES) - len(missed)} of {len(BREAKAGES)} "
              f"breakages found")
        sys.exit(1 if missed or findings else 0)
    for path, docs in rendered.items():
        check_manifest(path, docs, known, defaults)
    for unit in sorted((ROOT / "deploy/systemd").glob("*.service")):
        check_unit(unit, known, defaults)
    for f in findings:
        print(f"check-deploy: {f}", file=sys.stderr)
    print(f"check-deploy: {len(rendered)} rendered overlays, "
          f"{len(list((ROOT / 'deploy/systemd').glob('*.service')))} unit(s): "
          f"{'ok' if not findings else f'{len(findings)} finding(s)'}")
    sys.exit(1 if findings else 0)


main()
