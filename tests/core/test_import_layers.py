"""What a process loads when it imports a layer: the import-linter contracts (pyproject) read the code, these
tests run it, in a fresh interpreter, the way a training script or a replay would. And what stead's own tests,
benchmarks, examples and scripts import of stead: its public modules, as a plugin or an embedder would."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the folders whose Python files must import stead's public modules only
USERS = ("tests", "bench", "examples", "scripts")
#: (file relative to the repository root, private module or name it may import) -> why it could not be removed;
#: nothing stands here now, and a new entry needs a reason a reviewer accepts
ALLOWED: dict[tuple[str, str], str] = {}
#: an import statement in a string: code a test runs in a subprocess (``python -c``) or writes to a file
_IMPORT_IN_TEXT = re.compile(r"^\s*(?:from\s+(stead[\w.]*)\s+import\s+\(?([\w\s,]+)|import\s+(stead[\w.]*))", re.M)


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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def private_imports(source: str) -> list[str]:
    """The private stead modules and names ``source`` imports (``stead.core.rpc._wire``, ``stead.x import _y``),
    in import statements and in strings that hold code."""
    found: list[str] = []

    def check(module: str, names: list[str]) -> None:
        if module.split(".")[0] != "stead":
            return
        if any(_private(part) for part in module.split(".")):
            found.append(module)
        found.extend(f"{module}.{name}" for name in names if _private(name))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name, [])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            check(node.module, [alias.name for alias in node.names])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in _IMPORT_IN_TEXT.finditer(node.value):
                module, names, imported = match.groups()
                check(module or imported, [n.strip() for n in (names or "").split(",") if n.strip()])
    return found


def _own_test(path: Path, module: str) -> bool:
    """Whether ``path`` is one of the own tests of the plugin or platform whose private ``module`` it imports.

    A bundled plugin or platform is a package of its own: its tests (``tests/plugins/ckpt/``,
    ``tests/plugins/test_diagnosis*.py``, ``tests/platforms/k8s/``) test its parts, which it keeps private from
    everyone else; what others use of it (benchmarks, core's tests, tools) it exports from its package.
    """
    parts = module.split(".")
    if len(parts) < 4 or parts[1] not in ("plugins", "platforms") or _private(parts[2]):
        return False
    area, name = parts[1], parts[2]
    where = path.relative_to(ROOT).parts
    return where[:2] == ("tests", area) and (where[2] == name or where[2].startswith(f"test_{name}"))


def test_the_private_import_finder_finds_what_it_must() -> None:
    source = '''
import stead.core.store._common
from stead.core.rpc._wire import COUNT_BOUNDS
from stead.plugins.ckpt import _disk, segment_names
from stead.core.rpc import (
    _refusals,
    RpcServer,
)
from stead.core.rpc import COUNT_BOUNDS, check_wire
import stead.core.agent.zygote_main
from .local import _helper
CHILD = """
import os
from stead.core.agent._zygote_main import die_with
"""
'''
    assert private_imports(source) == ["stead.core.store._common", "stead.core.rpc._wire",
                                       "stead.plugins.ckpt._disk", "stead.core.rpc._refusals",
                                       "stead.core.agent._zygote_main"]
    test = ROOT / "tests" / "plugins" / "ckpt" / "test_x.py"
    assert _own_test(test, "stead.plugins.ckpt._disk")
    assert not _own_test(test, "stead.plugins.sharding._x") and not _own_test(test, "stead.core.rpc._wire")
    assert not _own_test(ROOT / "bench" / "ckpt.py", "stead.plugins.ckpt._disk")
    assert _own_test(ROOT / "tests" / "plugins" / "test_diagnosis_hang.py", "stead.plugins.diagnosis._x")


def test_tests_benchmarks_examples_and_scripts_import_stead_s_public_modules_only() -> None:
    offending = []
    for folder in USERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():  # the finder's own samples above import private modules on purpose
                continue
            for module in private_imports(path.read_text()):
                where = str(path.relative_to(ROOT))
                if (where, module) not in ALLOWED and not _own_test(path, module):
                    offending.append(f"{where}: {module}")
    assert not offending, ("these import private stead modules or names; import what they need from its public "
                           "package or module (make it public there if a plugin or platform author needs it too), "
                           "or test it through the public API:\n" + "\n".join(offending))
