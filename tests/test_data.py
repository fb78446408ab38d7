"""stead.data's worker-side helpers that need no master: the global batch across world sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stead.data import accumulation_steps, batch_size


@pytest.mark.parametrize(("world", "steps"), [(1, 12), (2, 6), (4, 3), (6, 2), (12, 1)])
def test_the_global_batch_stays_constant_as_the_world_changes(world: int, steps: int) -> None:
    assert accumulation_steps(24, 2, world) == steps
    assert steps * 2 * world == 24


def test_the_world_size_defaults_to_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert accumulation_steps(64, 4) == 4


@pytest.mark.parametrize(("args", "message"), [
    ((24, 2, 5), r"cannot be split into micro batches of 2 on 5 ranks; world sizes that can: \[1, 2, 3, 4, 6, 12\]"),
    ((24, 32, 1), r"cannot be split into micro batches of 32 on 1 ranks"),
    ((0, 2, 1), r"global_batch=0 must be a positive whole number"),
    ((24, 2, 0), r"world_size=0 must be a positive whole number"),
])
def test_a_batch_the_world_cannot_split_is_a_clear_error(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        accumulation_steps(*args)


def test_the_readme_global_batch_snippet_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    [code] = re.findall(r"<!-- run: global-batch -->\n```python\n(.*?)```", readme, flags=re.S)
    for world, accum in (("8", 3), ("12", 2)):
        monkeypatch.setenv("WORLD_SIZE", world)
        scope: dict[str, object] = {}
        exec(code, scope)
        assert scope["accum"] == accum
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(ValueError, match="on 5 ranks"):
        exec(code, {})


@pytest.mark.parametrize(("scale", "size"), [(None, 32), ("1", 32), ("0.5", 16), ("0.25", 8), ("0.001", 1),
                                             ("nonsense", 32), ("3", 32), ("0", 32)])
def test_the_batch_hint_scales_the_batch_never_below_one(monkeypatch: pytest.MonkeyPatch, scale: str | None,
                                                           size: int) -> None:
    if scale is None:
        monkeypatch.delenv("STEAD_BATCH_SCALE", raising=False)
    else:
        monkeypatch.setenv("STEAD_BATCH_SCALE", scale)
    assert batch_size(32) == size
    with pytest.raises(ValueError, match="default=0 must be a positive whole number"):
        batch_size(0)
