"""What every framework integration needs: a version check and the random number generators' state as values a
flash checkpoint can hold (tensors, tuples, ints: no numpy arrays, no pickle)."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any, Self

import numpy as np
import torch

from stead.plugins.ckpt.errors import CheckpointError, StateMismatch
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["AFRESH", "FlashOwner", "IntegrationError", "check_header", "first_few", "python_rng_words", "release",
           "require_version", "rng_state", "set_rng_state"]


class IntegrationError(CheckpointError):
    """A framework, a checkpoint or a setting that an integration cannot work with; the message says what to do."""


def release(version: str) -> tuple[int, ...]:
    """``"5.24.0.dev0"`` -> ``(5, 24, 0)``: the numeric release, which is all a supported range speaks of."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        raise IntegrationError(f"cannot read the version {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def require_version(package: str, version: str, *, at_least: str, below: str, extra: str) -> None:
    """Refuse a framework ``version`` outside ``[at_least, below)``, naming both and the extra to install."""
    have = release(version)
    if not release(at_least) <= have < release(below):
        raise IntegrationError(
            f"stead's {package} integration supports {package} >={at_least},<{below}; this environment has "
            f"{package} {version}: install a supported one (pip install 'stead[{extra}]') or run without "
            f"stead.integrations.{extra}")


class FlashOwner:
    """What an integration's ``FlashState`` shares: the flash checkpointer it saves through (made as ``stead.ckpt``
    makes one unless given), waiting for its persists, and closing it (also as a context manager)."""

    def __init__(self, flash: FlashCheckpointer | None) -> None:
        self._flash = flash if flash is not None else FlashCheckpointer()

    @property
    def flash(self) -> FlashCheckpointer:
        """The flash checkpointer underneath (its ``mode``, ``wait_persisted``)."""
        return self._flash

    def wait_persisted(self, timeout: float | None = None) -> int | None:
        return self._flash.wait_persisted(timeout)

    def close(self) -> None:
        self._flash.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: what to do with a checkpoint that does not fit, to start over
AFRESH = "Start the job under a new name (or remove its checkpoints) to start afresh"


def check_header(saved: Any, *, integration: str, package: str, layout: int,
                 supported: tuple[str, str]) -> Mapping[str, Any]:
    """The header (``saved["format"]``) of a checkpoint saved by ``integration``'s FlashState at ``layout``, with
    ``package`` at a supported version; StateMismatch (nothing loaded) naming what does not fit."""
    header = saved.get("format") if isinstance(saved, Mapping) else None
    if not isinstance(header, Mapping) or header.get("integration") != integration:
        raise StateMismatch(f"the checkpoint was not saved by stead.integrations.{integration}.FlashState; nothing "
                            f"was loaded. {AFRESH}")
    version = str(header.get(package))
    if header.get("version") != layout:
        raise StateMismatch(f"the checkpoint has FlashState layout {header.get('version')} ({package} {version}), "
                            f"this stead reads layout {layout}; nothing was loaded. Resume it with the stead that "
                            "saved it, or start the job under a new name")
    try:
        require_version(package, version, at_least=supported[0], below=supported[1], extra=package)
    except IntegrationError:
        raise StateMismatch(f"the checkpoint was saved with {package} {version}, outside the supported "
                            f">={supported[0]},<{supported[1]}; nothing was loaded. {AFRESH}") from None
    return header


def first_few(names: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``names`` for an error message, and how many more there are."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's and torch's (CPU and every CUDA device's) generator states, as checkpointable values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        # Mersenne Twister's 625 words as one tensor: as a tuple each would be a node of the checkpoint's tree
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
        "numpy": (str(kind), torch.from_numpy(np.asarray(keys).copy()), int(pos), int(has_gauss), float(cached)),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Give back what :func:`rng_state` took."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), python_rng_words(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((str(kind), keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def python_rng_words(internal: Any) -> tuple[int, ...]:
    """Python's generator state words, from a tensor (as saved) or a sequence (as Python gives them)."""
    return tuple(int(x) for x in (internal.tolist() if isinstance(internal, torch.Tensor) else internal))
