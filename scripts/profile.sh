#!/usr/bin/env bash
# One look inside the sidecar under paced load (docs/PERFORMANCE-LOG.md, "The
# profile" and "Memory per stream"): the mock engine at a real engine's pace,
# the sidecar in front of it, `llm-sidecar bench` streaming through it, and one
# of three instruments on the sidecar alone:
#
#   stat    perf stat for 5 s: task-clock, context switches, writev and recvfrom
#           calls; then the sidecar's peak RSS (VmHWM) and the bench's report
#   record  perf record -g for 10 s at 999 Hz; writes target/profile/perf.data
#           and prints the top entries (perf report --no-children)
#   massif  the sidecar under valgrind's massif (pace 500 ms, so valgrind keeps
#           up); writes target/profile/massif.out and prints ms_print's summary
#
# usage: scripts/profile.sh stat|record|massif [streams] [connections] [sidecar-binary]
#   streams (512), connections (streams/64, at least 1), binary (the sidecar
#   to look at: target/release/llm-sidecar, built if missing, or another build,
#   to compare two).
# Knobs: PACE (20ms; massif: 500ms), TOKENS (64), PORT_BASE (27050: four ports
# from it, below the ephemeral range).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:?usage: scripts/profile.sh stat|record|massif [streams] [connections] [binary]}
streams=${2:-512}
conns=${3:-$(( streams / 64 > 0 ? streams / 64 : 1 ))}
bin=${4:-target/release/llm-sidecar}
tokens=${TOKENS:-64}
base=${PORT_BASE:-27050}
case "$mode" in
  stat|record) pace=${PACE:-20ms} ;;
  massif) pace=${PACE:-500ms} ;;
  *) echo "unknown mode '$mode': stat, record or massif" >&2; exit 2 ;;
esac
# The mock engine and the load come from this checkout's build; the sidecar
# profiled may be another build.
tool=target/release/llm-sidecar
[ -x "$tool" ] || cargo build --release --locked -p llm-sidecar
[ -x "$bin" ] || { echo "no sidecar binary at $bin" >&2; exit 2; }
need=()
command -v perf >/dev/null 2>&1 || need+=(linux-perf)
[ "$mode" = massif ] && ! command -v valgrind >/dev/null 2>&1 && need+=(valgrind)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

out=target/profile
mkdir -p "$out"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

engine=127.0.0.1:$base
listen=127.0.0.1:$((base + 2))
admin=127.0.0.1:$((base + 3))
"$tool" mock-engine --listen "$engine" --control-listen "127.0.0.1:$((base + 1))" \
  --token-delay "$pace" >"$work/mock.log" 2>&1 &
pids+=($!)
sidecar=("$bin" run --engine-endpoint "$engine" --listen "$listen" --admin-listen "$admin"
  --discovery "file:$work/discovery" --router-grace 0s --drain-timeout 1s)
if [ "$mode" = massif ]; then
  valgrind --tool=massif --massif-out-file="$out/massif.out" "${sidecar[@]}" >"$work/sidecar.log" 2>&1 &
else
  "${sidecar[@]}" >"$work/sidecar.log" 2>&1 &
fi
spid=$!
pids+=("$spid")
for _ in $(seq 1 200); do
  curl -sf "http://$admin/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
curl -sf "http://$admin/ready" >/dev/null || { cat "$work/sidecar.log" >&2; exit 1; }

load() {
  "$tool" bench --target "$listen" -c "$streams" --connections "$conns" -n "$tokens" \
    -d "$1" --json >"$work/bench.json" 2>/dev/null &
  bench=$!
  pids+=("$bench")
}

echo "$mode: $streams streams over $conns connections, $tokens tokens at $pace each, sidecar $bin"
case "$mode" in
  stat)
    load 12s
    sleep 4
    perf stat -e task-clock,context-switches,syscalls:sys_enter_writev,syscalls:sys_enter_recvfrom \
      -p "$spid" -- sleep 5 2>&1 | grep -E "task-clock|context|writev|recvfrom"
    grep VmHWM "/proc/$spid/status"
    wait "$bench" || true
    cat "$work/bench.json"; echo
    ;;
  record)
    load 16s
    sleep 4
    perf record -F 999 -g -o "$out/perf.data" -p "$spid" -- sleep 10 2>&1 | tail -1
    wait "$bench" || true
    perf report -i "$out/perf.data" --no-children --sort symbol --stdio 2>/dev/null \
      | grep -E '^ +[0-9.]+%' | head -25
    ;;
  massif)
    load 40s
    sleep 30
    kill -TERM "$spid"
    wait "$spid" || true
    ms_print "$out/massif.out" | sed -n '1,35p'
    ;;
esac
