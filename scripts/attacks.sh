#!/usr/bin/env bash
# The hardening attacks, measured: a well-behaved caller's calls/s through the
# sidecar with no attack, while one caller holds every engine stream, and while
# a caller floods PING, SETTINGS, PRIORITY or WINDOW_UPDATE frames, on one
# connection (once) and reconnecting whenever the sidecar cuts it (again); and
# beside round three's callers (clients/h2_attack.py: zero windows, a caller
# that never reads, rapid reset, half-open and early-ended calls), with the
# sidecar's RSS. docs/RELIABILITY.md ("Hardening") quotes a run.
#
#   bash scripts/attacks.sh [path/to/llm-sidecar]     (default: the release build)
#
# ATTACKS=round3 runs only round three's attacks; ONLY=<regex> only those of
# them whose label matches (ONLY='reset' for the two rapid resets).
# MOCK=path/to/llm-sidecar runs the mock engine from another build (an older
# sidecar's own mock may lack --max-concurrent-streams).
# Needs python3 (for the flooder). Ports 47000-47099 on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/llm-sidecar}
[ -x "$bin" ] || cargo build --release --locked -p llm-sidecar
mock=${MOCK:-$bin}
flood=bin/tests/process/clients/h2_flood.py
attack=bin/tests/process/clients/h2_attack.py
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

calm() { # calls/s of 4 streams of 16 tokens for 5 s (or $2), and the errors
  "$bin" bench --target "127.0.0.1:$1" -c 4 -n 16 -d "${2:-5s}" --json | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("%.0f calls/s, errors %s" % (r["calls_per_s"], r["errors"] or "none"))'
}

start() { # mock flags...; starts the mock on 47051 and the sidecar on 47061
  "$mock" mock-engine --listen 127.0.0.1:47051 --control-listen 127.0.0.1:47052 "$@" >"$work/mock.log" 2>&1 &
  sleep 1
  "$bin" run --engine-endpoint 127.0.0.1:47051 --listen 127.0.0.1:47061 --admin-listen 127.0.0.1:47090 \
    --discovery "file:$work/discovery" --retry-interval 200ms >"$work/sidecar.log" 2>&1 &
  for _ in $(seq 100); do curl -sf 127.0.0.1:47090/ready >/dev/null && return; sleep 0.1; done
  echo "sidecar did not become ready"; cat "$work/sidecar.log"; exit 1
}

rss() { # the sidecar's resident memory, MiB
  echo "$(( $(ps -o rss= -p "$(pgrep -f 'listen 127.0.0.1:47061' | head -1)") / 1024 )) MiB"
}

stop() { # (an engine left paused is resumed, or it would never end)
  kill $(jobs -p) 2>/dev/null || true
  pkill -CONT -f 'mock-engine --listen 127.0.0.1:47051' 2>/dev/null || true
  wait 2>/dev/null || true; sleep 1
}

echo "binary: $bin"
if [ "${ATTACKS:-all}" = all ]; then
start
echo "no attack:                      $(calm 47061)"
for mode in once again; do
  for kind in ping settings priority window_update; do
    python3 "$flood" 127.0.0.1:47061 "$kind" 7 "$mode" >"$work/flood.json" &
    flooder=$!
    sleep 1
    result=$(calm 47061)
    wait "$flooder" || true
    echo "$(printf '%-14s' "$kind") flood ($mode): $result; flooder: $(cat "$work/flood.json")"
  done
done
stop
start --max-concurrent-streams 100 --token-delay 20ms
"$bin" bench --target 127.0.0.1:47061 -c 150 --connections 1 -n 5000 -d 30s --json >/dev/null 2>&1 &
sleep 2
echo "one caller holds 150 streams (engine allows 100 per connection):"
echo "                                $(timeout 60 bash -c "$(declare -f calm); bin=$bin; calm 47061" || echo 'no call completed within 60 s')"
stop
fi

# Round three: each attack for 20 s; the well-behaved caller runs 10 s from
# 5 s after it starts; the sidecar's RSS at its end. CALLS sets the calls per
# connection of zero_window (200).
# PAUSES=1 pauses the engine (SIGSTOP) for 100 ms every 400 ms meanwhile, as
# a Python engine's event loop or a loaded node does.
round3() { # label, attack mode, mock flags...
  local label=$1 mode=$2; shift 2
  if [ -n "${ONLY:-}" ] && ! [[ $label =~ $ONLY ]]; then return; fi
  start "$@"
  python3 "$attack" 127.0.0.1:47061 "$mode" 20 >"$work/attack.json" &
  if [ -n "${PAUSES:-}" ]; then
    local engine; engine=$(pgrep -f 'mock-engine --listen 127.0.0.1:47051' | head -1)
    (for _ in $(seq 50); do sleep 0.3; kill -STOP "$engine"; sleep 0.1; kill -CONT "$engine"; done) 2>/dev/null &
  fi
  sleep 5
  result=$(timeout 90 bash -c "$(declare -f calm); bin=$bin; calm 47061 10s" || echo 'no call completed within 90 s')
  echo "$(printf '%-32s' "$label"): $result; sidecar RSS $(rss)"
  stop
}
round3 "zero-window, 2 x 200, 1 ms tokens" zero_window --token-delay 1ms
CALLS=2048 round3 "zero-window, 2 x 2048" zero_window
round3 "never reads, 512 x 20,000 tokens" never_read
round3 "rapid reset, 4 connections" rapid_reset
PAUSES=1 round3 "late resets, engine pausing" rapid_reset_late
round3 "half-open calls, 2 x 1,000" half_open --max-concurrent-streams 20
round3 "early-ended calls, 1 connection" early_end
round3 "own-health Watch, 64 x 1,000" health_watch
round3 "CONNECT without :path" connect
# Attack 8: the admin port filled with idle connections; what the kubelet's
# probe sees (20 probes of /live, 2 s each), and the request plane beside it.
if [ -z "${ONLY:-}" ] || [[ "admin port" =~ $ONLY ]]; then
start
python3 "$attack" 127.0.0.1:47090 admin_fill 20 >"$work/attack.json" &
sleep 5
live=0
for _ in $(seq 20); do curl -sf -m 2 127.0.0.1:47090/live >/dev/null && live=$((live + 1)); sleep 0.5; done
echo "$(printf '%-32s' "admin port, 64 idle connections"): /live answered $live of 20; $(calm 47061); sidecar RSS $(rss)"
stop
fi
