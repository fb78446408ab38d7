"""Server side of the error boundary: stead errors and bad input become gRPC statuses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.errors import InvalidRequest, RetryableError, Unauthenticated

__all__ = ["backend_errors", "invalid"]

log = structlog.get_logger()


def invalid(message: str) -> NoReturn:
    """Answer the call with INVALID_ARGUMENT; ``message`` names the field and says what to send."""
    raise GRPCError(Status.INVALID_ARGUMENT, message)


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
    except RetryableError as exc:
        log.warning("rpc_backend_unavailable", method=method, error=str(exc))
        raise GRPCError(Status.UNAVAILABLE, f"{method}: {exc}") from exc
    except Exception as exc:
        log.exception("rpc_backend_failed", method=method, error=str(exc))
        raise GRPCError(Status.INTERNAL, f"{method} failed in the master: {type(exc).__name__}: {exc}; "
                                         "the master's log has the traceback") from exc
