"""The fake kubelet's log endpoint, which the API server's ``pods/{name}/log`` proxies to.

A real API server does not store logs: it asks the kubelet of the pod's node at the port
the node advertises (``status.daemonEndpoints.kubeletEndpoint.Port``). The fake kubelet
serves ``/containerLogs/{namespace}/{pod}/{container}`` the same way, on loopback, with
``tailLines``, ``limitBytes`` and ``follow``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from aiohttp import web

__all__ = ["LogEndpoint", "LogSource"]

#: how often a followed log is read again for new lines
_FOLLOW_POLL_S = 0.05

#: (namespace, pod, container) -> (log file, whether the container still runs) or an error message
LogSource = Callable[[str, str, str], tuple[Path, Callable[[], bool]] | str]


class LogEndpoint:
    def __init__(self, source: LogSource) -> None:
        self._source = source
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> LogEndpoint:
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._serve)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        found = self._source(request.match_info["namespace"], request.match_info["pod"],
                             request.match_info["container"])
        if isinstance(found, str):
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": found,
                                      "reason": "BadRequest", "code": 400}, status=400)
        path, running = found
        data = path.read_bytes() if path.exists() else b""
        tail = request.query.get("tailLines")
        if tail is not None and tail.isdigit():
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(tail):]) if int(tail) else b""
        limit = request.query.get("limitBytes")
        if limit is not None and limit.isdigit():
            data = data[:int(limit)]
        if request.query.get("follow") not in ("true", "True", "1"):
            return web.Response(body=data, content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        offset = path.stat().st_size if path.exists() else 0
        while True:
            still_running = running()
            if path.exists() and path.stat().st_size > offset:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                await response.write(chunk)
            elif not still_running:
                break
            await asyncio.sleep(_FOLLOW_POLL_S)
        await response.write_eof()
        return response
