#!/usr/bin/env python3
"""Side by side behind Dynamo's frontend: Dynamo 1.6.1's TensorRT-LLM sidecar
and llm-sidecar-dynamo, each in front of the same mock OpenEngine engine.

For each sidecar: streaming completions at a concurrency (tokens/s, time to
first token and inter-token gaps at p50/p99, the sidecar's CPU seconds and
peak RSS over the load), then the engine is SIGKILLed with requests going on:
how long until the worker's records leave discovery, and what the frontend's
clients got meanwhile. A benchmark, not a test: it asserts nothing.

`--affinity` runs the prefix-affinity story instead, behind the frontend's
`--router-mode kv`: two llm-sidecar-dynamo workers (each before its own mock
engine, which publishes KV events) and, as the peer baseline, two of Dynamo's
own mocker workers (`python -m dynamo.mocker`, which publish theirs); one request
with a 256-token prefix, then 49 sharing it, 20 ms apart: how many went to the
worker that served the first (the frontend's `nvext.worker_id`), and the
router's mean KV hit rate for them.

`--migration` runs the migration story instead, for each sidecar: the frontend
with `--migration-limit 1`, two workers of that sidecar, each in front of its
own mock engine, and one streamed completion of 20 tokens whose engine dies
(exit, as a kill) after its fifth token: how many tokens the client received,
how many were not the engine's sequence or came twice, whether an error
reached it, and how long the sixth token took after the fifth (the time to the
first token on the second worker).

Usage (after `cargo build --release -p llm-sidecar -p llm-sidecar-dynamo` and
with Dynamo's frontend installed, as scripts/test.sh does in target/dynamo-venv):

    python3 scripts/dynamo-bench.py [--streams 32] [--tokens 64] [--token-delay 20ms]
        [--secs 20] [--python target/dynamo-venv/bin/python] [--router-mode kv]
        [--migration | --affinity | --all]
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what, check, limit=60.0):
    start = time.monotonic()
    while time.monotonic() - start < limit:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit(f"timed out waiting for {what}")


def get(port, path, timeout=5):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.status, r.read().decode()


def cpu_seconds(pid):
    """utime + stime of a process and its threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def streamed_completion(port, body):
    """A streamed completion, read as it comes: the time it was sent, the
    HTTP status, each SSE `data:` event with the time it arrived (its JSON,
    or None for `[DONE]`), and what followed the last event."""
    body = json.dumps(dict(body, stream=True)).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    start = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    status, events, buf = None, [], b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        now = time.monotonic()
        if status is None and not buf:
            status = chunk.split(b" ", 2)[1].decode() if chunk.startswith(b"HTTP/") else "?"
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if b"data: " not in event:
                continue
            line = event.split(b"data: ", 1)[1].strip()
            if line == b"[DONE]":
                events.append((now, None))
                continue
            try:
                events.append((now, json.loads(line)))
            except ValueError:
                continue
    s.close()
    return start, status, events, buf


def stream_one(port, model, tokens, prompt):
    """One streaming completion; (ttft, [gaps], tokens, ok). ok: it ended
    with [DONE] and no error event. The mock's tokens are pseudo-random, so
    an answer can end at once with the end of sequence: ok, with no text and
    no time to first token."""
    start, _, events, _ = streamed_completion(
        port, {"model": model, "prompt": prompt, "max_tokens": tokens})
    arrivals, done, error = [], False, False
    for now, data in events:
        if data is None:
            done = True
        elif "choices" not in data:
            error = True
        elif data["choices"][0].get("text"):
            arrivals.append(now)
    ok = done and not error
    if not arrivals:
        return None, [], 0, ok
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - start, gaps, len(arrivals), ok


def load(port, model, streams, tokens, secs):
    stop = time.monotonic() + secs
    ttfts, gaps, counts, failed, empty = [], [], [0], [0], [0]
    lock = threading.Lock()

    def caller(n):
        i = 0
        while time.monotonic() < stop:
            i += 1
            ttft, g, got, ok = stream_one(port, model, tokens, f"w{3 + (n * 7 + i) % 900} w{5 + n}")
            with lock:
                if not ok:
                    failed[0] += 1
                elif ttft is None:
                    empty[0] += 1
                else:
                    ttfts.append(ttft)
                    gaps.extend(g)
                    counts[0] += got

    start = time.monotonic()
    threads = [threading.Thread(target=caller, args=(n,)) for n in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1000 if len(xs) > 2 else float("nan")
    return {
        "tokens_per_s": counts[0] / elapsed,
        "ttft_p50_ms": q(ttfts, 50), "ttft_p99_ms": q(ttfts, 99),
        "itl_p50_ms": q(gaps, 50), "itl_p99_ms": q(gaps, 99),
        "requests": len(ttfts), "failed": failed[0], "ended_at_once": empty[0],
        "elapsed_s": elapsed,
    }


class Bench:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="dynamo-bench-")
        self.kv = os.path.join(self.dir, "kv")
        os.makedirs(self.kv)
        self.env = dict(os.environ, DYN_FILE_KV=self.kv, HF_HUB_OFFLINE="1")
        self.env.pop("RUST_LOG", None)
        self.procs = []
        self.model = self.tokenizer()

    def tokenizer(self):
        tok = os.path.join(self.dir, "tokenizer")
        os.makedirs(tok)
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({f"w{i}": i for i in range(3, 32000)})
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for i, t in enumerate(["<unk>", "<s>", "</s>"])]
        files = {
            "tokenizer.json": {"version": "1.0", "truncation": None, "padding": None,
                               "added_tokens": added, "normalizer": None,
                               "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                               "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
                               "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}},
            "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                      "model_max_length": 4096,
                                      "tokenizer_class": "PreTrainedTokenizerFast",
                                      "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"},
            "config.json": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                            "vocab_size": 32000, "max_position_embeddings": 4096, "eos_token_id": 2,
                            "bos_token_id": 1, "hidden_size": 64, "num_attention_heads": 4,
                            "num_hidden_layers": 2, "num_key_value_heads": 4,
                            "intermediate_size": 128},
        }
        for name, value in files.items():
            with open(os.path.join(tok, name), "w") as f:
                json.dump(value, f)
        return tok

    def spawn(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        p = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.procs.append(p)
        return p

    def engine(self, extra=()):
        grpc, control = free_port(), free_port()
        p = self.spawn(f"engine-{grpc}", [
            os.path.join(ROOT, "target/release/llm-sidecar"), "mock-engine", "--kind", "openengine",
            "--model-id", "tiny", "--token-delay", self.args.token_delay,
            "--listen", f"127.0.0.1:{grpc}", "--control-listen", f"127.0.0.1:{control}", *extra])
        wait("the engine", lambda: get(control, "/stats")[0] == 200)
        p.control = control
        return p, grpc

    def instances(self):
        d = os.path.join(self.kv, "v1", "instances")
        return os.listdir(d) if os.path.isdir(d) else []

    def sidecar(self, kind, grpc):
        common = ["--grpc-endpoint", f"127.0.0.1:{grpc}", "--model-path", self.model,
                  "--discovery-backend", "file", "--request-plane", "tcp"]
        if kind == "dynamo":
            argv = [self.args.python, "-m", "dynamo.trtllm.sidecar"] + common
        else:
            argv = [os.path.join(ROOT, "target/release/llm-sidecar-dynamo")] + common + [
                "--admin-listen", f"127.0.0.1:{free_port()}"]
        before = set(self.instances())
        p = self.spawn(f"sidecar-{kind}", argv)
        wait(f"{kind}'s sidecar to register", lambda: set(self.instances()) - before)
        return p

    def frontend(self, extra=(), router_mode=None):
        port = free_port()
        router_mode = router_mode or self.args.router_mode
        mode = ["--router-mode", router_mode] if router_mode else []
        self.spawn("frontend", [self.args.python, "-m", "dynamo.frontend", "--discovery-backend",
                                "file", "--request-plane", "tcp", "--http-port", str(port),
                                *mode, *extra])
        wait("the frontend", lambda: get(port, "/v1/models")[0] == 200)
        return port

    def kill_story(self, port, engine, sidecar):
        """SIGKILL the engine with requests going on; when do the records go,
        and what did clients get over the next seconds."""
        statuses, stop = [], [False]

        def prober():
            while not stop[0]:
                t = time.monotonic()
                try:
                    body = json.dumps({"model": self.model, "prompt": "w7", "max_tokens": 2}).encode()
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=10) as r:
                        status = r.status
                except urllib.error.HTTPError as e:
                    status = e.code
                except OSError:
                    status = -1
                statuses.append((t, status))
                time.sleep(0.05)

        th = threading.Thread(target=prober)
        th.start()
        time.sleep(1)
        killed = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        gone = None
        while time.monotonic() - killed < self.args.kill_watch:
            if gone is None and not self.instances():
                gone = time.monotonic() - killed
            time.sleep(0.005)
        stop[0] = True
        th.join()
        after = [s for t, s in statuses if t >= killed]
        counts = {}
        for s in after:
            counts[s] = counts.get(s, 0) + 1
        return {"records_gone_ms": None if gone is None else gone * 1000,
                "sidecar_exit": sidecar.poll(), "client_statuses_after_kill": counts}

    def run(self):
        results = {}
        port = self.frontend()
        for kind in ["dynamo", "llm-sidecar-dynamo"]:
            engine, grpc = self.engine()
            sidecar = self.sidecar(kind, grpc)
            wait("the model to be served", lambda: self.model in get(port, "/v1/models")[1])
            load(port, self.model, 4, 8, 2)  # warm up
            cpu0 = cpu_seconds(sidecar.pid)
            r = load(port, self.model, self.args.streams, self.args.tokens, self.args.secs)
            cpu = cpu_seconds(sidecar.pid) - cpu0
            r["sidecar_cpu_s_per_s"] = cpu / r["elapsed_s"]
            r["sidecar_peak_rss_mib"] = peak_rss_mib(sidecar.pid)
            r.update(self.kill_story(port, engine, sidecar))
            results[kind] = r
            sidecar.send_signal(signal.SIGTERM)
            try:
                sidecar.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sidecar.kill()
            for name in os.listdir(os.path.join(self.kv, "v1", "mdc")) if os.path.isdir(
                    os.path.join(self.kv, "v1", "mdc")) else []:
                os.remove(os.path.join(self.kv, "v1", "mdc", name))
            time.sleep(12)  # the frontend forgets the model before the next sidecar comes
        return results

    def migration(self):
        """Per sidecar: a streamed completion of 20 tokens whose engine dies
        after its fifth, behind a frontend that may migrate it once."""
        results = {}
        prompt = migration_prompt()
        first = mock_tokens(prompt, 5)
        expected = first + mock_tokens(prompt + first, 15)
        for kind in ["dynamo", "llm-sidecar-dynamo"]:
            self.kv = os.path.join(self.dir, f"kv-migration-{kind}")
            os.makedirs(self.kv)
            self.env["DYN_FILE_KV"] = self.kv
            port = self.frontend(["--migration-limit", "1"])
            pairs = []
            for _ in range(2):
                engine, grpc = self.engine(["--seed-by-prompt", "--end-delay",
                                            self.args.token_delay])
                # Whichever engine serves the request dies after its fifth
                # token; the migrated request (a longer prompt) takes no fault.
                get(engine.control, "/fault?action=exit&at=5&max_prompt=2")
                pairs.append((engine, self.sidecar(kind, grpc)))
            wait("the model to be served", lambda: self.model in get(port, "/v1/models")[1])
            time.sleep(1)  # both workers known to the frontend
            results[kind] = migration_run(port, self.model, prompt, expected)
            for engine, sidecar in pairs:
                for p in (sidecar, engine):
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        return results

    def mocker(self):
        before = set(self.instances())
        p = self.spawn(f"mocker-{free_port()}", [
            self.args.python, "-m", "dynamo.mocker", "--model-path", self.model, "--model-name",
            self.model, "--discovery-backend", "file", "--request-plane", "tcp",
            "--kv-bytes-per-token", "1024", "--block-size", "32"])
        wait("a mocker worker to register", lambda: set(self.instances()) - before)
        return p

    def affinity(self):
        """Per kind of worker: 50 requests sharing a 256-token prefix behind
        the KV router; how many follow the first to its worker."""
        results = {}
        prefix = " ".join(f"w{1000 + i}" for i in range(256))
        for kind in ["dynamo-mocker", "llm-sidecar-dynamo"]:
            self.kv = os.path.join(self.dir, f"kv-affinity-{kind}")
            os.makedirs(self.kv)
            self.env["DYN_FILE_KV"] = self.kv
            port = self.frontend(router_mode="kv")
            procs = []
            for _ in range(2):
                if kind == "dynamo-mocker":
                    procs.append(self.mocker())
                else:
                    engine, grpc = self.engine()
                    procs += [engine, self.sidecar(kind, grpc)]
            wait("the model to be served", lambda: self.model in get(port, "/v1/models")[1])
            time.sleep(1)
            first = served_by(port, self.model, f"{prefix} w5000 w6000")
            time.sleep(1)  # the first request's blocks reach the router's index
            hits0 = kv_hit_rate(port)
            same = 0
            for n in range(1, 50):
                time.sleep(0.02)
                if served_by(port, self.model, f"{prefix} w{5000 + n} w{6000 + n}") == first:
                    same += 1
            hits = kv_hit_rate(port)
            results[kind] = {
                "followed_the_first": f"{same}/49",
                "mean_kv_hit_rate": (hits[0] - hits0[0]) / max(hits[1] - hits0[1], 1),
            }
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return results

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"kept {self.dir}", file=sys.stderr)


def served_by(port, model, prompt):
    """The worker that served a short completion (the frontend's nvext)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2,
                       "nvext": {"extra_fields": ["worker_id"]}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["nvext"]["worker_id"]["decode_worker_id"]


def kv_hit_rate(port):
    """The KV router's hit-rate histogram: (sum, count)."""
    total = [0.0, 0.0]
    for line in get(port, "/metrics")[1].splitlines():
        name = line.split("{")[0].split(" ")[0]
        if line.startswith("#") or "router_kv_hit_rate" not in name:
            continue
        for i, suffix in enumerate(["_sum", "_count"]):
            if name.endswith(suffix):
                total[i] += float(line.rsplit(" ", 1)[1])
    return total


def mock_tokens(prompt, n):
    """The mock engine's first n tokens for a prompt (`--seed-by-prompt`):
    the formula of mock-engine/src/generate.rs."""
    seed, mask = 17, (1 << 64) - 1
    for t in prompt:
        seed = (seed * 31 + t) & mask
    return [((seed * 2_654_435_761 + i * 7_919) & mask) % 32_000 for i in range(n)]


def migration_prompt():
    """A two-token prompt whose 20 tokens, before and after the migration,
    hold no special token (no text, and the frontend stops at the end of
    sequence)."""
    for a in range(500, 1000):
        p = [a, a + 1]
        first = mock_tokens(p, 5)
        if all(t >= 3 for t in first + mock_tokens(p + first, 15)):
            return p
    sys.exit("no prompt found")


def migration_run(port, model, prompt, expected):
    start, status, events, raw = streamed_completion(port, {
        "model": model, "prompt": " ".join(f"w{t}" for t in prompt), "max_tokens": len(expected)})
    arrivals, words, done = [], [], False
    errors = [] if status == "200" else [f"HTTP {status}"]
    for now, data in events:
        if data is None:
            done = True
        elif "choices" not in data:
            errors.append(json.dumps(data)[:200])
        else:
            for w in (data["choices"][0].get("text") or "").split():
                words.append(int(w[1:]))
                arrivals.append(now - start)
    rest = raw.decode(errors="replace").strip()
    if rest not in ("", "0"):  # "0": the end of a chunked body
        errors.append(rest[-200:])
    extra = sum(max(0, words.count(t) - expected.count(t)) for t in set(words))
    return {
        "tokens_received": len(words),
        "tokens_expected": len(expected),
        "in_order_and_whole": words == expected,
        "duplicates_or_strangers": extra,
        "error_seen_by_client": errors,
        "done": done,
        "first_token_ms": arrivals[0] * 1000 if arrivals else None,
        "sixth_after_fifth_ms": (arrivals[5] - arrivals[4]) * 1000 if len(arrivals) > 5 else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--token-delay", default="20ms")
    ap.add_argument("--secs", type=float, default=20)
    ap.add_argument("--kill-watch", type=float, default=5.0,
                    help="seconds to watch the frontend's answers after the kill")
    ap.add_argument("--python", default=os.path.join(ROOT, "target/dynamo-venv/bin/python"))
    ap.add_argument("--keep", action="store_true", help="keep the logs")
    ap.add_argument("--router-mode", default=None,
                    help="the frontend's --router-mode (its default if not given)")
    ap.add_argument("--migration", action="store_true",
                    help="the migration story instead of the load (see above)")
    ap.add_argument("--affinity", action="store_true",
                    help="the prefix-affinity story instead of the load (see above)")
    ap.add_argument("--all", action="store_true",
                    help="the load, then the affinity and the migration stories, in one run")
    args = ap.parse_args()
    bench = Bench(args)
    try:
        if args.all:
            results = {"load": bench.run(), "affinity": bench.affinity(),
                       "migration": bench.migration()}
        elif args.migration:
            results = bench.migration()
        elif args.affinity:
            results = bench.affinity()
        else:
            results = bench.run()
    finally:
        bench.close()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
