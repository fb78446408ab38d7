#!/usr/bin/env bash
# Regenerate stead's RPC code from proto/ with betterproto2: the agents' protocol, proto/stead/v1/*.proto, into
# stead/core/rpc/_proto/, each plugin's protocol, proto/stead/plugins/NAME/v1/*.proto, into
# stead/plugins/NAME/_proto/, and each platform's, proto/stead/platforms/NAME/v1/*.proto, into
# stead/platforms/NAME/_proto/, so that a plugin's messages live with the plugin and stead.core never loads them.
#
# Usage: scripts/gen_proto.sh [OUT_ROOT]     (default: the repository; the directories above are made under it)
#
# betterproto2 writes one module per proto package (stead/v1/__init__.py under each output directory) holding the
# messages of the files it is given and of the files they import: a plugin's output carries its own copy of
# common.proto's Ack. Each output is one protoc run, so each has its own message pool.
#
# Needs, in the virtualenv ($PYTHON, default .venv/bin/python): grpcio-tools (for
# `python -m grpc_tools.protoc`), betterproto2-compiler (the protoc plugin) and
# ruff (the plugin formats its output with it). The plugin runs in a scratch
# directory holding a pinned ruff.toml, so the output does not depend on the
# caller's directory or on the project's ruff settings: same input, same bytes.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
out_root="${1:-$root}"
case "$out_root" in /*) ;; *) out_root="$(pwd)/$out_root" ;; esac

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

# What to generate: "PROTO_DIR OUT_DIR" (PROTO_DIR under proto/, OUT_DIR under OUT_ROOT).
targets=("stead/v1 stead/core/rpc/_proto")
for kind in plugins platforms; do  # each plugin's and each platform's protocol, with its package
    for dir in $(cd "$root/proto" && LC_ALL=C ls -d "stead/$kind"/*/v1 2>/dev/null); do
        name="${dir#stead/$kind/}"
        name="${name%/v1}"
        if [ ! -d "$root/stead/$kind/$name" ]; then
            echo "gen_proto: proto/$dir has no ${kind%s} stead/$kind/$name to generate it into;" \
                 "name its directory after its ${kind%s} or delete it" >&2
            exit 2
        fi
        targets+=("$dir stead/$kind/$name/_proto")
    done
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
printf 'line-length = 120\ntarget-version = "py311"\n' > "$work/ruff.toml"

# Generate every output first, replace none until all succeeded.
for target in "${targets[@]}"; do
    read -r dir out <<<"$target"
    # Replacing an output deletes it: refuse anything but earlier output of this script.
    if [ -e "$out_root/$out" ] && [ ! -f "$out_root/$out/message_pool.py" ]; then
        echo "gen_proto: $out_root/$out exists and is not generated code; pass an empty or earlier output root" >&2
        exit 2
    fi
    mkdir -p "$work/out/$out"
    mapfile -t protos < <(cd "$root/proto" && LC_ALL=C ls "$dir"/*.proto)
    # The plugin prints a "Writing ..." line per package: show its output only on failure.
    if ! (cd "$work" && "$python" -m grpc_tools.protoc \
            --proto_path="$root/proto" \
            --python_betterproto2_out="client_generation=async,server_generation=async:$work/out/$out" \
            "${protos[@]/#/$root/proto/}") >"$work/protoc.log" 2>&1; then
        cat "$work/protoc.log" >&2
        echo "gen_proto: protoc failed on proto/$dir (see above)" >&2
        exit 1
    fi
done

for target in "${targets[@]}"; do
    read -r dir out <<<"$target"
    rm -rf "${out_root:?}/$out"
    mkdir -p "$(dirname "$out_root/$out")"
    cp -R "$work/out/$out" "$out_root/$out"
done
