#!/usr/bin/env python3
"""Checks deploy/ against the binary it deploys.

For every Kubernetes manifest in deploy/kubernetes/ and the systemd unit:
- every llm-sidecar flag it passes exists (read from `llm-sidecar run --help`);
- the stop budget fits: --router-grace + --drain-timeout (the binary's
  defaults when a flag is absent) + the exit bound (CONNECTIONS_CLOSE in
  io/src/exit_bounds.rs) + the engine's own stop grace (5 s, every kind), plus
  5 s of margin, within terminationGracePeriodSeconds (TimeoutStopSec for the
  unit, where the engine is a unit of its own and stops after);
- the pieces agree: the engine probe asks the kind and address the sidecar
  follows, the readiness probe asks the sidecar's --listen port, the HTTP
  probes reach an --admin-listen that is not loopback.

usage: check-deploy.py <llm-sidecar binary>      (exit 1 on any finding)
"""
import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINE_STOP_GRACE = 5.0  # every engine's server.stop(grace=5)
MARGIN = 5.0
findings = []


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


def check_manifest(path, known, defaults):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    if len(deployments) != 1:
        findings.append(f"{path.name}: expected one Deployment, found {len(deployments)}")
        return
    pod = deployments[0]["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["containers"] if c["name"] == "llm-sidecar")
    args = sidecar["args"]
    if args[0] != "run":
        findings.append(f"{path.name}: the main container does not `run`")
    flags = parse_args(args[1:])
    check_flags(path.name, flags, known)

    need = budget(flags, defaults) + ENGINE_STOP_GRACE + MARGIN
    have = pod.get("terminationGracePeriodSeconds", 30)
    if have < need:
        findings.append(f"{path.name}: terminationGracePeriodSeconds {have} < {need:g} "
                        f"(router grace + drain + exit bound + engine stop 5 s + margin 5 s)")

    kind = path.stem
    if flags.get("--engine-kind") != kind:
        findings.append(f"{path.name}: --engine-kind is {flags.get('--engine-kind')}, not {kind}")
    engine = next((c for c in pod.get("initContainers", []) if c["name"] == "engine"), None)
    if engine is None or engine.get("restartPolicy") != "Always":
        findings.append(f"{path.name}: the engine is not a native sidecar (init container, restartPolicy Always)")
        return
    for probe in ("startupProbe", "livenessProbe"):
        cmd = engine.get(probe, {}).get("exec", {}).get("command", [])
        if "probe" not in cmd:
            findings.append(f"{path.name}: engine {probe} is not `llm-sidecar probe`")
            continue
        p = parse_args(cmd[cmd.index("probe") + 1:])
        if p.get("--engine") != flags.get("--engine-endpoint"):
            findings.append(f"{path.name}: engine {probe} asks {p.get('--engine')}, the sidecar follows {flags.get('--engine-endpoint')}")
        if p.get("--engine-kind") != kind:
            findings.append(f"{path.name}: engine {probe} asks kind {p.get('--engine-kind')}")
        timeout = seconds(p.get("--timeout", "1s"))
        if timeout >= engine[probe].get("timeoutSeconds", 1):
            findings.append(f"{path.name}: engine {probe}: --timeout {timeout:g}s is not under timeoutSeconds")

    ready = sidecar.get("readinessProbe", {}).get("grpc")
    if not ready or ready["port"] != port(flags["--listen"]):
        findings.append(f"{path.name}: readiness is not a grpc probe on the --listen port")
    admin = flags.get("--admin-listen", "127.0.0.1:9090")
    if admin.startswith("127.") or admin.startswith("localhost"):
        findings.append(f"{path.name}: --admin-listen {admin} is loopback; the kubelet's HTTP probes reach the pod IP")
    named = {p["name"]: p["containerPort"] for p in sidecar.get("ports", [])}
    for probe in ("startupProbe", "livenessProbe"):
        get = sidecar.get(probe, {}).get("httpGet")
        if not get or get["path"] != "/live":
            findings.append(f"{path.name}: sidecar {probe} is not GET /live")
            continue
        p = named.get(get["port"], get["port"])
        if p != port(admin):
            findings.append(f"{path.name}: sidecar {probe} port {p} is not --admin-listen's {port(admin)}")


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


def main():
    binary = sys.argv[1]
    known, defaults = run_help(binary)
    manifests = sorted((ROOT / "deploy/kubernetes").glob("*.yaml"))
    kinds = {p.stem for p in manifests}
    if kinds != {"trtllm", "openengine", "vllm", "sglang"}:
        findings.append(f"deploy/kubernetes: manifests for {sorted(kinds)}, want one per engine kind")
    for m in manifests:
        check_manifest(m, known, defaults)
    for unit in sorted((ROOT / "deploy/systemd").glob("*.service")):
        check_unit(unit, known, defaults)
    for f in findings:
        print(f"check-deploy: {f}", file=sys.stderr)
    print(f"check-deploy: {len(manifests)} manifests, "
          f"{len(list((ROOT / 'deploy/systemd').glob('*.service')))} unit(s): "
          f"{'ok' if not findings else f'{len(findings)} finding(s)'}")
    sys.exit(1 if findings else 0)


main()
