#!/usr/bin/env bash
# What one `llm-sidecar probe` costs: wall time and CPU per call, averaged over
# N calls (200) against the mock engine of each kind, auto-detected and with
# the kind given. Release build.
#
#   bash scripts/probe-cost.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-200}
cargo build --release --locked -q -p llm-sidecar
bin=target/release/llm-sidecar
grpc=127.0.0.1:57151
control=127.0.0.1:57152
for kind in trtllm openengine vllm sglang; do
    "$bin" mock-engine --kind "$kind" --listen "$grpc" --control-listen "$control" 2>/dev/null &
    mock=$!
    for _ in $(seq 100); do "$bin" probe --engine "$grpc" -q 2>/dev/null && break; sleep 0.1; done
    for given in auto "$kind"; do
        python3 - "$bin" "$grpc" "$given" "$n" "$kind" <<'PY'
import resource, subprocess, sys, time
binary, grpc, given, n, kind = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
args = [binary, "probe", "--engine", grpc, "--engine-kind", given, "-q"]
before = resource.getrusage(resource.RUSAGE_CHILDREN)
start = time.perf_counter()
for _ in range(n):
    subprocess.run(args, check=True)
wall = (time.perf_counter() - start) / n
after = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / n
print(f"{kind:10} --engine-kind {given:10} wall {wall * 1000:.2f} ms  cpu {cpu * 1000:.2f} ms  (max RSS {after.ru_maxrss / 1024:.1f} MiB, {n} calls)")
PY
    done
    kill "$mock"
    wait "$mock" 2>/dev/null || true
done
