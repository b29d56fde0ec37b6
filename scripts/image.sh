#!/usr/bin/env bash
# Builds the llm-sidecar container image from deploy/Containerfile and
# inspects it: size, user, entrypoint, and `--version` run inside where this
# machine allows running containers.
#
#   bash scripts/image.sh            # tag llm-sidecar:<version>
#
# Needs podman or buildah (Debian: apt-get install podman buildah); installs
# them when missing and apt-get is there. Nothing is pulled: the base is
# `scratch`.
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
tag="llm-sidecar:${version}"
target=x86_64-unknown-linux-gnu

if ! command -v podman >/dev/null && ! command -v buildah >/dev/null; then
    if command -v apt-get >/dev/null; then
        echo "== installing podman and buildah"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah >/dev/null
    else
        echo "image: needs podman or buildah" >&2
        exit 1
    fi
fi

echo "== static binary ($target, +crt-static)"
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --locked -p llm-sidecar --target "$target"
context=target/image
rm -rf "$context"
mkdir -p "$context"
strip -o "$context/llm-sidecar" "target/$target/release/llm-sidecar"
if ldd "$context/llm-sidecar" 2>&1 | grep -q '=>'; then
    echo "image: the binary is not static:" >&2
    ldd "$context/llm-sidecar" >&2
    exit 1
fi
"$context/llm-sidecar" --version

echo "== image $tag"
if command -v podman >/dev/null; then
    podman build --quiet -f deploy/Containerfile -t "$tag" "$context" >/dev/null
    tool=podman
else
    buildah bud --quiet -f deploy/Containerfile -t "$tag" "$context" >/dev/null
    tool=buildah
fi

size=$($tool inspect --format '{{.Size}}' "$tag" 2>/dev/null || true)
user=$($tool inspect --format '{{.Config.User}}' "$tag")
entry=$($tool inspect --format '{{.Config.Entrypoint}}' "$tag")
echo "image $tag: size ${size:-?} bytes ($(( ${size:-0} / 1024 / 1024 )) MiB), binary $(stat -c %s "$context/llm-sidecar") bytes, user $user, entrypoint $entry"
[ "$user" = "65532:65532" ] || { echo "image: user is '$user', not 65532:65532" >&2; exit 1; }
case "$entry" in *"/llm-sidecar"*) ;; *) echo "image: entrypoint is $entry" >&2; exit 1 ;; esac

if command -v podman >/dev/null; then
    if out=$(podman run --rm --network none "$tag" --version 2>&1); then
        echo "inside the image: $out"
    else
        echo "running containers is refused on this machine (podman run: $(echo "$out" | tail -1))"
        # Still run it on the image's own root filesystem (the binary alone),
        # as the image's user: proof that it needs no other file.
        if root=$(podman image mount "$tag" 2>/dev/null) && command -v chroot >/dev/null; then
            out=$(chroot --userspec=65532:65532 "$root" /llm-sidecar --version)
            podman image unmount "$tag" >/dev/null 2>&1 || true
            echo "on the image's root filesystem (chroot, user 65532): $out"
        else
            echo "built and inspected only"
        fi
    fi
fi
