"""Failure classification as data: a table of rules from what a failure shows to its class and action.

A failure's facts (exit code, signal, the last exception in its stderr tail, the
kernel's OOM record, GPU faults the agent saw, the platform's reason for a lost
node) are matched against the rules in order; the first rule whose every given
condition holds names the class, and the class names the action (a rule may
name its own). Users put their rules first with a TOML file
(``--set diagnosis.rules_file=rules.toml``); packages add theirs through the
``stead.diagnosis_rules`` entry-point group (an entry point names a sequence of
:class:`Rule` or a function returning one). Built-in rules come last.

A rules file::

    [actions]                      # optional: what a class leads to
    oom = "restart"

    [[rules]]
    name = "stale-nfs"             # every rule has a name: decisions say which one matched
    class = "transient"
    exception = "OSError"          # regular expression, matched against the whole exception type
    message = "Stale file handle"  # regular expression, searched in the exception's message

Conditions: ``on`` ("worker" or "node"), ``exception``, ``message``, ``tail`` (searched
in the whole stderr tail), ``exit_codes``, ``signals`` (names or numbers),
``oom_record`` and ``gpu_fault`` (true or false), ``platform_reason``.

A failure of an unknown cause that repeats is a bug: the same exception and message at the
same step (or, when no step is known, the same traceback twice in a row) ``after`` times is
decided as ``class`` (default: the second time, a user error, which fails). Only failures
of the classes in ``of`` count (default: transient, the unknown): a collective error that
repeats is the network still broken, an OOM that repeats still wants memory::

    [repeats]
    after = 3                      # 0: never
    class = "user_error"
    of = ["transient", "collective"]

Pure functions only: no IO except :func:`load_rules_file`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import signal as signals
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stead.core.entrypoints import load_group
from stead.plugin import (
    DETERMINISTIC,
    ConfigError,
    NodeExited,
    NodeLost,
    RecoveryAction,
    WorkerFailed,
    last_exception,
)

__all__ = ["BUILTIN_RULES", "DEFAULT_ACTIONS", "Action", "Classification", "Facts", "FailureClass", "Repeats", "Rule",
           "RuleSet", "classify", "installed_rules", "load_repeats", "load_rules_file", "rules_from_entry_point"]

E = TypeVar("E", bound=enum.Enum)

#: the entry-point group through which packages add rules
RULES_GROUP = "stead.diagnosis_rules"


class FailureClass(enum.Enum):
    USER_ERROR = "user_error"
    OOM = "oom"
    HARDWARE = "hardware"
    NODE_LOST = "node_lost"
    COLLECTIVE = "collective"
    TRANSIENT = "transient"
    #: a NaN or Inf, a loss spike, or replicas whose parameters differ, caught by stead.numerics: the step was not
    #: applied (or not saved); restored from the last committed checkpoint (a replica that differs: its node relaunched
    #: elsewhere), and the step's batch skipped as numerics.on_nan / numerics.loss_spike say
    NUMERICAL = "numerical"


class Action(enum.Enum):
    """What diagnosis does about a class of failure."""

    FAIL = "fail"
    RESTART = "restart"
    #: replace the node and keep its host out (a faulty GPU), then restart the round
    RELAUNCH = "relaunch"
    #: ask the scaler for more memory for the node; the round restarts meanwhile
    MORE_MEMORY = "more_memory"

    @property
    def recovery(self) -> RecoveryAction:
        return {Action.FAIL: RecoveryAction.FAIL, Action.RELAUNCH: RecoveryAction.RELAUNCH}.get(
            self, RecoveryAction.RESTART)


DEFAULT_ACTIONS: Mapping[FailureClass, Action] = {
    FailureClass.USER_ERROR: Action.FAIL,
    FailureClass.OOM: Action.MORE_MEMORY,
    FailureClass.HARDWARE: Action.RELAUNCH,
    FailureClass.NODE_LOST: Action.RELAUNCH,
    FailureClass.COLLECTIVE: Action.RESTART,
    FailureClass.TRANSIENT: Action.RESTART,
    FailureClass.NUMERICAL: Action.RESTART,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Facts:
    """What one failure shows: of a worker (``on="worker"``) or of a whole node (``on="node"``)."""

    on: str = "worker"
    exit_code: int | None = None
    signal: int | None = None
    exception: str = ""
    message: str = ""
    tail: str = ""
    oom: str = ""
    gpu: str = ""
    platform_reason: str = ""

    @classmethod
    def of_worker(cls, failure: WorkerFailed) -> Facts:
        exc = last_exception(failure.error_tail)
        return cls(on="worker", exit_code=failure.exit_code, signal=failure.signal, exception=exc[0] if exc else "",
                   message=exc[1] if exc else "", tail=failure.error_tail, oom=failure.oom, gpu=failure.gpu)

    @classmethod
    def of_node(cls, event: NodeLost | NodeExited) -> Facts:
        if isinstance(event, NodeLost):
            return cls(on="node", platform_reason=event.reason)
        return cls(on="node", exit_code=event.exit_code, signal=event.signal, platform_reason=event.reason)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of the table: every condition given must hold (an empty condition is not checked)."""

    name: str
    failure_class: FailureClass
    #: overrides the class's action for this rule
    action: Action | None = None
    on: str = ""
    exception: re.Pattern[str] | None = None
    message: re.Pattern[str] | None = None
    tail: re.Pattern[str] | None = None
    exit_codes: frozenset[int] = frozenset()
    signals: frozenset[int] = frozenset()
    oom_record: bool | None = None
    gpu_fault: bool | None = None
    platform_reason: re.Pattern[str] | None = None

    def match(self, facts: Facts) -> str | None:
        """What the rule matched on (its evidence), or None when a condition does not hold."""
        found: list[str] = []
        if self.on and facts.on != self.on:
            return None
        if self.exception is not None:
            if not facts.exception or not self.exception.fullmatch(facts.exception):
                return None
            found.append(f"{facts.exception}: {facts.message}" if facts.message else facts.exception)
        if self.message is not None:
            hit = self.message.search(facts.message)
            if hit is None:
                return None
            if self.exception is None:
                found.append(f"{facts.exception}: {facts.message}")
        if self.tail is not None:
            hit = self.tail.search(facts.tail)
            if hit is None:
                return None
            found.append(_line_of(facts.tail, hit.start()))
        if self.exit_codes:
            if facts.exit_code not in self.exit_codes:
                return None
            found.append(f"exit code {facts.exit_code}")
        if self.signals:
            if facts.signal not in self.signals:
                return None
            found.append(f"killed by {_signal_name(facts.signal)}")
        if self.oom_record is not None:
            if bool(facts.oom) is not self.oom_record:
                return None
            if facts.oom:
                found.append(facts.oom)
        if self.gpu_fault is not None:
            if bool(facts.gpu) is not self.gpu_fault:
                return None
            if facts.gpu:
                found.append(facts.gpu)
        if self.platform_reason is not None:
            if not self.platform_reason.search(facts.platform_reason):
                return None
            found.append(f"platform: {facts.platform_reason}")
        return "; ".join(dict.fromkeys(f for f in found if f))


@dataclasses.dataclass(frozen=True)
class Repeats:
    """How a failure that repeats is decided: as ``failure_class`` at its ``after``-th occurrence (0: never)."""

    after: int = 2
    failure_class: FailureClass = FailureClass.USER_ERROR
    #: the classes whose failures count as repeats (a NaN at the same step after a restore comes from the data or
    #: the code, not the machine)
    of: frozenset[FailureClass] = frozenset({FailureClass.TRANSIENT, FailureClass.NUMERICAL})
    #: the rule name decisions on a repeat give
    rule: str = "repeated-failure"


@dataclasses.dataclass(frozen=True)
class Classification:
    failure_class: FailureClass
    action: Action
    rule: str
    evidence: str


@dataclasses.dataclass(frozen=True)
class RuleSet:
    """The rules in the order they are tried, and the action of each class."""

    rules: tuple[Rule, ...]
    actions: Mapping[FailureClass, Action] = dataclasses.field(default_factory=lambda: dict(DEFAULT_ACTIONS))

    def classify(self, facts: Facts) -> Classification:
        return classify(facts, self.rules, self.actions)


def classify(facts: Facts, rules: Iterable[Rule], actions: Mapping[FailureClass, Action] = DEFAULT_ACTIONS,
             ) -> Classification:
    """The first rule that matches ``facts`` (the built-in fallbacks always do)."""
    for rule in (*rules, *_FALLBACKS):
        evidence = rule.match(facts)
        if evidence is not None:
            action = rule.action or actions.get(rule.failure_class, DEFAULT_ACTIONS[rule.failure_class])
            return Classification(rule.failure_class, action, rule.name, evidence or _describe(facts))
    raise AssertionError("the fallback rules match every failure")  # pragma: no cover


def _describe(facts: Facts) -> str:
    """What a failure showed, for a rule that matched on nothing in particular (a fallback)."""
    shown = [f"{facts.exception}: {facts.message}" if facts.message else facts.exception,
             f"platform: {facts.platform_reason}" if facts.platform_reason else "",
             f"killed by {_signal_name(facts.signal)}" if facts.signal is not None else "",
             f"exit code {facts.exit_code}" if facts.exit_code is not None else ""]
    return "; ".join(s for s in shown if s) or "no exit code, signal or error message"


def _line_of(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start:end if end >= 0 else len(text)].strip()[:500]


def _signal_name(number: int | None) -> str:
    try:
        return signals.Signals(number).name if number is not None else "no signal"
    except ValueError:
        return f"signal {number}"


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


#: errors that a restart reproduces (the default policy's list): the program is wrong, not the world
_USER_ERRORS = "|".join(sorted(DETERMINISTIC))

BUILTIN_RULES: tuple[Rule, ...] = (
    Rule(name="gpu-fault", failure_class=FailureClass.HARDWARE, gpu_fault=True),
    Rule(name="kernel-oom-kill", failure_class=FailureClass.OOM, oom_record=True),
    Rule(name="torch-out-of-memory", failure_class=FailureClass.OOM, exception=_rx("OutOfMemoryError")),
    Rule(name="cuda-out-of-memory", failure_class=FailureClass.OOM, tail=_rx(r"CUDA out of memory")),
    Rule(name="allocation-refused", failure_class=FailureClass.OOM,
         tail=_rx(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)|std::bad_alloc")),
    Rule(name="python-memory-error", failure_class=FailureClass.OOM, exception=_rx("MemoryError")),
    Rule(name="platform-oom-killed", failure_class=FailureClass.OOM, platform_reason=_rx(r"\bOOMKilled\b")),
    Rule(name="non-finite-gradient", failure_class=FailureClass.NUMERICAL, exception=_rx(r"NonFiniteGradientError")),
    Rule(name="loss-spike", failure_class=FailureClass.NUMERICAL, exception=_rx(r"LossSpikeError")),
    Rule(name="replica-mismatch-unattributed", failure_class=FailureClass.NUMERICAL,
         exception=_rx(r"ReplicaMismatchError"), message=_rx(r"no replica can be blamed")),
    Rule(name="replica-mismatch", failure_class=FailureClass.NUMERICAL, action=Action.RELAUNCH,
         exception=_rx(r"ReplicaMismatchError")),
    Rule(name="deterministic-python-error", failure_class=FailureClass.USER_ERROR, exception=_rx(_USER_ERRORS)),
    Rule(name="nccl-error", failure_class=FailureClass.COLLECTIVE,
         tail=_rx(r"NCCL (error|WARN)|nccl(System|Internal|Remote|Invalid\w*)Error|ProcessGroupNCCL.*(timeout|Timeout)"
                  r"|Watchdog caught collective operation timeout")),
    Rule(name="gloo-error", failure_class=FailureClass.COLLECTIVE,
         tail=_rx(r"[Gg]loo.*([Cc]onnection (reset|closed|refused)|[Tt]imed out|[Tt]imeout|connect: )"
                  r"|Connection reset by peer|Connection closed by peer|DistBackendError|DistNetworkError"
                  r"|DistStoreError|Socket Timeout")),
    Rule(name="cuda-or-nvml-error", failure_class=FailureClass.HARDWARE,
         tail=_rx(r"uncorrectable ECC error|CUDA error: (unspecified launch failure|an? \w+ ECC)|"
                  r"GPU is lost|NVML_ERROR_GPU_IS_LOST|cudaErrorDevicesUnavailable|NVRM: Xid|"
                  r"CUDA driver (version is insufficient|error)|RuntimeError: No CUDA GPUs are available")),
)

#: always last: a failure matched by nothing above
_FALLBACKS: tuple[Rule, ...] = (
    Rule(name="node-lost", failure_class=FailureClass.NODE_LOST, on="node"),
    Rule(name="killed-by-signal", failure_class=FailureClass.TRANSIENT,
         signals=frozenset(int(s) for s in signals.Signals)),
    Rule(name="unknown", failure_class=FailureClass.TRANSIENT),
)

_CONDITIONS = {"name", "class", "action", "on", "exception", "message", "tail", "exit_codes", "signals",
               "oom_record", "gpu_fault", "platform_reason"}


def rule_from_mapping(raw: Mapping[str, Any], *, where: str) -> Rule:
    """A rule from a rules file's table; a ConfigError that names ``where`` and the problem."""
    unknown = sorted(set(raw) - _CONDITIONS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; a rule takes {sorted(_CONDITIONS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: every rule needs a name (a string): decisions say which rule matched")
    where = f"{where} ({name!r})"
    failure_class = _enum(FailureClass, raw.get("class"), where=where, key="class")
    action = _enum(Action, raw["action"], where=where, key="action") if "action" in raw else None
    on = raw.get("on", "")
    if on not in ("", "worker", "node"):
        raise ConfigError(f"{where}: on = {on!r}; use \"worker\" or \"node\" (or leave it out for both)")

    def pattern(key: str) -> re.Pattern[str] | None:
        value = raw.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a regular expression (a string), not {value!r}")
        try:
            return re.compile(value)
        except re.error as exc:
            raise ConfigError(f"{where}: {key} = {value!r} is not a valid regular expression: {exc}") from exc

    def flag(key: str) -> bool | None:
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, not {value!r}")
        return value

    exit_codes = raw.get("exit_codes", [])
    if not isinstance(exit_codes, list) or not all(isinstance(c, int) and not isinstance(c, bool)
                                                   for c in exit_codes):
        raise ConfigError(f"{where}: exit_codes must be a list of integers, not {exit_codes!r}")
    return Rule(name=name, failure_class=failure_class, action=action, on=on, exception=pattern("exception"),
                message=pattern("message"), tail=pattern("tail"), exit_codes=frozenset(exit_codes),
                signals=_signals(raw.get("signals", []), where=where), oom_record=flag("oom_record"),
                gpu_fault=flag("gpu_fault"), platform_reason=pattern("platform_reason"))


def _enum(kind: type[E], value: object, *, where: str, key: str) -> E:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{where}: {key} = {value!r}; use one of {choices}") from None


def _signals(values: object, *, where: str) -> frozenset[int]:
    if not isinstance(values, list):
        raise ConfigError(f"{where}: signals must be a list of names (\"SIGKILL\") or numbers, not {values!r}")
    numbers = set()
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            numbers.add(value)
            continue
        try:
            numbers.add(int(signals.Signals[str(value).upper()]))
        except KeyError:
            raise ConfigError(f"{where}: {value!r} is not a signal name (SIGKILL, SIGSEGV, ...)") from None
    return frozenset(numbers)


def _read_rules_file(path: str | Path) -> dict[str, Any]:
    where = str(path)
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"diagnosis rules file {where} cannot be read: {exc.strerror or exc}; fix "
                          "diagnosis.rules_file") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"diagnosis rules file {where} is not valid TOML: {exc}") from exc
    unknown = sorted(set(raw) - {"rules", "actions", "repeats"})
    if unknown:
        raise ConfigError(f"diagnosis rules file {where}: unknown table(s) {unknown}; it has [[rules]], [actions] "
                          "and [repeats]")
    return raw


def load_repeats(path: str | Path) -> Repeats:
    """The ``[repeats]`` table of a rules file (the defaults where it has none); a ConfigError saying what is wrong."""
    where = f"diagnosis rules file {path}: [repeats]"
    raw = _read_rules_file(path).get("repeats", {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table: after = N, class = \"user_error\"")
    unknown = sorted(set(raw) - {"after", "class", "of"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; it takes after, class and of")
    after = raw.get("after", Repeats.after)
    if not isinstance(after, int) or isinstance(after, bool) or after < 0 or after == 1:
        raise ConfigError(f"{where}: after = {after!r}; use the occurrence that decides (2 or more), or 0 for never")
    failure_class = _enum(FailureClass, raw.get("class", Repeats.failure_class.value), where=where, key="class")
    of = raw.get("of", [c.value for c in Repeats.of])
    if not isinstance(of, list):
        raise ConfigError(f"{where}: of = {of!r}; a list of classes, e.g. [\"transient\"]")
    return Repeats(after=after, failure_class=failure_class,
                   of=frozenset(_enum(FailureClass, c, where=where, key="of") for c in of))


def load_rules_file(path: str | Path) -> tuple[tuple[Rule, ...], dict[FailureClass, Action]]:
    """The rules and class actions of a TOML rules file; a ConfigError saying what is wrong and where."""
    where = str(path)
    raw = _read_rules_file(path)
    rules_raw = raw.get("rules", [])
    if not isinstance(rules_raw, list) or not all(isinstance(r, dict) for r in rules_raw):
        raise ConfigError(f"diagnosis rules file {where}: write each rule as a [[rules]] table")
    rules = tuple(rule_from_mapping(r, where=f"{where}: rule {i + 1}") for i, r in enumerate(rules_raw))
    actions_raw = raw.get("actions", {})
    if not isinstance(actions_raw, dict):
        raise ConfigError(f"diagnosis rules file {where}: [actions] maps a class to an action")
    actions = {_enum(FailureClass, c, where=f"{where}: [actions]", key="class"):
               _enum(Action, a, where=f"{where}: [actions]", key=str(c)) for c, a in actions_raw.items()}
    return rules, actions


def installed_rules() -> tuple[Rule, ...]:
    """The rules every installed package adds through :data:`RULES_GROUP` (one that fails to load is skipped)."""
    found = load_group(RULES_GROUP, what="diagnosis rules", validate=lambda name, obj, _where:
                       rules_from_entry_point(name, obj))
    return tuple(rule for rules in found for rule in rules)


def rules_from_entry_point(name: str, loaded: object) -> tuple[Rule, ...]:
    """The rules an entry point of :data:`RULES_GROUP` gives: a sequence of Rule, or a function returning one."""
    value = loaded() if callable(loaded) and not isinstance(loaded, Rule) else loaded
    if isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(r, Rule) for r in value):
        return tuple(value)
    raise ConfigError(f"entry point {name!r} of {RULES_GROUP} gave {type(value).__name__}: it must name a sequence "
                      "of stead.plugins.diagnosis.rules.Rule, or a function returning one")
