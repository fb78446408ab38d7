"""The fake kubelet's HTTP client of the API server: plain JSON over aiohttp, nothing of FakeKubeApi's.

A real kubelet is just another client of the API server; so is this one, which is why
it works against any server speaking the protocol. It is a thin layer (paths in, dicts
out) rather than kubernetes_asyncio, whose model (de)serialization would cost more than
the fake API server itself when hundreds of pods start at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

__all__ = ["KubeApiError", "KubeClient"]

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"


class KubeApiError(Exception):
    """A refused request: the HTTP status and the Status body's reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class KubeClient:
    """``async with KubeClient(url) as client:``; every method raises KubeApiError for a non-2xx answer."""

    def __init__(self, url: str, *, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeClient:
        # no connection limit: a burst of pods is a burst of concurrent requests, as with a real kubelet
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self._headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        assert self._session is not None, "use KubeClient as `async with`"
        data = None if body is None else json.dumps(body).encode()
        async with self._session.request(method, self.url + path, data=data, params=params,
                                         headers={"Content-Type": content_type}) as response:
            raw = await response.read()
            if response.status >= 300:
                raise _error(response.status, raw)
            return json.loads(raw) if raw else None

    async def get(self, path: str, **params: str) -> Any:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Obj) -> Any:
        return await self.request("POST", path, body=body)

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> Any:
        return await self.request("PATCH", path, body=body, content_type=content_type)

    async def delete(self, path: str, body: Obj | None = None) -> Any:
        return await self.request("DELETE", path, body=body)

    async def watch(self, path: str, **params: str) -> AsyncGenerator[Obj, None]:
        """The events of a watch (ERROR events included, as dicts) until the server ends the stream."""
        assert self._session is not None, "use KubeClient as `async with`"
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with self._session.get(self.url + path, params={"watch": "true", **params},
                                     timeout=timeout) as response:
            if response.status >= 300:
                raise _error(response.status, await response.read())
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)


def _error(status: int, raw: bytes) -> KubeApiError:
    try:
        body = json.loads(raw)
        return KubeApiError(status, str(body.get("reason", "")), str(body.get("message", raw[:200])))
    except ValueError:
        return KubeApiError(status, "", raw[:200].decode(errors="replace"))
