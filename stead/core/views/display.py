"""Human-readable one-line renderings of events and job state (for the CLI)."""

from __future__ import annotations

import datetime
import enum
import json
from collections.abc import Iterable, Mapping

from stead.core.events import HealthChecked, Record
from stead.core.events.log import BadRecord
from stead.core.serde import to_json
from stead.core.statemachine import JobState
from stead.core.views.goodput import Ledger
from stead.core.views.recovery import RecoveryPhase

__all__ = ["format_record", "format_status", "goodput_lines", "last_diagnoses", "plugin_status_lines", "status_json"]


def _value(v: object) -> str:
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, (tuple, list)):
        return ",".join(_value(x) for x in v)
    text = str(v)
    if "\n" in text:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    return repr(text) if (" " in text or not text) else text


def format_record(item: Record | BadRecord) -> str:
    if isinstance(item, BadRecord):
        return f"{item.seq if item.seq is not None else '?':>6}  <unreadable record {item.key}: {item.error}>"
    when = datetime.datetime.fromtimestamp(item.at).strftime("%H:%M:%S.%f")[:-3]
    fields = to_json(item.event)
    shown = " ".join(f"{k}={_value(getattr(item.event, k))}" for k, v in fields.items()
                     if v not in (None, "", [], {}) and k != "job")
    return f"{item.seq:>6}  {when}  {item.event.type_name:<20} {shown}".rstrip()


def last_diagnoses(records: Iterable[Record]) -> dict[str, str]:
    """node id -> its last classified failure ("class (rule): evidence"), from any event that carries one."""
    found: dict[str, str] = {}
    for record in records:
        event = record.event
        if isinstance(event, HealthChecked):
            found.update((v.node_id, f"failed health check {event.check}: {v.reason}") for v in event.failed)
            continue
        node, failure_class = getattr(event, "node_id", None), getattr(event, "failure_class", "")
        if isinstance(node, str) and isinstance(failure_class, str) and failure_class:
            evidence = " ".join(str(getattr(event, "evidence", "")).split())
            found[node] = f"{failure_class} ({getattr(event, 'rule', '')}): {evidence[:200]}"
    return found


def plugin_status_lines(plugin: str, raw: bytes) -> list[str]:
    """The lines a plugin published for ``stead status`` (its ``status`` key: JSON with ``summary``, ``at``)."""
    try:
        status = json.loads(raw)
        lines = [str(line) for line in status.get("summary", [])]
        at = float(status.get("at", 0.0))
    except (ValueError, TypeError, AttributeError):
        return [f"{plugin}: (its status record is unreadable)"]
    when = datetime.datetime.fromtimestamp(at).strftime("%H:%M:%S") if at else "?"
    return [f"{plugin} (at {when}): {line}" for line in lines]


def goodput_lines(ledger: Ledger) -> list[str]:
    """The goodput and where the rest of the wall time went, for ``stead status``."""
    if ledger.wall_s <= 0:
        return ["goodput    - (no wall time yet)"]
    parts = ", ".join(f"{part} {seconds:.1f} s" for part, seconds in ledger.parts.items() if part != "useful"
                      and seconds >= 0.05)
    lines = [f"goodput    {ledger.goodput:.1%} of {ledger.wall_s:.1f} s{'' if ledger.ended else ' so far'}: "
             f"useful {ledger.parts['useful']:.1f} s" + (f"; {parts}" if parts else "")]
    if ledger.recoveries:
        phases = ", ".join(f"{p.value.replace('_', ' ')} {ledger.recovery_phases[p]:.2f} s" for p in RecoveryPhase)
        count = len(ledger.recoveries)
        lines.append(f"recovery   {count} {'recovery' if count == 1 else 'recoveries'}: {phases}")
        restored = next((r.restored for r in reversed(ledger.recoveries) if r.restored), "")
        if restored:
            lines.append(f"restored   last: {restored} (ranks by tier: own memory, a peer host's replica, disk)")
    lines += [f"           (not counted: {what})" for what in ledger.missing]
    return lines


def status_json(job: str, state: JobState, *, diagnoses: Mapping[str, str] | None = None,
                plugins: Iterable[str] = (), master: Mapping[str, object] | None = None,
                goodput: Ledger | None = None, numerics: Iterable[str] = (),
                warnings: Iterable[str] = ()) -> dict[str, object]:
    """What ``format_status`` shows, as one JSON object (``stead status --json``); the ledger's figures
    (``goodput`` 0..1, ``wall_s``, one ``<part>_s`` per part) at the top level."""
    spec = state.spec
    info = dict(master or {})
    return {
        "job": job, "phase": state.phase.value, "reason": state.reason,
        "min_nodes": spec.min_nodes if spec else None, "max_nodes": spec.max_nodes if spec else None,
        "target_nodes": state.target_nodes if spec else None,
        "nproc_per_node": spec.nproc_per_node if spec else None,
        "round": state.rdzv.round, "members": list(state.rdzv.members), "step": state.step,
        "restarts": state.restarts, "max_restarts": spec.max_restarts if spec else 0,
        "checkpoint_step": state.checkpoint_step,
        "health_check": spec.health_check if spec else None, "excluded_hosts": sorted(state.excluded_hosts),
        "nodes": {n: {"phase": s.phase.value, "incarnation": s.incarnation, "awaiting_health_check": s.unchecked,
                      "exit_code": s.exit_code,
                      "signal": s.signal, "last_failure": (diagnoses or {}).get(n)} for n, s in state.nodes.items()},
        "plugins": list(plugins), "skip_steps": sorted(state.skip_steps), "numerics": list(numerics),
        "warnings": list(warnings),
        "master_pid": info.get("pid"), "master_host": info.get("host"), "master_address": info.get("address"),
        "master_started_at": info.get("started_at"), "master_metrics": info.get("metrics"),
        "error": state.message or None,
        **(goodput.to_json() if goodput is not None else {}),
    }


def format_status(job: str, state: JobState, *, diagnoses: Mapping[str, str] | None = None,
                  plugins: Iterable[str] = (), goodput: Ledger | None = None, numerics: Iterable[str] = (),
                  warnings: Iterable[str] = ()) -> str:
    """``numerics``: the lines of :func:`stead.core.views.numerics.numerics_lines` (steps skipped, loss spikes);
    ``warnings``: those of :func:`stead.core.views.warnings.warning_lines` (Slurm's warnings before a stop)."""
    spec = state.spec
    lines = [f"job        {job}", f"phase      {state.phase.value}" + (f"  ({state.reason})" if state.reason else "")]
    if spec is not None:
        target = f", target {state.target_nodes}" if spec.min_nodes != spec.max_nodes else ""
        lines.append(f"shape      nodes {spec.min_nodes}:{spec.max_nodes}{target} x {spec.nproc_per_node} proc")
    members = f"  members {', '.join(state.rdzv.members)}" if state.rdzv.members else ""
    lines.append(f"round      {state.rdzv.round}{members}")
    lines.append(f"step       {state.step if state.step is not None else '-'}")
    max_restarts = spec.max_restarts if spec else 0
    lines.append(f"restarts   {state.restarts} of {max_restarts}")
    if state.checkpoint_step is not None:
        lines.append(f"checkpoint step {state.checkpoint_step}")
    if goodput is not None:
        lines += goodput_lines(goodput)
    if state.deciders is not None:
        who = ", ".join(sorted(state.deciders)) or "none: stead's default policy decides"
        lines.append(f"deciders   {who}")
    if spec is not None and spec.health_check != "off":
        running = (f"; check {state.health.check} running: {', '.join(state.health.nodes)}"
                   if state.health.running else "")
        excluded = f"; hosts excluded: {', '.join(sorted(state.excluded_hosts))}" if state.excluded_hosts else ""
        lines.append(f"health     {spec.health_check} nodes checked before they train{running}{excluded}")
    for node_id, node in state.nodes.items():
        extra = " (awaiting its health check)" if node.unchecked and node.phase.alive else ""
        extra += f" exit={node.exit_code}" if node.exit_code is not None else ""
        extra += f" signal={node.signal}" if node.signal is not None else ""
        lines.append(f"node       {node_id:<10} {node.phase.value:<9} incarnation {node.incarnation}{extra}")
        if diagnoses and node_id in diagnoses:
            lines.append(f"           last failure: {diagnoses[node_id]}")
    lines += [f"numerics   {line}" for line in numerics]
    lines += [f"warned     {line}" for line in warnings]
    lines += [f"plugin     {line}" for line in plugins]
    if state.message:
        lines.append("error      " + state.message.strip().replace("\n", "\n           "))
    return "\n".join(lines)
