"""``srun stead run train.py`` with no multi-node flags: the Slurm job step says what the flags would.

Under ``srun`` every task of the step runs ``stead run``; one task per node makes one host each.
:func:`slurm_step` reads the step from Slurm's environment (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_PROCID``) and :func:`flag_defaults` turns it into
torchrun's elastic command line, as defaults that flags given on the command line replace (:func:`rendezvous`):

* ``--rdzv-backend c10d --rdzv-endpoint FIRST:PORT``: the step's first node serves the job's master (its `stead
  run` binds the endpoint; the others join it), node ranks are given by the master, so a node of the step beyond
  ``--nnodes`` is a spare host that takes a lost node's place;
* ``--nnodes`` the step's node count;
* ``--rdzv-id slurm-JOBID``: one job name on every node (a requeued job keeps its id, so it resumes its own
  checkpoints; a job submitted again resumes them with ``--rdzv-id`` or ``--job-name`` given);
* PORT: 15000 + the job id's last four digits (Lightning's rule for Slurm), so two jobs sharing a node do not
  take one port; ``--rdzv-endpoint`` or ``--master-port`` chooses another.

Outside an ``srun`` step, in a batch script or an salloc shell, :func:`slurm_allocation` reads the allocation
(``SLURM_JOB_NODELIST``, ``SLURMD_NODENAME``, ``SLURM_JOB_CPUS_PER_NODE``) for the Slurm platform
(:mod:`stead.platforms.hosts.slurm`), which starts a host step on each node itself.

A step that cannot be one job is refused (:func:`check_nnodes`): several tasks on a node (stead starts the
node's workers itself), ``--nnodes`` asking for more nodes than the step has. The node list is Slurm's hostlist
expression (``gpu[01-04,07],login1``), expanded here without asking the controller.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from stead.core.errors import ConfigError

__all__ = ["HOST_STEP_ENV", "SlurmAllocation", "SlurmStep", "check_nnodes", "flag_defaults", "hostnames",
           "platform_allocation", "rendezvous", "slurm_allocation", "slurm_step"]

#: the c10d endpoint's port is this plus the job id's last four digits
PORT_BASE = 15000
#: the most host names one node list may expand to (Slurm's own limit is far below this)
MAX_HOSTS = 100_000

#: set (to the Slurm job id) in the environment of a host step the Slurm platform started: that `stead run` is one
#: host of the job its master serves, whatever its own one-node step says
HOST_STEP_ENV = "STEAD_SLURM_HOST_STEP"

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_CPUS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """The Slurm job step this `stead run` is a task of."""

    job_id: str
    nodes: tuple[str, ...]
    #: this task's rank in the step (one task per node: the node's index in ``nodes``)
    task: int

    @property
    def port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id)[-4:] or "0"
        return PORT_BASE + int(digits)


@dataclasses.dataclass(frozen=True)
class SlurmAllocation:
    """The Slurm job (an sbatch script's, an salloc shell's) a `stead run` runs in outside any ``srun`` step: the
    Slurm platform's (:mod:`stead.platforms.hosts.slurm`) nodes."""

    job_id: str
    nodes: tuple[str, ...]
    #: the allocation's node this runs on (a batch script runs on its first node); None: another host (salloc's)
    here: str | None
    #: CPUs the job holds on each node (``SLURM_JOB_CPUS_PER_NODE``), in ``nodes``' order; empty when not given
    cpus: tuple[int, ...] = ()

    @property
    def port(self) -> int:
        return SlurmStep(self.job_id, self.nodes, 0).port


def slurm_allocation(environ: Mapping[str, str]) -> SlurmAllocation | None:
    """The allocation of a `stead run` inside a Slurm job but not in an ``srun`` step (an sbatch script, an salloc
    shell); None elsewhere, and in a host step the Slurm platform started. ConfigError when it does not parse."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or nodelist is None or environ.get("SLURM_STEP_NODELIST") is not None \
            or environ.get(HOST_STEP_ENV):
        return None
    nodes = hostnames(nodelist)
    here = environ.get("SLURMD_NODENAME") or None
    return SlurmAllocation(job_id=job_id, nodes=nodes, here=here if here in nodes else None,
                           cpus=_cpus_per_node(environ.get("SLURM_JOB_CPUS_PER_NODE", ""), len(nodes)))


def platform_allocation(environ: Mapping[str, str], *, asked: bool, default: bool, in_step: bool, standalone: bool,
                        flagged: bool, min_nodes: int) -> SlurmAllocation | None:
    """The allocation the Slurm platform runs the job on: when ``--platform slurm`` is ``asked`` for, or by
    ``default`` (no other platform named) in an allocation of several nodes when no multi-node flag is given
    (``flagged``); None otherwise. ConfigError when the platform asked for cannot run (under srun, outside an
    allocation, with multi-node flags) or the allocation holds fewer than ``min_nodes``."""
    allocation = None if in_step or standalone else slurm_allocation(environ)
    if not asked:
        if not default or allocation is None or len(allocation.nodes) < 2 or flagged:
            return None
    elif in_step:
        raise ConfigError("--platform slurm starts the job's nodes as srun steps itself: run `stead run` in the batch "
                          "script (or salloc shell) without srun, or drop --platform slurm to make this srun step's "
                          "nodes the job")
    elif allocation is None:
        raise ConfigError("--platform slurm runs the job on the nodes of the Slurm job it runs in: run `stead run` in "
                          "an sbatch script or an salloc shell (SLURM_JOB_ID and SLURM_JOB_NODELIST set)")
    elif flagged:
        raise ConfigError("--platform slurm serves the job's master on this host and starts every node itself: drop "
                          "--rdzv-backend, --rdzv-endpoint, --node-rank and --master-addr")
    if min_nodes > len(allocation.nodes):
        held = len(allocation.nodes)
        raise ConfigError(f"--nnodes asks for at least {min_nodes} nodes but the Slurm job holds {held} "
                          f"({','.join(allocation.nodes[:8])}{',...' if held > 8 else ''}): ask sbatch or salloc "
                          f"for --nodes {min_nodes} or more, or lower --nnodes")
    return allocation


def _cpus_per_node(text: str, count: int) -> tuple[int, ...]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``"4(x2),2"``) per node; empty when it is missing or does not say ``count``."""
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
        match = _CPUS.fullmatch(part.strip())
        if match is None:
            return ()
        cpus.extend([int(match.group(1))] * int(match.group(2) or 1))
    return tuple(cpus) if len(cpus) == count else ()


def slurm_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """The job step of an ``srun`` task (None outside one, and in a host step the Slurm platform started: its
    flags come from its master); ConfigError when it cannot be one job."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_STEP_NODELIST")
    if not job_id or nodelist is None or environ.get(HOST_STEP_ENV):
        return None  # not a task of an srun step (a batch script: slurm_allocation's; or no allocation)
    nodes = hostnames(nodelist)
    count, tasks, task = (_int(environ, name) for name in
                          ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"))
    if count != len(nodes):
        raise ConfigError(f"Slurm's step environment disagrees with itself: SLURM_STEP_NUM_NODES={count} but "
                          f"SLURM_STEP_NODELIST={nodelist!r} names {len(nodes)} nodes; run `stead run` under srun "
                          "as it sets them, or give torchrun's multi-node flags")
    if tasks != count:
        raise ConfigError(f"srun started {tasks} tasks on {count} node(s) (SLURM_STEP_NUM_TASKS, "
                          f"SLURM_STEP_TASKS_PER_NODE={environ.get('SLURM_STEP_TASKS_PER_NODE', '?')}): stead run "
                          "is one task per node, and starts --nproc-per-node workers on it itself; use srun "
                          "--ntasks-per-node 1")
    if not 0 <= task < count:
        raise ConfigError(f"SLURM_PROCID={task} is not a task of a {count}-task step; run `stead run` under srun")
    return SlurmStep(job_id=job_id, nodes=nodes, task=task)


def flag_defaults(step: SlurmStep) -> dict[str, str]:
    """The defaults of torchrun's flags (argparse dests) that the step gives; the command line's flags replace
    them. The rendezvous (c10d at the step's first node) is :func:`rendezvous`'s: it depends on other flags."""
    return {"nnodes": str(len(step.nodes)), "rdzv_id": f"slurm-{step.job_id}"}


def rendezvous(step: SlurmStep, *, backend: str, endpoint: str, node_rank: int | None, master_addr: str | None,
               master_port: int | None) -> tuple[str, str, str | None]:
    """(backend, endpoint, master address) for the step, given the rendezvous flags of the command line.

    torchrun's static line (``--node-rank``, ``--master-addr``) and an explicit endpoint are kept (a static line
    without ``--master-addr`` gets the step's first node); with none of them the step's first node serves the job
    at c10d, on ``--master-port`` when given."""
    if backend != "static" or endpoint:
        return backend, endpoint, master_addr
    if node_rank is not None:
        return backend, endpoint, master_addr or step.nodes[0]
    if master_addr is not None:
        return backend, endpoint, master_addr
    port = master_port if master_port is not None else step.port
    return "c10d", f"{step.nodes[0]}:{port}", None


def check_nnodes(step: SlurmStep, min_nodes: int) -> None:
    """Refuse a ``--nnodes`` the step cannot run: at least more nodes than it has."""
    if min_nodes > len(step.nodes):
        raise ConfigError(f"--nnodes asks for at least {min_nodes} nodes but the Slurm step runs on {len(step.nodes)} "
                          f"({','.join(step.nodes[:8])}{',...' if len(step.nodes) > 8 else ''}): ask srun for "
                          f"--nodes {min_nodes} or more, or lower --nnodes")


def hostnames(nodelist: str) -> tuple[str, ...]:
    """Slurm's hostlist expression expanded: ``"n[1-3,07],login"`` -> n1 n2 n3 n07 login (zero padding kept)."""
    if not nodelist.strip():
        raise ConfigError(f"the Slurm node list {nodelist!r} names no host; run `stead run` under srun")
    names: list[str] = []
    for item in _top_level(nodelist.strip(), nodelist):
        names.extend(_expand(item, nodelist))
        if len(names) > MAX_HOSTS:
            raise ConfigError(f"the Slurm node list {nodelist[:80]!r} names more than {MAX_HOSTS} hosts")
    return tuple(names)


def _top_level(text: str, whole: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise _bad(whole, "a bracket inside a bracket")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad(whole, "a ']' without its '['")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(whole, "a '[' without its ']'")
    items.append(text[start:])
    if any(not item for item in items):
        raise _bad(whole, "an empty name between commas")
    return items


def _expand(item: str, whole: str) -> list[str]:
    """One name of the list, its bracket groups (``rack[1-2]-n[01-02]``) expanded in order."""
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise _bad(whole, "a ']' without its '['")
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    rests = _expand(tail, whole) if tail else [""]
    out: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise _bad(whole, f"[{body}] holds {part!r}, not a number or a range like 01-04")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise _bad(whole, f"the range {part} runs backwards")
        if int(last) - int(first) >= MAX_HOSTS:
            raise ConfigError(f"the Slurm node list {whole[:80]!r} names more than {MAX_HOSTS} hosts")
        width = len(first) if first.startswith("0") else 0
        out.extend(f"{head}{n:0{width}d}{rest}" for n in range(int(first), int(last) + 1) for rest in rests)
    return out


def _bad(nodelist: str, why: str) -> ConfigError:
    return ConfigError(f"the Slurm node list {nodelist!r} does not parse ({why}); run `stead run` under srun, "
                       "which sets SLURM_STEP_NODELIST, or give torchrun's multi-node flags")


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name)
    if raw is None or not raw.strip().isdigit():
        raise ConfigError(f"the Slurm step's {name}={raw!r} is not a number; run `stead run` under srun, which "
                          "sets it, or give torchrun's multi-node flags")
    return int(raw)
