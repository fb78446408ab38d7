"""Membership policies: how many nodes a job should run on, within MIN:MAX.

The scaler asks its policy after every ``stead scale`` request, shortly after nodes are
lost or exit and rounds start (once per burst), and every ``scaler.policy_every_s``. A policy is a plain object with a
``decide(view)`` method (:class:`MembershipPolicy`) returning a :class:`Decision`, or
None to keep the target; third parties register theirs under the entry point group
``stead.scaler_policies`` and pick it with ``--set scaler.policy=NAME``.

The default policy aims at what was asked for (``stead run``'s start, then the latest
``stead scale``), capped by what the platform may run (``capacity_nodes``, or fewer while
the platform has no room for some nodes: NodePending, for ``scaler.pending_retry_s``) and
kept within MIN:MAX. Growing as nodes become ready, going on with the survivors of a lost
node that cannot be replaced, and failing below MIN after ``join_timeout_s`` are the
job machine's, for every policy.

A decision is checked before it is recorded: anything but an int within MIN:MAX is
refused (``scaler.rejected`` names the policy and what it returned) and the job keeps
its size.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from stead.plugin import ConfigError, load_named

__all__ = ["POLICY_GROUP", "Decision", "DefaultPolicy", "MembershipPolicy", "MembershipView", "check", "load_policy"]

POLICY_GROUP = "stead.scaler_policies"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MembershipView:
    """What a policy sees of the job."""

    min_nodes: int
    max_nodes: int
    #: the target in force
    target: int
    #: the latest ``stead scale`` request (None: none since the job started)
    requested: int | None
    #: the nodes the platform may run for the job (None: no cap)
    capacity: int | None
    #: live nodes (requested, starting or joined), ready ones, and the running round's members
    live: int
    ready: int
    members: int
    #: nodes lost or exited while the job ran, so far
    losses: int
    phase: str
    #: where ``capacity`` comes from: the capacity_nodes setting, or the platform having no room for more
    capacity_source: str = "capacity_nodes"


@dataclasses.dataclass(frozen=True)
class Decision:
    target: int
    reason: str


@runtime_checkable
class MembershipPolicy(Protocol):
    def decide(self, view: MembershipView) -> Decision | None:
        """The target the job should have now, and why; None keeps the one in force."""
        ...


class DefaultPolicy:
    """What was asked for, capped by the platform's capacity, within MIN:MAX."""

    def decide(self, view: MembershipView) -> Decision | None:
        wanted = view.requested if view.requested is not None else view.target
        why = f"{wanted} nodes requested" if view.requested is not None else f"{wanted} nodes to start with"
        if view.capacity is not None and wanted > view.capacity:
            wanted, why = view.capacity, (f"{why}, capped by the platform's capacity ({view.capacity}, "
                                          f"{view.capacity_source})")
        wanted = max(view.min_nodes, min(view.max_nodes, wanted))
        return None if wanted == view.target else Decision(wanted, why)


def check(decision: object, view: MembershipView) -> str:
    """Why ``decision`` cannot be recorded ("" when it can)."""
    if decision is None:
        return ""
    if not isinstance(decision, Decision):
        return f"returned {decision!r}, not a Decision or None"
    target = decision.target
    if isinstance(target, bool) or not isinstance(target, int):
        return f"decided a target of {target!r}, not a whole number of nodes"
    if not view.min_nodes <= target <= view.max_nodes:
        return f"decided {target} nodes, outside the job's MIN:MAX {view.min_nodes}:{view.max_nodes}"
    return ""


def load_policy(name: str) -> MembershipPolicy:
    """The policy installed as ``name`` under ``stead.scaler_policies`` (stead's own: ``default``)."""
    _, found, value = load_named(POLICY_GROUP, name, what="scaler policy",
                                 hint="install the package that provides it, or use --set scaler.policy=default")
    policy = found() if isinstance(found, type) else found
    if not isinstance(policy, MembershipPolicy):
        raise ConfigError(f"scaler policy {name!r} ({value}) has no decide(view) method; see "
                          "stead.plugins.scaler.membership.MembershipPolicy")
    return policy
