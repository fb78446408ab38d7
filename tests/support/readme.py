"""The files the README shows: a ``<!-- file: PATH -->`` line followed by a fenced block. Tests run them as written."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["README", "readme_files"]

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_files() -> dict[str, str]:
    """PATH -> the text of the block that follows its ``<!-- file: PATH -->`` line."""
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", README.read_text(), flags=re.S)
    return {path: body for path, body in blocks}
