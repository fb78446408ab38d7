"""The API server's failures as Kubernetes ``Status`` bodies, with the real server's reasons and wording.

Every refusal of the fake API server is a :class:`KubeStatusError`; the HTTP layer turns it
into ``{"kind": "Status", "apiVersion": "v1", "status": "Failure", ...}`` with the code, so a
client sees exactly what a real cluster would send (``kubernetes_asyncio`` raises ``ApiException``
with that status and body, kopf maps the code to its own errors).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KubeStatusError", "already_exists", "bad_request", "conflict", "expired", "forbidden", "invalid",
           "method_not_allowed", "not_found", "status_body", "success_body", "too_large_resource_version",
           "unsupported_media_type"]


class KubeStatusError(Exception):
    """A request the API server refuses: ``code`` (HTTP), ``reason`` (``NotFound``, ``Conflict``, ...), ``details``."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def body(self) -> dict[str, Any]:
        return status_body(self.code, self.reason, self.message, self.details)


def status_body(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


def success_body(name: str, group: str, plural: str, uid: str) -> dict[str, Any]:
    """What a DELETE answers for kinds that do not return the deleted object."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": _details(name, group, plural) | {"uid": uid}}


def _details(name: str | None, group: str, kind: str) -> dict[str, Any]:
    details: dict[str, Any] = {"kind": kind}
    if name:
        details["name"] = name
    if group:
        details["group"] = group
    return details


def _qualified(group: str, plural: str) -> str:
    return f"{plural}.{group}" if group else plural


def not_found(group: str, plural: str, name: str) -> KubeStatusError:
    return KubeStatusError(404, "NotFound", f'{_qualified(group, plural)} "{name}" not found',
                           _details(name, group, plural))


def already_exists(group: str, plural: str, name: str) -> KubeStatusError:
    return KubeStatusError(409, "AlreadyExists", f'{_qualified(group, plural)} "{name}" already exists',
                           _details(name, group, plural))


def conflict(group: str, plural: str, name: str, why: str) -> KubeStatusError:
    return KubeStatusError(409, "Conflict",
                           f'Operation cannot be fulfilled on {_qualified(group, plural)} "{name}": {why}',
                           _details(name, group, plural))


def invalid(group: str, kind: str, name: str, causes: list[tuple[str, str]]) -> KubeStatusError:
    """422 Invalid: ``causes`` are ``(field, message)`` pairs such as ``("metadata.name", 'Invalid value: ...')``."""
    text = ", ".join(f"{field}: {message}" for field, message in causes)
    if len(causes) > 1:
        text = f"[{text}]"  # the real server's aggregate of several field errors
    cause_list = [{"reason": _cause_reason(message), "message": message, "field": field} for field, message in causes]
    return KubeStatusError(422, "Invalid", f'{kind}{"." + group if group else ""} "{name}" is invalid: {text}',
                           _details(name, group, kind) | {"causes": cause_list})


def _cause_reason(message: str) -> str:
    for prefix, reason in (("Required value", "FieldValueRequired"), ("Not found", "FieldValueNotFound"),
                           ("Duplicate value", "FieldValueDuplicate"), ("Forbidden", "FieldValueForbidden"),
                           ("Unsupported value", "FieldValueNotSupported")):
        if message.startswith(prefix):
            return reason
    return "FieldValueInvalid"


def bad_request(message: str) -> KubeStatusError:
    return KubeStatusError(400, "BadRequest", message)


def forbidden(group: str, plural: str, name: str | None, message: str) -> KubeStatusError:
    return KubeStatusError(403, "Forbidden", message, _details(name, group, plural))


def expired(message: str) -> KubeStatusError:
    return KubeStatusError(410, "Expired", message)


def too_large_resource_version(asked: int, current: int) -> KubeStatusError:
    return KubeStatusError(504, "Timeout", f"Too large resource version: {asked}, current: {current}",
                           {"causes": [{"reason": "ResourceVersionTooLarge",
                                        "message": "Too large resource version"}], "retryAfterSeconds": 1})


def method_not_allowed(method: str, what: str) -> KubeStatusError:
    return KubeStatusError(405, "MethodNotAllowed", f"the server does not allow this method on the requested "
                                                    f"resource ({method} {what})")


def unsupported_media_type(content_type: str, accepted: tuple[str, ...]) -> KubeStatusError:
    return KubeStatusError(415, "UnsupportedMediaType",
                           f"the body of the request was in an unknown format ({content_type or 'none'}) - "
                           f"accepted media types include: {', '.join(accepted)}")
