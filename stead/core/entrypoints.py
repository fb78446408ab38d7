"""The one way stead finds its extensions: Python entry points, with the same rules for every group.

Groups: ``stead.plugins`` (master plugins), ``stead.platforms``, ``stead.stores``
(by URL scheme), ``stead.agent_extensions`` (node side of plugins). stead's own
extensions register through its pyproject exactly as a third party would;
``builtin`` names a fallback for running from a source tree that was not
installed.

The rules:

* an extension named explicitly (``--plugins x``, ``--platform x``, a store URL's
  scheme) must be installed and must load: otherwise :class:`ConfigError` naming
  what is installed, or :class:`PluginError` naming the entry point and the error;
* an extension found but not asked for (every installed plugin, when no list is
  given) that fails to load is logged with its error and skipped: an unused
  broken package never stops a job;
* names disabled by the user are never loaded;
* what is loaded is checked at once by the caller's ``validate``, not when first
  used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

import structlog

from stead.core.errors import ConfigError, PluginError

__all__ = ["Found", "installed", "load_group", "load_named"]

log = structlog.get_logger("stead.entrypoints")

T = TypeVar("T")
#: (name, the object the entry point names, where it came from)
Found = tuple[str, object, str]


def installed(group: str, builtin: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every name of ``group`` and the ``module:attr`` it points to (installed entry points win)."""
    found = dict(builtin or {})
    found.update({ep.name: ep.value for ep in entry_points(group=group)})
    return dict(sorted(found.items()))


def _load(group: str, name: str, value: str) -> object:
    for ep in entry_points(group=group):
        if ep.name == name:
            return ep.load()
    module, _, attr = value.partition(":")
    obj: object = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def load_named(group: str, name: str, *, what: str, builtin: Mapping[str, str] | None = None,
               hint: str = "") -> Found:
    """The extension ``name`` of ``group``, which the user asked for: it must be installed and load."""
    names = installed(group, builtin)
    if name not in names:
        raise ConfigError(f"{what} {name!r} is not installed (installed: {', '.join(names) or 'none'})"
                          f"{'; ' + hint if hint else ''}")
    try:
        return name, _load(group, name, names[name]), names[name]
    except Exception as exc:
        raise ConfigError(f"{what} {name!r} ({names[name]}) failed to load: {exc!r}; reinstall the package that "
                          f"provides it, fix it, or do not use it") from exc


def load_group(group: str, *, what: str, enabled: Sequence[str] | None = None, disabled: Iterable[str] = (),
               builtin: Mapping[str, str] | None = None,
               validate: Callable[[str, object, str], T] | None = None) -> list[T]:
    """Load ``enabled`` (each must load) or, when None, every installed one that loads (others are skipped)."""
    off = set(disabled)
    names = installed(group, builtin)
    if enabled is not None:
        unknown = [n for n in enabled if n not in names]
        if unknown:
            raise ConfigError(f"{what}(s) {', '.join(map(repr, unknown))} not installed (installed: "
                              f"{', '.join(names) or 'none'}); install the package that provides them or "
                              "leave them out")
    wanted = [n for n in (enabled if enabled is not None else names) if n not in off]
    loaded: list[T] = []
    for name in wanted:
        try:
            found = load_named(group, name, what=what, builtin=builtin)
            loaded.append(validate(*found) if validate is not None else found)  # type: ignore[arg-type]
        except (ConfigError, PluginError) as exc:
            if enabled is not None:
                raise
            log.warning(f"{what.replace(' ', '_')}_skipped", name=name, entry_point=names[name], error=str(exc))
    return loaded


def entry_point_of(group: str, name: str) -> EntryPoint | None:
    return next((ep for ep in entry_points(group=group) if ep.name == name), None)
