"""Node health checks, as data: who is checked, with whom, and the verdict. Pure.

A node that joins may have to pass a health check before it trains (``JobSubmitted.health_check``:
``off``, ``relaunched`` nodes only, or ``all``). The nodes waiting for one are checked together,
with one node that already trains as a partner when a single node waits. Each node times a
matmul, then all-reduces with one partner per stage (:func:`stages`): neighbours first, then the
slowest with the fastest, so that a collective that fails with one partner is tried with another.

The verdict (:func:`judge`) fails a node whose check broke or never came, whose matmul took more
than ``slow_factor`` times the median of the other nodes', or whose collectives all failed while
a partner of its own worked with someone else (or already trains); a pair of new nodes that only
ever failed together fails both, and a collective with a partner that left blames no one. Only
nodes under check get a verdict: a partner that already trains is never excluded by another
node's check. The job machine starts checks (:func:`plan`, :func:`start`), records the reports
(:func:`record`) and acts on the verdict.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from stead.core.events import HealthChecked, HealthCheckStarted, HealthTimeout, HealthVerdict, NodeHealthReported
from stead.core.statemachine.base import Transition, reject
from stead.core.statemachine.effects import CheckHealth, Effect, Emit, StartTimer
from stead.core.statemachine.node import NodePhase
from stead.core.statemachine.rendezvous import natural_key
from stead.core.statemachine.state import HealthState, JobState

__all__ = ["HEALTH_MODES", "due", "judge", "needs_check", "participants", "plan", "record", "stages", "start",
           "verdict"]

#: ``off``: no node is checked; ``relaunched``: a node relaunched after a failure is; ``all``: every node is
HEALTH_MODES = ("off", "relaunched", "all")


def needs_check(mode: str, incarnation: int, first_incarnation: int) -> bool:
    """Whether a node incarnation must pass a check; ``first_incarnation``: the node's first of this run."""
    return mode == "all" or (mode == "relaunched" and incarnation > first_incarnation)


def participants(unchecked: Sequence[str], trusted: Sequence[str]) -> tuple[str, ...]:
    """The nodes of a check: every node under check, and a trusted partner when only one is."""
    if len(unchecked) == 1 and trusted:
        return (*unchecked, trusted[0])
    return tuple(unchecked)


def stages(count: int, matmul_s: Sequence[float | None]) -> list[list[tuple[int, int]]]:
    """The pairs (indexes into the check's nodes) that all-reduce together, stage by stage.

    Stage 1 pairs neighbours. Stage 2 pairs the slowest matmul left with the fastest left that was
    not its partner yet (a failed matmul counts as slowest), so that a collective that failed gets
    tried with another partner. A node left without any partner gets a last stage with the fastest.
    Pairs within a stage are disjoint: every node does at most one collective at a time.
    """
    partners: dict[int, set[int]] = {i: set() for i in range(count)}
    result: list[list[tuple[int, int]]] = []

    def add(pairs: list[tuple[int, int]]) -> None:
        for a, b in pairs:
            partners[a].add(b)
            partners[b].add(a)
        if pairs:
            result.append(pairs)

    add([(i, i + 1) for i in range(0, count - 1, 2)])
    times = [t if t is not None else float("inf") for t in list(matmul_s)[:count]]
    times += [float("inf")] * (count - len(times))
    free = sorted(range(count), key=lambda i: (times[i], i))  # fastest first
    second: list[tuple[int, int]] = []
    while free:
        slow = free.pop()
        mate = next((i for i in free if i not in partners[slow]), None)
        if mate is not None:
            free.remove(mate)
            second.append((min(slow, mate), max(slow, mate)))
    add(sorted(second))
    alone = [i for i in range(count) if not partners[i]]
    if alone and count > 1:
        fastest = min((i for i in range(count) if i != alone[0]), key=lambda i: (times[i], i))
        add([(min(alone[0], fastest), max(alone[0], fastest))])
    return result


def judge(*, check: int, health: HealthState, alive: Mapping[str, bool], slow_factor: float,
          timeout_s: float) -> HealthChecked:
    """The verdict on every node under check, from the reports that came (a missing one fails its node)."""
    reports = health.reports
    times = {n: r.matmul_s for n, r in reports.items() if r.matmul_s is not None and not r.error}
    worked = {n for n, r in reports.items() if any(c.seconds is not None for c in r.collectives)}
    failed: list[HealthVerdict] = []
    for node in health.nodes:
        if node not in health.checked or not alive.get(node, False):
            continue
        reason = _problem(node, reports.get(node), times, worked, health, alive, slow_factor, timeout_s)
        if reason:
            failed.append(HealthVerdict(node_id=node, incarnation=health.incarnations[node], reason=reason))
    median = statistics.median(times.values()) if times else None
    return HealthChecked(check=check, nodes=health.nodes, failed=tuple(failed), median_matmul_s=median)


def _problem(node: str, report: NodeHealthReported | None, times: Mapping[str, float], worked: set[str],
             health: HealthState, alive: Mapping[str, bool], slow_factor: float, timeout_s: float) -> str:
    if report is None:
        return f"no health report within {timeout_s:g} s (health_timeout_s)"
    if report.error:
        return f"the check failed: {report.error}"
    if report.matmul_s is None:
        return "the matmul benchmark gave no time"
    others = [t for n, t in times.items() if n != node]
    if others:
        median = statistics.median(others)
        if median > 0 and report.matmul_s > slow_factor * median:
            return (f"matmul took {report.matmul_s:.3f} s, {report.matmul_s / median:.1f}x the median "
                    f"{median:.3f} s of the other nodes (limit {slow_factor:g}x)")
    peers = [c.peer for c in report.collectives if alive.get(c.peer, False)]  # one that left says nothing
    if peers and node not in worked:
        cleared = [p for p in peers if p in worked or (p in health.nodes and p not in health.checked)]
        errors = "; ".join(f"with {c.peer}: {c.error or 'failed'}" for c in report.collectives)
        if cleared:
            return f"every all-reduce failed while {', '.join(cleared)} worked with others ({errors})"
        return f"every all-reduce failed and no partner could be cleared ({errors})"
    return ""


# -- the job machine's side: starting a check, its reports, its verdict ---------------------------


def plan(state: JobState) -> tuple[Effect, ...]:
    """Start a check of the joined nodes that wait for one, once no node that will need one is still coming."""
    spec = state.spec
    assert spec is not None
    if spec.health_check == "off" or state.health.running:
        return ()
    coming = [n for n, s in state.nodes.items() if s.phase in (NodePhase.REQUESTED, NodePhase.STARTED)
              and needs_check(spec.health_check, s.incarnation, state.resumed_at.get(n, 0) + 1)]
    waiting = sorted((n for n, s in state.nodes.items() if s.phase is NodePhase.JOINED and s.unchecked),
                     key=natural_key)
    if coming or not waiting:
        return ()
    started = HealthCheckStarted(check=state.health.check + 1, checked=tuple(waiting),
                                 nodes=participants(waiting, state.ready))
    return (Emit(key=f"health/{started.check}", event=started),)


def start(state: JobState, event: HealthCheckStarted, *, now: float) -> Transition[JobState]:
    spec, health = state.spec, state.health
    assert spec is not None
    if health.running or event.check != health.check + 1:
        return reject(state, f"health check {event.check} cannot start after check {health.check}"
                             f"{' (still running)' if health.running else ''}")
    absent = [n for n in event.nodes if n not in state.joined]
    if absent or not set(event.checked) <= set(event.nodes):
        return reject(state, f"health check {event.check} names nodes that have not joined: {absent}")
    incarnations = {n: state.nodes[n].incarnation for n in event.nodes}
    running = HealthState(check=event.check, nodes=event.nodes, incarnations=incarnations,
                          checked=frozenset(event.checked))
    effects: list[Effect] = [CheckHealth(node_id=n, incarnation=incarnations[n], check=event.check,
                                         nodes=event.nodes, timeout_s=spec.health_timeout_s) for n in event.nodes]
    effects.append(StartTimer(name=HealthTimeout(check=event.check), at=now + spec.health_timeout_s))
    return Transition(dataclasses.replace(state, health=running), tuple(effects))


def record(state: JobState, event: NodeHealthReported) -> Transition[JobState]:
    health = state.health
    if not health.running or event.check != health.check or health.incarnations.get(event.node_id) != event.incarnation:
        return Transition(state)  # about an older check, or from a node that left it: stale
    new = dataclasses.replace(state, health=dataclasses.replace(health, reports={**health.reports,
                                                                                 event.node_id: event}))
    return Transition(new, due(new))


def due(state: JobState) -> tuple[Effect, ...]:
    """The verdict, once every node of the running check that is still alive has reported."""
    health = state.health
    if not health.running:
        return ()
    alive = _alive(state)
    if all(n in health.reports or not alive[n] for n in health.nodes):
        return verdict(state)
    return ()


def verdict(state: JobState) -> tuple[Effect, ...]:
    """The running check's verdict, from the reports that came (the check's timer calls it with what is there)."""
    assert state.spec is not None
    checked = judge(check=state.health.check, health=state.health, alive=_alive(state),
                    slow_factor=state.spec.health_slow_factor, timeout_s=state.spec.health_timeout_s)
    return (Emit(key=f"health-checked/{checked.check}", event=checked),)


def _alive(state: JobState) -> dict[str, bool]:
    health = state.health
    return {n: n in state.nodes and state.nodes[n].incarnation == health.incarnations[n]
            and state.nodes[n].phase.alive for n in health.nodes}
