"""What a process loads when it imports a layer: the import-linter contracts (pyproject) read the code, these
tests run it, in a fresh interpreter, the way a training script or a replay would."""

from __future__ import annotations

import json
import subprocess
import sys


def loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter loads to run ``code`` (beyond the ones it starts with)."""
    def run(source: str) -> set[str]:
        script = f"{source}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
        return set(json.loads(done.stdout.splitlines()[-1]))

    return run(code) - run("")


def test_a_training_script_loads_neither_the_master_the_agent_nor_the_rpc_server() -> None:
    loaded = loaded_by("import stead, stead.ckpt, stead.data\nstead.report_step(1)\nwith stead.phase('eval'): pass")
    assert {"stead.ckpt", "stead.data", "stead.core.worker.progress"} <= loaded  # it did import the worker API
    heavy = {m for m in loaded if m.split(".")[0] in ("grpclib", "grpc")
             or m.startswith(("stead.core.master", "stead.core.agent", "stead.core.rpc", "stead.core.store",
                              "stead.core.statemachine", "stead.cli"))}
    assert not heavy


def test_the_state_machine_loads_only_the_events_and_the_standard_library() -> None:
    loaded = loaded_by("import stead.core.statemachine")
    others = {m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names
              and not m.startswith(("stead.core.statemachine", "stead.core.events"))}
    # the events' own codec and errors come along (stead.core.serde, stead.core.errors), and the packages above
    assert others == {"stead", "stead.core", "stead.core.serde", "stead.core.errors"}
