"""The committed generated code matches proto/: stead/core/rpc/_proto (proto/stead/v1) and each plugin's
stead/plugins/NAME/_proto (proto/stead/plugins/NAME/v1)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gen_proto.sh"


def _generated(root: Path) -> dict[str, bytes]:
    """Every file of every output of scripts/gen_proto.sh under ``root``'s stead/ (an output holds a
    message_pool.py), by its path under ``root``."""
    outputs = [pool.parent for pool in sorted((root / "stead").rglob("message_pool.py"))]
    return {p.relative_to(root).as_posix(): p.read_bytes() for out in outputs for p in sorted(out.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_generated_rpc_code_is_fresh() -> None:
    missing = [m for m in ("grpc_tools", "betterproto2_compiler") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the proto compiler is not installed ({', '.join(missing)} missing): "
                    "install the dev dependencies (pip install -e '.[dev]') to check the generated code")
    with tempfile.TemporaryDirectory(prefix="stead-proto-") as scratch:
        env = {**os.environ, "PYTHON": sys.executable}
        result = subprocess.run(["bash", str(SCRIPT), scratch], env=env, capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 0, f"scripts/gen_proto.sh failed:\n{result.stdout}\n{result.stderr}"
        fresh, committed = _generated(Path(scratch)), _generated(ROOT)
    assert {name.split("/_proto/")[0] for name in fresh} >= {"stead/core/rpc", "stead/plugins/ckpt",
                                                             "stead/plugins/sharding", "stead/plugins/scaler"}
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"generated RPC code is stale: run `make proto` (differs: {', '.join(stale)})"
