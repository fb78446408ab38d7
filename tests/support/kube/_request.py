"""Reading a request to the fake API server: its JSON body, its query parameters, its DeleteOptions.

The real server's parsing rules, in one place: booleans as Go's ``strconv.ParseBool``
reads them (kubernetes_asyncio sends ``True``), integers refused with a 400 that names
the parameter, bodies refused with 415 for a media type the verb does not accept, and
delete options merged from the body and the query as the real handler does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tests.support.kube import _errors as errors
from tests.support.kube._store import DeleteOptions

__all__ = ["delete_options", "flag", "int_param", "options_from", "parse_version", "read_json"]


async def read_json(request: web.Request, accepted: tuple[str, ...]) -> Any:
    content_type = request.content_type
    if request.method == "PATCH":
        if content_type not in accepted:
            raise errors.unsupported_media_type(content_type, accepted)
    elif content_type not in (*accepted, "application/octet-stream", "*/*", ""):
        raise errors.unsupported_media_type(content_type, accepted)
    raw = await request.read()
    try:
        return json.loads(raw) if raw else None
    except ValueError as exc:
        raise errors.bad_request(f"the request body is not valid JSON ({exc}); send a JSON object") from None


def flag(query: Mapping[str, str], name: str) -> bool:
    """A boolean query parameter, read as Go's strconv.ParseBool reads it (kubernetes_asyncio sends ``True``)."""
    return query.get(name, "") in ("1", "t", "T", "true", "TRUE", "True")


def int_param(query: Mapping[str, str], name: str) -> int | None:
    value = query.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise errors.bad_request(f"{name}={value!r} is not an integer") from None


def parse_version(version: str) -> int:
    try:
        number = int(version)
    except ValueError:
        number = -1
    if number < 0:
        raise errors.bad_request(f"invalid resource version {version!r}: pass a resourceVersion this server "
                                 f"returned (a string of digits), or none")
    return number


async def delete_options(request: web.Request) -> DeleteOptions:
    raw = await request.read()
    body: Any = {}
    if raw:
        try:
            body = json.loads(raw)
        except ValueError:
            raise errors.bad_request("the DeleteOptions body is not valid JSON") from None
    return options_from(body if isinstance(body, dict) else {}, request.query)


def options_from(body: Mapping[str, Any], query: Mapping[str, str]) -> DeleteOptions:
    grace = body.get("gracePeriodSeconds", int_param(query, "gracePeriodSeconds"))
    propagation = body.get("propagationPolicy") or query.get("propagationPolicy")
    orphan = body.get("orphanDependents", query.get("orphanDependents"))
    if propagation is None and orphan in (True, "true"):
        propagation = "Orphan"
    if propagation not in (None, "Orphan", "Background", "Foreground"):
        raise errors.bad_request(f'propagationPolicy {propagation!r} is not supported: use "Orphan", "Background" '
                                 f'or "Foreground"')
    preconditions = body.get("preconditions") or {}
    return DeleteOptions(grace_period_s=None if grace is None else int(grace), propagation=propagation,
                         uid=preconditions.get("uid"), resource_version=preconditions.get("resourceVersion"))
