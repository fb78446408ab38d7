"""Which committed step is replicated: the master's pure rule for "commit means replicated". No IO, no clock.

Two steps are tracked, each a ``(step, round)`` pair:

- ``replicating`` (X): the committed step the agents copy to other hosts now. The master picks it, the same for
  every node (each node sending its own newest commit would leave holders with different steps of different ranks,
  and no step replicated everywhere);
- ``replicated`` (R): the newest step X whose every rank's copy is in place, in the memory of a live node on another
  host (at least one copy per rank; placement never puts one on its source's host).

While ``keep`` is on, the workers never overwrite the slots holding R and X and the holders keep R's copy while X's
arrives: a host's loss then restores X where every rank can get it, R at worst, from memory. With two slots per
rank a save that would need either is skipped, so commits follow the replicas' pace (steps faster than a copy's
transfer would otherwise overwrite every step before its copies arrive). ``keep`` is on while every node of the
round has replicas placed on another host (a job on one host, or with ``ckpt.replicas=0``, never waits for
copies that cannot be made); it goes off (``late``) when X is not replicated within ``wait_s``: saves then go on
without waiting (a copy refused for lack of memory, a holder that does not answer: a host lost meanwhile may cost
a disk read, said in the recovery's record), and the next X that arrives everywhere turns it on again.

X moves to the newest commit once it is replicated, when a newer round committed (the round X was saved in ended:
its copies may never all arrive), and when it waited ``wait_s`` in vain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

__all__ = ["NONE", "Replication", "advance", "newer", "replicated_everywhere"]

#: no step
NONE = (-1, -1)


def newer(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether ``(step, round)`` ``a`` comes after ``b`` (rounds first: a new round's steps follow the old's)."""
    return (a[1], a[0]) > (b[1], b[0])


@dataclasses.dataclass(frozen=True)
class Replication:
    #: R: the newest step whose every rank's copy is in another host's memory
    replicated: tuple[int, int] = NONE
    #: X: the committed step being copied, and the world size of its round
    replicating: tuple[int, int] = NONE
    world: int = 0
    #: when X was chosen (the master's clock)
    since: float = 0.0
    #: X waited in vain (``wait_s``): nothing is kept until a step is replicated again
    late: bool = False
    #: every node of the round has replicas placed on another host
    placed: bool = False

    @property
    def keep(self) -> bool:
        """The workers keep R's and X's slots, the holders R's copy."""
        return self.placed and not self.late

    @property
    def waiting(self) -> bool:
        """X is chosen and not replicated yet."""
        return self.replicating[0] >= 0 and self.replicating != self.replicated


def replicated_everywhere(step: tuple[int, int], world: int,
                          holders: Mapping[int, Collection[tuple[int, int, int]]]) -> bool:
    """Whether every rank of a ``world`` has a copy of ``step`` (``holders``: rank -> the (step, round, world) of
    the copies live holders have of it)."""
    copy = (step[0], step[1], world)
    return world > 0 and all(copy in holders.get(rank, ()) for rank in range(world))


def advance(rep: Replication, *, committed: tuple[int, int], world: int, round_: int, placed: bool,
            holders: Mapping[int, Collection[tuple[int, int, int]]], now: float, wait_s: float) -> Replication:
    """The replication after a commit or a holder's report: R moves to X once X is everywhere, X to the newest commit
    (``committed``, of a round of ``world`` ranks) when it may (see the module docstring). ``round_``: the newest
    round reported; X waits in vain only in its own round (a newer round replaces it at its first commit, however
    long the restart took). ``placed``: every node of the newest round has replicas placed on another host."""
    if placed != rep.placed:
        rep = dataclasses.replace(rep, placed=placed)
    if not placed:
        return rep  # no copy is made: none is waited for, nor chosen
    if rep.waiting and replicated_everywhere(rep.replicating, rep.world, holders):
        rep = dataclasses.replace(rep, replicated=rep.replicating, late=False)
    stale = rep.waiting and round_ == rep.replicating[1] and now - rep.since > wait_s
    if stale and not rep.late:
        rep = dataclasses.replace(rep, late=True)
    if committed[0] >= 0 and newer(committed, rep.replicating) and (
            not rep.waiting or committed[1] > rep.replicating[1] or stale):
        rep = dataclasses.replace(rep, replicating=committed, world=world, since=now)
    return rep
