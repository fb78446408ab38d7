"""torchrun's error file as the agent reads it: what torch's @record writes, and what it must survive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from stead.core.agent.errorfile import ERROR_FILE_ENV, error_file_path, read_error_file


def test_what_torchs_error_handler_writes_is_read_back_as_the_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = error_file_path(tmp_path, 2, 1)
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    try:
        raise ValueError("warmup_steps=-3 must not be negative")
    except ValueError as exc:
        ErrorHandler().record_exception(exc)
    text = read_error_file(path)
    assert text.startswith("[error file error-round2-rank1.json, written by torch's @record at ")
    assert "Traceback (most recent call last):" in text
    assert text.rstrip().endswith("ValueError: warmup_steps=-3 must not be negative")


@pytest.mark.parametrize(("content", "expected"), [
    ('{"message": "RuntimeError: an older torch wrote a string"}', "RuntimeError: an older torch wrote a string"),
    ('{"message": {"message": "KeyError: 3", "extraInfo": {"timestamp": "x"}}}', "KeyError: 3"),
    ("not json", ""),
    ('{"message": 7}', ""),
    ("[1, 2]", ""),
    ('{"message": {"message": "", "extraInfo": {"py_callstack": "  "}}}', ""),
])
def test_a_file_that_is_not_as_torch_writes_it_gives_what_it_can_or_nothing(tmp_path: Path, content: str,
                                                                             expected: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content)
    assert (expected in read_error_file(path)) if expected else read_error_file(path) == ""


def test_no_file_and_a_huge_one_give_nothing_and_each_round_starts_without_one(tmp_path: Path) -> None:
    assert read_error_file(tmp_path / "absent.json") == ""
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"message": "x" * (2 << 20)}))
    assert read_error_file(huge) == ""
    stale = error_file_path(tmp_path, 3, 0)
    stale.write_text('{"message": "ValueError: from round 3"}')
    assert not error_file_path(tmp_path, 3, 0).exists()  # the path is handed out fresh: an old file is removed
