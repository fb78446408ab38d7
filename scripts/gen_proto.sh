#!/usr/bin/env bash
# Regenerate stead/core/rpc/_proto/ from proto/stead/v1/*.proto with betterproto2.
#
# Usage: scripts/gen_proto.sh [OUT_DIR]     (default: stead/core/rpc/_proto)
#
# Needs, in the virtualenv ($PYTHON, default .venv/bin/python): grpcio-tools (for
# `python -m grpc_tools.protoc`), betterproto2-compiler (the protoc plugin) and
# ruff (the plugin formats its output with it). The plugin runs in a scratch
# directory holding a pinned ruff.toml, so the output does not depend on the
# caller's directory or on the project's ruff settings: same input, same bytes.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
out="${1:-$root/stead/core/rpc/_proto}"
case "$out" in /*) ;; *) out="$(pwd)/$out" ;; esac

if ! "$python" -c 'import grpc_tools.protoc, betterproto2_compiler' 2>/dev/null; then
    echo "gen_proto: $python lacks grpcio-tools or betterproto2-compiler;" \
         "install the dev dependencies: $python -m pip install -e '.[dev]'" >&2
    exit 2
fi

# The plugin (protoc-gen-python_betterproto2) and ruff are found on PATH.
export PATH="$(dirname "$python"):$PATH"
for tool in protoc-gen-python_betterproto2 ruff; do
    if ! command -v "$tool" >/dev/null; then
        echo "gen_proto: $tool is not on PATH next to $python; install the dev dependencies" >&2
        exit 2
    fi
done
# Replacing OUT_DIR deletes it: refuse anything but earlier output of this script.
if [ -e "$out" ] && [ ! -f "$out/message_pool.py" ]; then
    echo "gen_proto: $out exists and is not generated code; pass an empty or earlier output directory" >&2
    exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/out"
printf 'line-length = 120\ntarget-version = "py311"\n' > "$work/ruff.toml"

mapfile -t protos < <(cd "$root/proto" && LC_ALL=C ls stead/v1/*.proto)
# The plugin prints a "Writing ..." line per package: show its output only on failure.
if ! (cd "$work" && "$python" -m grpc_tools.protoc \
        --proto_path="$root/proto" \
        --python_betterproto2_out="client_generation=async,server_generation=async:$work/out" \
        "${protos[@]/#/$root/proto/}") >"$work/protoc.log" 2>&1; then
    cat "$work/protoc.log" >&2
    echo "gen_proto: protoc failed (see above)" >&2
    exit 1
fi

rm -rf "$out"
mkdir -p "$(dirname "$out")"
cp -R "$work/out" "$out"
