"""The committed generated code in stead/core/rpc/_proto matches proto/stead/v1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "stead" / "core" / "rpc" / "_proto"
SCRIPT = ROOT / "scripts" / "gen_proto.sh"


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_generated_rpc_code_is_fresh() -> None:
    missing = [m for m in ("grpc_tools", "betterproto2_compiler") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the proto compiler is not installed ({', '.join(missing)} missing): "
                    "install the dev dependencies (pip install -e '.[dev]') to check the generated code")
    with tempfile.TemporaryDirectory(prefix="stead-proto-") as scratch:
        out = Path(scratch) / "_proto"
        env = {**os.environ, "PYTHON": sys.executable}
        result = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 0, f"scripts/gen_proto.sh failed:\n{result.stdout}\n{result.stderr}"
        fresh, committed = _files(out), _files(COMMITTED)
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"generated RPC code is stale: run `make proto` (differs: {', '.join(stale)})"
