"""Server side of the error boundary: stead errors and bad input become gRPC statuses."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NoReturn

import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.errors import InvalidRequest, Overloaded, RetryableError, Unauthenticated
from stead.core.rpc._refusals import Refusal

__all__ = ["at_least", "backend_errors", "finite_figure", "invalid"]

log = structlog.get_logger()


def invalid(message: str) -> NoReturn:
    """Answer the call with INVALID_ARGUMENT; ``message`` names the field and says what to send."""
    raise GRPCError(Status.INVALID_ARGUMENT, message)


def at_least(field: str, value: int | None, minimum: int, meaning: str) -> None:
    """INVALID_ARGUMENT unless ``value`` is at least ``minimum`` (None: an optional field left unset, which is
    fine); ``field`` is its path (``FailureReport.rank``), ``meaning`` why the bound holds."""
    if value is not None and value < minimum:
        invalid(f"{field} is {value}: it must be at least {minimum} ({meaning})")


def finite_figure(field: str, value: float | None, unit: str) -> None:
    """INVALID_ARGUMENT unless ``value`` is unset, or finite and >= 0 (a duration, a percentage, a time)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        invalid(f"{field} is {value!r}: send a finite {unit} >= 0, or leave it unset")


@contextlib.contextmanager
def backend_errors(method: str) -> Iterator[None]:
    """Map what the backend raised inside the block to the status the client will see."""
    try:
        yield
    except GRPCError:
        raise
    except InvalidRequest as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from exc
    except Unauthenticated as exc:
        raise GRPCError(Status.UNAUTHENTICATED, str(exc)) from exc
    except Overloaded as exc:  # not logged per call: a storm of them is what shedding is for
        raise GRPCError(Status.RESOURCE_EXHAUSTED, f"{method}: {exc} (retry after {exc.retry_after_s:.2f} s)",
                        Refusal(retry_after_s=exc.retry_after_s)) from exc
    except RetryableError as exc:
        log.warning("rpc_backend_unavailable", method=method, error=str(exc))
        raise GRPCError(Status.UNAVAILABLE, f"{method}: {exc}") from exc
    except Exception as exc:
        log.exception("rpc_backend_failed", method=method, error=str(exc))
        raise GRPCError(Status.INTERNAL, f"{method} failed in the master: {type(exc).__name__}: {exc}; "
                                         "the master's log has the traceback") from exc
