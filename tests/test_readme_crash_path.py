"""The README's story of a worker crash names real code: every module it names exists, and every function it names
(written ``name()``) is defined in a module named before it in the story, so a rename that the story misses fails
here instead of leaving the README wrong."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "### What happens when a worker crashes"

#: a backticked module path (``agent/workers.py``: under stead/core/; ``stead/...`` and ``tests/...``: from the
#: repository's root)
_PATH = re.compile(r"`((?:[\w.]+/)*\w+\.py)`")
#: a backticked function or method, ``WorkerGroup._watch()``
_CALL = re.compile(r"`([A-Za-z_][\w.]*)\(\)`")


def _story() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.index("\n#", start + len(SECTION))
    return readme[start:end]


def _module(path: str) -> Path:
    return ROOT / path if path.startswith(("stead/", "tests/")) else ROOT / "stead" / "core" / path


def _defined(module: Path) -> set[str]:
    """The qualified names of ``module``'s functions, classes and their methods (``Class.method``)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
    return names


def test_every_module_and_function_the_crash_story_names_exists_where_it_says() -> None:
    story = _story()
    tokens = sorted([(m.start(), "path", m.group(1)) for m in _PATH.finditer(story)]
                    + [(m.start(), "call", m.group(1)) for m in _CALL.finditer(story)])
    named: list[tuple[str, set[str]]] = []
    missing: list[str] = []
    calls = 0
    for _, kind, text in tokens:
        if kind == "path":
            module = _module(text)
            assert module.is_file(), f"the crash story names {text}, which is not {module}"
            named.append((text, _defined(module)))
            continue
        calls += 1
        if not any(text in names for _, names in named):
            missing.append(f"{text}() (looked in {', '.join(path for path, _ in named) or 'no module yet'})")
    assert not missing, f"the crash story names functions its modules do not define: {missing}"
    assert len(named) >= 15 and calls >= 30, "the crash story should name the modules and functions it passes through"
