"""Label and field selectors, parsed once per request and matched against objects.

The syntax is the real API server's: label selectors ``a=b``, ``a==b``, ``a!=b``,
``a in (x,y)``, ``a notin (x,y)``, ``a``, ``!a``, comma-joined (all must hold); field
selectors ``path=value``, ``path==value``, ``path!=value`` over the fields a kind
supports (``metadata.name`` and ``metadata.namespace`` everywhere; pods add
``spec.nodeName``, ``status.phase`` and a few more). A malformed selector is a
:class:`SelectorError`, which the server answers with 400 BadRequest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FieldSelector", "LabelSelector", "SelectorError", "field_value", "supported_fields"]

_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_SET_TERM = re.compile(r"\s*(!?)\s*([^\s!=(),]+)\s*(?:(notin|in)\s*\(([^()]*)\))?\s*")
_EQ_TERM = re.compile(r"\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*")

#: fields every kind can be selected by, and the extra ones of some kinds (keyed by plural)
_COMMON_FIELDS = ("metadata.name", "metadata.namespace")
_KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "pods": ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
             "status.phase", "status.podIP", "status.nominatedNodeName"),
    "events": ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
               "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath",
               "reason", "reportingComponent", "source", "type"),
    "secrets": ("type",),
    "nodes": ("spec.unschedulable",),
    "namespaces": ("status.phase",),
}


class SelectorError(ValueError):
    """A selector that does not parse; the message says which part and what is accepted."""


@dataclass(frozen=True)
class _Requirement:
    key: str
    operator: str  # "in", "notin", "exists", "!"
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        match self.operator:
            case "in":
                return labels.get(self.key) in self.values
            case "notin":
                return labels.get(self.key) not in self.values
            case "exists":
                return self.key in labels
            case _:
                return self.key not in labels


@dataclass(frozen=True)
class LabelSelector:
    """``labelSelector``: every requirement must hold; the empty selector matches everything."""

    requirements: tuple[_Requirement, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        if not text or not text.strip():
            return cls()
        return cls(tuple(_parse_label_term(term, text) for term in _split_terms(text)))

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    def __bool__(self) -> bool:
        return bool(self.requirements)


def _split_terms(text: str) -> list[str]:
    """Split on the commas that are not inside ``( )``."""
    terms, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return terms


def _parse_label_term(term: str, text: str) -> _Requirement:
    hint = ("label selectors are comma-joined terms: key=value, key==value, key!=value, key in (a,b), "
            "key notin (a,b), key, !key")
    if not term.strip():
        raise SelectorError(f"unable to parse requirement: empty term in label selector {text!r}; {hint}")
    eq = _EQ_TERM.fullmatch(term)
    if eq is not None:
        key, op, value = eq.groups()
        _check_key(key, text)
        _check_value(value, text)
        return _Requirement(key, "notin" if op == "!=" else "in", frozenset({value}))
    setm = _SET_TERM.fullmatch(term)
    if setm is None:
        raise SelectorError(f"unable to parse requirement: {term.strip()!r} in label selector {text!r}; {hint}")
    bang, key, op, values = setm.groups()
    _check_key(key, text)
    if op is None:
        return _Requirement(key, "!" if bang else "exists", frozenset())
    if bang:
        raise SelectorError(f"unable to parse requirement: {term.strip()!r}: '!' only goes before a bare key; {hint}")
    items = [v.strip() for v in values.split(",")]
    if not items or any(not v for v in items):
        raise SelectorError(f"unable to parse requirement: {term.strip()!r}: for 'in', 'notin' operators, values "
                            f"set can't be empty and has no empty members")
    for v in items:
        _check_value(v, text)
    return _Requirement(key, op, frozenset(items))


def _check_key(key: str, text: str) -> None:
    name = key.rsplit("/", 1)[-1]
    if _LABEL_KEY.fullmatch(key) is None or len(name) > 63:
        raise SelectorError(f"unable to parse requirement: invalid label key {key!r} in selector {text!r}: a "
                            f"qualified name must consist of alphanumeric characters, '-', '_' or '.', and must "
                            f"start and end with an alphanumeric character, optionally prefixed by a DNS subdomain "
                            f"and '/'")
    # the prefix's length
    if "/" in key and len(key.rsplit("/", 1)[0]) > 253:
        raise SelectorError(f"unable to parse requirement: label key prefix of {key!r} is longer than 253 characters")


def _check_value(value: str, text: str) -> None:
    if _LABEL_VALUE.fullmatch(value) is None or len(value) > 63:
        raise SelectorError(f"unable to parse requirement: invalid label value {value!r} in selector {text!r}: a "
                            f"valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
                            f"'.', and must start and end with an alphanumeric character (at most 63 characters)")


def supported_fields(plural: str, custom: bool) -> tuple[str, ...]:
    return _COMMON_FIELDS + (() if custom else _KIND_FIELDS.get(plural, ()))


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string a field selector compares (``""`` for an absent field, ``"true"``/``"false"`` for booleans)."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if path == "source" and isinstance(value, Mapping):  # events: source.component
        value = value.get("component")
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


@dataclass(frozen=True)
class FieldSelector:
    """``fieldSelector``: ``(path, equal, value)`` terms that must all hold."""

    terms: tuple[tuple[str, bool, str], ...] = ()

    @classmethod
    def parse(cls, text: str | None, *, plural: str, custom: bool) -> FieldSelector:
        if not text or not text.strip():
            return cls()
        allowed = supported_fields(plural, custom)
        terms = []
        for term in _split_terms(text):
            match = re.fullmatch(r"\s*([^\s!=]+)\s*(==|=|!=)\s*([^,]*?)\s*", term)
            if match is None:
                raise SelectorError(f"invalid selector: {term.strip()!r} in field selector {text!r}; field "
                                    f"selectors are comma-joined path=value, path==value or path!=value terms")
            path, op, value = match.groups()
            if path not in allowed:
                raise SelectorError(f'"{path}" is not a known field selector: only "{", ".join(allowed)}" are '
                                    f"supported for {plural}")
            terms.append((path, op != "!=", value))
        return cls(tuple(terms))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        return all((field_value(obj, path) == value) == equal for path, equal, value in self.terms)

    def __bool__(self) -> bool:
        return bool(self.terms)
