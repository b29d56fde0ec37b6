#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatting, lints, every workspace test
# (unit, property, exhaustive, fuzz-corpus replay, process tests against the
# real binary), then the loom model in its own build.
#
# Installs what the tests need on a fresh Debian machine when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> %s\n' "$*"; }

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
# The etcd discovery tests start a real etcd of their own.
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
# deploy/kubernetes/ is a kustomize base with an overlay per kind, rendered by
# `kubectl kustomize` (Debian's kubernetes-client carries it).
command -v kubectl >/dev/null 2>&1 || need_apt+=(kubernetes-client)
# The tests' Python packages go into a venv (below); Debian ships venv apart.
python3 -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)
# deploy/: the systemd unit is checked with systemd-analyze, the image built
# with podman (or buildah).
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
command -v podman >/dev/null 2>&1 || command -v buildah >/dev/null 2>&1 || need_apt+=(podman buildah)
# llm-sidecar-dynamo builds Dynamo's crates: etcd-client's build script needs
# protoc, nixl-sys's bindgen needs libclang. LLM_SIDECAR_DYNAMO=0 leaves that
# crate out of a run (a quicker loop while working on the rest; CI runs all).
dynamo="${LLM_SIDECAR_DYNAMO:-1}"
if [ "$dynamo" = 1 ]; then
  command -v protoc >/dev/null 2>&1 || [ -n "${PROTOC:-}" ] || need_apt+=(protobuf-compiler)
  ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || [ -n "${LIBCLANG_PATH:-}" ] || need_apt+=(libclang-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing ${need_apt[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
  # Debian starts a system etcd on install where it can; the tests use their own.
fi
# The tests' Python, in a venv of their own (first on PATH, so the tests'
# `python3` is this one): a real gRPC C-core client (grpcio) checks what callers
# read through the sidecar (hardening::a_grpcio_caller_sees_the_engines_trailers_only_status_unchanged);
# the Prometheus project's parsers (prometheus-client) read /metrics
# (metrics::metrics_after_a_fault_run_...); the Kubernetes manifests are
# validated offline against the API schemas (kubernetes-validate carries them)
# and check-deploy.py reads them with PyYAML.
test_venv=target/test-venv
if ! "$test_venv/bin/python" -c 'import grpc, prometheus_client, kubernetes_validate, yaml' 2>/dev/null; then
  log "installing grpcio, prometheus-client, kubernetes-validate, PyYAML into $test_venv (pip)"
  python3 -m venv "$test_venv"
  "$test_venv/bin/pip" install --quiet grpcio prometheus-client kubernetes-validate pyyaml
fi
export PATH="$PWD/$test_venv/bin:$PATH"

# Dynamo's frontend for llm-sidecar-dynamo's tests (dynamo/tests/frontend),
# as docs/DYNAMO.md installs it: the runtime wheel, the Python entry points
# without their GPU dependencies, and the three modules those entry points import.
dynamo_venv=target/dynamo-venv
if [ "$dynamo" = 1 ] && ! "$dynamo_venv/bin/python" -c 'import dynamo.frontend' 2>/dev/null; then
  log "installing Dynamo 1.6.1's frontend into $dynamo_venv (pip)"
  python3 -m venv "$dynamo_venv"
  "$dynamo_venv/bin/pip" install --quiet ai-dynamo-runtime==1.6.1
  "$dynamo_venv/bin/pip" install --quiet --no-deps ai-dynamo==1.6.1
  "$dynamo_venv/bin/pip" install --quiet packaging pyyaml msgspec
fi

# The engines' own gRPC servers as they ship on PyPI, for the shipped-server
# tests (bin/tests/process/shipped_servers.rs): SGLang 0.5.23's, vLLM 0.34.0's
# and smg-grpc-servicer 0.14.1's wheels without their GPU dependencies (SGLang's
# Rust gRPC server and Python bridge, the smg servicer's serve_grpc, vLLM's own
# gRPC launcher run; the tests' scripts stand in for the engine core), and the
# light modules their imports reach. Versions pinned as tested.
engines_venv=target/engines-venv
engines_modules='["sglang", "vllm", "cloudpickle", "cbor2", "uvloop", "smg_grpc_servicer", "smg_grpc_proto", "grpc_reflection", "fastapi", "msgspec", "numpy", "PIL", "regex", "dill", "openai", "yaml", "einops"]'
if ! "$engines_venv/bin/python" -c "import importlib.util as u; assert all(u.find_spec(m) for m in $engines_modules)" 2>/dev/null; then
  log "installing SGLang 0.5.23, vLLM 0.34.0 and smg-grpc-servicer 0.14.1 into $engines_venv (pip)"
  python3 -m venv "$engines_venv"
  "$engines_venv/bin/pip" install --quiet --no-deps sglang==0.5.23 vllm==0.34.0 \
    smg-grpc-servicer==0.14.1 smg-grpc-proto==0.4.28
  "$engines_venv/bin/pip" install --quiet fastapi==0.165.0 pydantic==2.14.4 msgspec==0.23.0 \
    orjson==3.13.0 packaging==26.4 pybase64==1.5.1 numpy==2.4.6 psutil==7.2.2 requests==2.34.2 \
    pillow==13.0.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    protobuf==7.36.2 regex==2026.12.2 partial-json-parser==0.2.1.1.post7 dill==0.4.1 \
    setproctitle==1.3.8 openai==2.8.0 PyYAML==6.0.4 einops==0.8.2 cloudpickle==3.1.3 \
    cachetools==8.0.2 cbor2==6.3.0 prometheus-client==0.26.0 uvloop==0.23.0
fi
export LLM_SIDECAR_ENGINES_PYTHON="$PWD/$engines_venv/bin/python"

log "cargo fmt --check"
cargo fmt --all -- --check

# llm-sidecar-dynamo pulls in Dynamo's ~900 crates: linting and building them
# is most of this run's time on a 2-core machine (and ~10 GB of target
# directory); docs/DYNAMO.md ("Tests") has the figures.
only=()
[ "$dynamo" = 1 ] || only=(--exclude llm-sidecar-dynamo)
log "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace "${only[@]}" --all-targets --locked -- -D warnings

# Private items too: the rooms' docs are written for the people who work in
# them, and their links between rooms resolve there.
log "cargo doc (every item, warnings are errors)"
RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
  cargo doc --workspace "${only[@]}" --no-deps --document-private-items --locked

log "cargo test --workspace (llm-sidecar-dynamo's tests run Dynamo 1.6.1's frontend)"
cargo test --workspace "${only[@]}" --locked

log "deploy/: overlays rendered, Kubernetes schemas (1.33, strict), flags, engines and stop budgets, systemd unit"
rendered=target/deploy
rm -rf "$rendered" && mkdir -p "$rendered"
for overlay in deploy/kubernetes/overlays/*/; do
  # kustomize warns (stderr) about the older spellings kept for old kubectl:
  # its stderr is shown only when it fails.
  if ! kubectl kustomize "$overlay" > "$rendered/$(basename "$overlay").yaml" 2> "$rendered/kustomize.err"; then
    cat "$rendered/kustomize.err"; exit 1
  fi
done
rm -f "$rendered/kustomize.err"
python3 -m kubernetes_validate --strict --quiet -k 1.33.0 "$rendered"/*.yaml
python3 scripts/check-deploy.py target/debug/llm-sidecar "$rendered"/*.yaml
python3 scripts/check-deploy.py --self-test target/debug/llm-sidecar "$rendered"/*.yaml
if [ "$dynamo" = 1 ]; then
  # The Dynamo worker as Dynamo's operator lays it out (kubernetes discovery).
  mkdir -p "$rendered/dynamo"
  kubectl kustomize deploy/kubernetes/dynamo > "$rendered/dynamo/dynamo.yaml"
  python3 -m kubernetes_validate --strict --quiet -k 1.33.0 "$rendered/dynamo/dynamo.yaml"
  python3 scripts/check-deploy.py --dynamo target/debug/llm-sidecar-dynamo "$rendered/dynamo/dynamo.yaml"
fi
unit_dir=$(mktemp -d)
sed "s|/usr/local/bin/llm-sidecar|$PWD/target/debug/llm-sidecar|" deploy/systemd/llm-sidecar.service \
  > "$unit_dir/llm-sidecar.service"
# verify exits 0 on a directive it ignores; any word from it is a finding.
verified=$(systemd-analyze verify "$unit_dir/llm-sidecar.service" 2>&1 || true)
rm -rf "$unit_dir"
if [ -n "$verified" ]; then echo "$verified"; exit 1; fi

log "container image (deploy/Containerfile, FROM scratch)"
bash scripts/image.sh

log "loom model of the admission gate (own build, --cfg loom, preemption bound ${LOOM_MAX_PREEMPTIONS:=3})"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS="$LOOM_MAX_PREEMPTIONS" \
  cargo test -p llm-sidecar-proptests --test loom --release --locked -- --nocapture --test-threads 1


log "all tests passed"
