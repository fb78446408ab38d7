"""Human-readable one-line renderings of events and job state (for the CLI)."""

from __future__ import annotations

import datetime
import enum

from stead.core.events import Record
from stead.core.events.log import BadRecord
from stead.core.serde import to_json
from stead.core.statemachine import JobState

__all__ = ["format_record", "format_status"]


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


def format_status(job: str, state: JobState) -> str:
    spec = state.spec
    lines = [f"job        {job}", f"phase      {state.phase.value}" + (f"  ({state.reason})" if state.reason else "")]
    if spec is not None:
        lines.append(f"shape      nodes {spec.min_nodes}:{spec.max_nodes} x {spec.nproc_per_node} proc")
    members = f"  members {', '.join(state.rdzv.members)}" if state.rdzv.members else ""
    lines.append(f"round      {state.rdzv.round}{members}")
    lines.append(f"step       {state.step if state.step is not None else '-'}")
    max_restarts = spec.max_restarts if spec else 0
    lines.append(f"restarts   {state.restarts} of {max_restarts}")
    if state.checkpoint_step is not None:
        lines.append(f"checkpoint step {state.checkpoint_step}")
    if state.deciders is not None:
        who = ", ".join(sorted(state.deciders)) or "none: stead's default policy decides"
        lines.append(f"deciders   {who}")
    for node_id, node in state.nodes.items():
        extra = f" exit={node.exit_code}" if node.exit_code is not None else ""
        extra += f" signal={node.signal}" if node.signal is not None else ""
        lines.append(f"node       {node_id:<10} {node.phase.value:<9} incarnation {node.incarnation}{extra}")
    if state.message:
        lines.append("error      " + state.message.strip().replace("\n", "\n           "))
    return "\n".join(lines)
