#!/usr/bin/env bash
# Performance, side by side, in one command (docs/PERFORMANCE.md explains it):
#   1. the same load straight to the mock engine, through llm-sidecar, and through
#      nginx as a plain gRPC reverse proxy, at 1, 16, 64 and 256 streams;
#   2. the engine at a real engine's pace, 64 to 8,192 streams from one address
#      as a router sends them (each point paced so the engine and the load
#      generator fit on this machine's cores), direct, through llm-sidecar on
#      default flags and through nginx: tokens/s against direct, added
#      first-token and inter-token time, CPU per message, peak RSS;
#   3. detection latency for each way an engine is lost, file and etcd discovery;
#   4. detection latency per engine kind (NOT_SERVING, SIGKILL, SIGSTOP).
# Reports land in target/perf-proxy.md, target/perf-paced.md,
# target/perf-detection.md and target/perf-detection-kinds.md.
# Knobs: PERF_SECS, PERF_REPS, PERF_STREAMS, PACE_MS, PACE_STREAMS, PACE_TOKENS,
# DETECT_RUNS (see bin/tests/process/perf.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
[ -x /usr/sbin/nginx ] || need_apt+=(nginx-light)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
cargo build --release --locked -p llm-sidecar
# Arguments narrow the run to matching tests (e.g. proxy_cost); none: every benchmark.
cargo test --release --locked -p llm-sidecar --test process -- --ignored --nocapture --test-threads 1 "${@:-perf::}"
