"""Goodput under injected faults: stead run vs torchrun, the same script and the same faults.

A local job (2 nodes x 2 workers, gloo, a small DDP model, ~1 s steps, a checkpoint every
``--save-every`` steps; bench/_goodput_train.py) runs for ``--minutes`` (10; ``--quick``: 3) and
gets one fault a minute, alternating:

- worker crash: SIGKILL of one worker process (a random rank);
- node loss: SIGKILL of one node's agent's process group and of everything the agent started
  (its zygote and workers, each in a session of its own), as if the machine went away.

It runs under ``stead run --nnodes 2 --nproc-per-node 2`` (flash checkpoints, each ``--persist-every``
th also written to disk by the agents in the background: a lost node's memory is gone with it) and
under ``torchrun --standalone --nproc-per-node 4`` (``torch.save`` checkpoints) with the worker crashes
only, at the same times on the same ranks: torchrun's single agent is the whole job, it cannot survive
losing it. (torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with its shared rendezvous store
its restarted gloo workers find the previous attempt's addresses and never come up.) ``--hangs`` adds
a stead run with one hang a minute (SIGSTOP of one worker), which stead's hang detector has to find;
it shows what the detector's latency costs (no goal).

Goodput = time spent in steps that count (a step recomputed after a rollback counts once) / wall
time from the first step's start to the last step's end. Every rank logs each step's start and
end, and both launchers' goodput comes from that log; for stead it is also taken from its goodput
ledger (``stead status --json``: useful / (wall - waiting - idle), the same window) and the two must
agree within one point. Start-up (launch -> first step) is printed beside it. A fault's cost is
the useful time it lost: from the fault to the end of the first step every rank had not finished
by then (done again after the recovery and any rollback), minus one median step ("(ended)": the run
ended before that step was done again). Its recovery is the time from the fault to the end of the first
step every rank finished in an attempt begun after it (kill -> next step, whatever that step's number).

Goal: stead >= 98 % in the 10-minute run; shorter runs print their figures with no goal. The runs
are one after the other (about 21 minutes by default, 31 with ``--hangs``; ``--quick`` about 7).
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bench" / "_goodput_train.py"
BIN = Path(sys.executable).parent
NODES, NPROC = 2, 2
WORLD = NODES * NPROC
GOAL = 0.98
#: a run gets this long beyond its length before it is killed and reported as an error
GRACE_S = 300
#: how long an injection waits for a round that trains (every rank up and stepping) before the fault is skipped
READY_WAIT_S = 30.0
#: every process a run starts carries this variable (a token of its own): how the bench finds them all
TOKEN_ENV = "STEAD_GOODPUT_BENCH"
#: set in each stead agent's environment by the local platform: JOB/NODE/INCARNATION
NODE_ENV = "STEAD_LOCAL_NODE"
KIND_NAMES = {"worker_crash": "worker crash", "node_loss": "node loss", "hang": "hang"}


@dataclasses.dataclass
class Fault:
    kind: str  # worker_crash | node_loss | hang
    offset_s: float  # after the run's first step
    victim: int  # a rank (worker_crash, hang) or a node index (node_loss)
    at: float | None = None  # when it was injected (wall clock)
    detail: str = ""
    cost_s: float | None = None
    #: from the fault to the end of the first step every rank finished in a newer attempt (kill -> next step)
    recovery_s: float | None = None


@dataclasses.dataclass
class Run:
    label: str
    launcher: str
    faults: list[Fault]
    launched: float = 0.0
    error: str = ""
    goodput: float | None = None
    useful_s: float = 0.0
    wall_s: float = 0.0
    startup_s: float | None = None
    median_step_s: float | None = None
    steps: int = 0
    ledger: dict[str, object] | None = None
    ledger_goodput: float | None = None

    def cost(self, kind: str) -> float | None:
        costs = [f.cost_s for f in self.faults if f.kind == kind and f.cost_s is not None]
        return statistics.median(costs) if costs else None

    def recovery(self, kind: str) -> float | None:
        times = [f.recovery_s for f in self.faults if f.kind == kind and f.recovery_s is not None]
        return statistics.median(times) if times else None


# -- processes ---------------------------------------------------------------------------------------------


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _ours() -> dict[int, str]:
    """pid -> state of every process below this one: what the runs started, orphans included (a subreaper)."""
    stats = {int(name): _stat(int(name)) for name in os.listdir("/proc") if name.isdigit()}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, stat in stats.items():
        if stat is not None:
            children[stat[1]].append(pid)
    found, todo = {}, [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            stat = stats[child]
            assert stat is not None
            found[child] = stat[0]
            todo.append(child)
    return found


def _subreaper() -> None:
    """Become the parent of every orphan our runs leave (a killed agent's zygote, say), so none gets away."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass  # (then an orphan is found by the token in its environment, where it kept it)


def _reap(skip: int | None = None) -> None:
    """Collect the orphans that died (zombies whose parent is now this process), not ``skip`` (a Popen's)."""
    for pid, state in _ours().items():
        if state == "Z" and pid != skip:
            with contextlib.suppress(ChildProcessError):  # (a zombie of another parent, which collects it)
                os.waitpid(pid, os.WNOHANG)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and everything below it, with their groups (workers have sessions)."""
    stats = {p: _stat(p) for p in (int(n) for n in os.listdir("/proc") if n.isdigit())}
    children: dict[int, list[int]] = defaultdict(list)
    for child, stat in stats.items():
        if stat is not None:
            children[stat[1]].append(child)
    targets, todo = [pid], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        targets += below
        todo += below
    for target in targets:
        try:
            if os.getpgid(target) == target:
                os.killpg(target, signal.SIGKILL)
            else:
                os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _marked(token: str) -> list[int]:
    """Processes that carry a run's token in their environment (the ones that did not rewrite it for a title)."""
    mark = f"{TOKEN_ENV}={token}".encode()
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != os.getpid() and mark in _environ(int(n))]


def _kill_all(token: str) -> int:
    """SIGKILL whatever of a run is still there; how many processes were left."""
    killed = set()
    for _ in range(10):
        left = [pid for pid, state in _ours().items() if state != "Z"] + _marked(token)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        _reap()
    _reap()
    return len(killed)


def _workers(pid_dir: Path) -> dict[int, tuple[int, int]]:
    """rank -> (pid, attempt) of the workers that are up, from the pid files the script writes."""
    ours = _ours()  # (a worker rewrites its environment for its title: it is known by its ancestry)
    found = {}
    for rank in range(WORLD):
        try:
            pid, attempt = (int(x) for x in (pid_dir / str(rank)).read_text().split())
        except (OSError, ValueError):
            continue
        if ours.get(pid, "Z") not in ("Z", "T", "t"):  # (not a zombie, nor stopped by a hang)
            found[rank] = (pid, attempt)
    return found


def _agents(job: str) -> dict[str, tuple[int, int]]:
    """node -> (pid, incarnation) of the job's newest live agent per node (not a spare that has no node yet).

    An agent the platform launched for a node has ``STEAD_LOCAL_NODE=JOB/NODE/INCARNATION`` in its environment; a
    warm spare that became a node's agent says it in its title, ``stead agent JOB/NODE/INCARNATION`` (setting the
    title may have overwritten the environment ``/proc`` shows).
    """
    env_prefix, title_prefix = f"{NODE_ENV}={job}/".encode(), f"stead agent {job}/".encode()
    found: dict[str, tuple[int, int]] = {}
    for pid, state in _ours().items():
        try:
            if state in ("Z", "X") or os.getpgid(pid) != pid:  # an agent leads its session; its children do not
                continue
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
        except (ProcessLookupError, OSError):
            continue
        if b"stead agent" not in title:  # (its zygote and workers lead sessions too, and may keep its environment)
            continue
        names = [e[len(env_prefix):] for e in _environ(pid) if e.startswith(env_prefix)]
        if title.startswith(title_prefix):
            names.append(title[len(title_prefix):].split()[0])
        for name in names:
            node, _, incarnation = name.decode(errors="replace").rpartition("/")
            if node and incarnation.isdigit() and (node not in found or int(incarnation) > found[node][1]):
                found[node] = (pid, int(incarnation))
    return found


def _stepping(pid_dir: Path, steplog: Path) -> dict[int, tuple[int, int]] | None:
    """The workers (rank -> (pid, attempt)) when every rank is up in the same attempt and has finished a step in
    it: a round that is training, not one still starting or recovering (a fault there would be another kind)."""
    workers = _workers(pid_dir)
    attempts = {attempt for _, attempt in workers.values()}
    if len(workers) < WORLD or len(attempts) != 1:
        return None
    attempt = attempts.pop()
    if {rank for (a, _), ranks in _read_steplog(steplog).items() if a == attempt for rank in ranks} != set(workers):
        return None
    return workers


def _inject(fault: Fault, pid_dir: Path, steplog: Path, job: str) -> None:
    deadline = time.time() + READY_WAIT_S
    while (workers := _stepping(pid_dir, steplog)) is None:
        if time.time() >= deadline:
            fault.detail = f"the job was not training for {READY_WAIT_S:g} s: not injected"
            return
        time.sleep(0.2)
    if fault.kind == "node_loss":
        agents = _agents(job)
        if not agents:
            fault.detail = "no agent found: not injected"
            return
        node = sorted(agents)[fault.victim % len(agents)]
        pid, incarnation = agents[node]
        fault.at = time.time()
        _kill_tree(pid)
        fault.detail = f"node {node} (incarnation {incarnation}, agent pid {pid})"
        return
    if fault.victim not in workers:
        fault.detail = f"rank {fault.victim} is not running: not injected"
        return
    pid, attempt = workers[fault.victim]
    fault.at = time.time()
    try:
        os.kill(pid, signal.SIGSTOP if fault.kind == "hang" else signal.SIGKILL)
    except ProcessLookupError:
        fault.at, fault.detail = None, f"rank {fault.victim} (pid {pid}) exited first: not injected"
        return
    fault.detail = f"rank {fault.victim} (pid {pid}, attempt {attempt})"


def _remove_shm(job: str) -> int:
    """Remove the flash checkpoint's shared memory the job left (a job killed by the bench frees none)."""
    from stead.plugins.ckpt import SHM_DIR, segment_names

    prefixes = tuple(segment_names(job, f"node-{n}", 0).prefix for n in range(NODES))
    removed = 0
    with contextlib.suppress(OSError):
        for path in SHM_DIR.iterdir():
            if path.name.startswith(prefixes):
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
    return removed


# -- the step log ------------------------------------------------------------------------------------------


def _read_steplog(path: Path) -> dict[tuple[int, int], dict[int, tuple[float, float]]]:
    """(attempt, step) -> rank -> (start, end): every execution of a step, complete or not."""
    runs: dict[tuple[int, int], dict[int, tuple[float, float]]] = defaultdict(dict)
    if not path.exists():
        return runs
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 6:
            continue  # (a line cut short by a kill)
        rank, _, step = (int(x) for x in parts[:3])
        runs[(int(parts[5]), step)][rank] = (float(parts[3]), float(parts[4]))
    return runs


def _first_start(path: Path) -> float | None:
    try:
        with path.open() as f:
            line = f.readline().split()
    except OSError:
        return None
    return float(line[3]) if len(line) == 6 else None


def _lineage(executions: dict[tuple[int, int], dict[int, tuple[float, float]]]
             ) -> tuple[dict[int, tuple[float, float]], list[int]]:
    """step -> (start, end) of the execution that counted: the chain of steps that led to the final state; and
    the steps of that chain no rank logged.

    From the last step finished, back: each step's execution is the one of the newest attempt no newer than
    the next step's (a step done in an attempt that a rollback threw away, and never done again, is not in
    it). A step's span runs from the first rank's start to the last rank's end. A step that no rank logged
    but the next attempt resumed after was done and saved, and the fault came before its log line (under
    torchrun rank 0 writes the checkpoint, then every rank waits in the step's last all-reduce for the rank
    that was killed): it is in the chain, without a span.
    """
    spans = {key: (min(s for s, _ in ranks.values()), max(e for _, e in ranks.values()), len(ranks) == WORLD)
             for key, ranks in executions.items()}
    by_step: dict[int, list[int]] = defaultdict(list)
    for attempt, step in spans:
        by_step[step].append(attempt)
    lowest = min(by_step)
    # the end: the last execution every rank finished (a kill may leave a rank's last line unwritten)
    attempt, step = max((key for key, span in spans.items() if span[2]), key=lambda key: spans[key][1])
    counted: dict[int, tuple[float, float]] = {}
    unlogged: list[int] = []
    while True:
        counted[step] = spans[(attempt, step)][:2]
        step -= 1
        while step > lowest and not any(a <= attempt for a in by_step.get(step, [])):
            unlogged.append(step)
            step -= 1
        older = [a for a in by_step.get(step, []) if a <= attempt]
        complete = [a for a in older if spans[(a, step)][2]]
        if not older:
            return counted, unlogged
        attempt = max(complete or older)


def _analyse(run: Run, steplog: Path) -> None:
    executions = _read_steplog(steplog)
    if not any(len(ranks) == WORLD for ranks in executions.values()):
        run.error = run.error or "no step was logged by every rank"
        return
    counted, unlogged = _lineage(executions)
    first = min(s for ranks in executions.values() for s, _ in ranks.values())
    last = max(end for _, end in counted.values())
    # a step's span runs from its first rank's start to its last rank's end: a rank may begin the next step
    # before another logged the end of this one; a span starts no earlier than the previous one ended
    before = None
    for step in sorted(counted):
        start, end = counted[step]
        if before is not None and start < before:
            counted[step] = (min(before, end), end)
        before = end
    run.median_step_s = median = statistics.median(end - start for start, end in counted.values())
    # a step done but never logged (see _lineage) counts as one step of the median length
    run.useful_s = sum(end - start for start, end in counted.values()) + median * len(unlogged)
    run.wall_s = last - first
    run.goodput = run.useful_s / run.wall_s if run.wall_s > 0 else None
    run.startup_s = first - run.launched
    run.steps = len(counted) + len(unlogged)
    complete = [(step, max(e for _, e in ranks.values())) for (_, step), ranks in executions.items()
                if len(ranks) == WORLD]
    finished: dict[int, list[tuple[float, int]]] = defaultdict(list)  # rank -> (end, step) of each step it did
    for (_, step), ranks in executions.items():
        for rank, (_, end) in ranks.items():
            finished[rank].append((end, step))
    for fault in run.faults:
        if fault.at is None:
            continue
        at = fault.at
        # the step each rank had finished last when the fault hit, and the next one, which every rank had not
        lasts = [max((e for e in rank_steps if e[0] <= at), default=(0.0, -1))[1] for rank_steps in finished.values()]
        target = min(lasts) + 1 if len(lasts) == WORLD else 0
        # cost: until the first time every rank has finished that step (or a later one: a step done but never
        # logged, see _lineage) since the fault, less the steps themselves
        redone = [(end, step) for step, end in complete if step >= target and end > at]
        if redone:
            end, step = min(redone)
            fault.cost_s = end - at - median * (step - target + 1)
        # recovery: the first step every rank finished in an attempt begun after the fault (kill -> next step)
        then = max((a for (a, _), ranks in executions.items() if min(s for s, _ in ranks.values()) <= at),
                   default=None)
        after = [max(e for _, e in ranks.values()) for (a, _), ranks in executions.items()
                 if len(ranks) == WORLD and then is not None and a > then]
        if after:
            fault.recovery_s = min(after) - at


# -- stead's ledger ----------------------------------------------------------------------------------------


def _ledger(store: str, job: str, cwd: Path) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "stead", "status", "--store", store, "--job", job, "--json"],
                         cwd=cwd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"stead status failed ({out.returncode}): {out.stderr.strip()[-1000:]}")
    figures: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def _ledger_goodput(figures: dict[str, object]) -> float | None:
    """useful / (wall - waiting - idle): the ledger's figure over the step log's window (first step -> end)."""
    try:
        useful, wall = float(figures["useful_s"]), float(figures["wall_s"])  # type: ignore[arg-type]
        window = wall - float(figures["waiting_s"]) - float(figures["idle_s"])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return None
    return useful / window if window > 0 else None


# -- one run ---------------------------------------------------------------------------------------------


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _run(run: Run, workdir: Path, args: argparse.Namespace) -> None:
    rundir = workdir / run.label
    pid_dir = rundir / "pids"
    pid_dir.mkdir(parents=True)
    steplog = rundir / "steps.log"
    token = f"{os.getpid()}-{run.label}-{time.time_ns()}"
    job = f"goodput-{run.label}-{os.getpid()}"
    store = f"sqlite:///{workdir / (run.label + '.db')}"
    seconds = args.minutes * 60
    script = [str(TRAIN), "--step-time", str(args.step_time), "--save-every", str(args.save_every),
              "--seconds", str(seconds), "--t0-file", str(rundir / "t0"), "--steplog", str(steplog),
              "--pid-dir", str(pid_dir)]
    if run.launcher == "torchrun":
        (rundir / "ckpt").mkdir()
        command = [str(BIN / "torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", str(WORLD),
                   "--max-restarts", "100", "--monitor-interval", "0.1", *script, "--ckpt", "torch",
                   "--ckpt-dir", str(rundir / "ckpt")]
    else:
        command = [sys.executable, "-m", "stead", "run", "--nnodes", str(NODES), "--nproc-per-node", str(NPROC),
                   "--max-restarts", "100", "--max-node-relaunches", "100", "--job-name", job, "--store", store,
                   "--log-format", "json", *(f"--set={s}" for s in args.stead_set), *script, "--ckpt", "flash",
                   "--persist-every", str(args.persist_every)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN_ENV: token}
    if run.launcher == "torchrun" and not args.torchrun_shared_store:
        # torchrun's workers otherwise meet the keys of the previous attempt's gloo ranks in the rendezvous
        # store the agent keeps across restarts, and connect to dead ports: no restart ever comes up
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    deadline_s = seconds + GRACE_S
    with (rundir / "stdout.txt").open("w") as out, (rundir / "stderr.txt").open("w") as err:
        run.launched = time.time()
        proc = subprocess.Popen(command, cwd=rundir, env=env, stdout=out, stderr=err, start_new_session=True)
    deadline = run.launched + deadline_s
    try:
        first = None
        while first is None and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
            first = _first_start(steplog)
        if first is not None:
            print(f"{run.label:<9} first step {first - run.launched:6.1f} s after the launch", flush=True)
            for number, fault in enumerate(run.faults, 1):
                wait = first + fault.offset_s - time.time()
                if wait > 0 and _exited(proc, wait):
                    break
                if proc.poll() is not None:
                    break
                _inject(fault, pid_dir, steplog, job)
                when = f"+{fault.at - first:6.1f} s" if fault.at is not None else "   -    "
                print(f"{run.label:<9} fault {number:>2}  {KIND_NAMES[fault.kind]:<12} {when}  {fault.detail}",
                      flush=True)
        if not _exited(proc, deadline - time.time()):
            run.error = f"did not finish within {deadline_s:.0f} s; killed"
        elif proc.returncode != 0:
            run.error = f"exited {proc.returncode}: {_tail(rundir / 'stderr.txt', 1500).strip()}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = _kill_all(token)
        if left:
            print(f"{run.label:<9} killed {left} process(es) it left behind", flush=True)
        if run.launcher == "stead":
            removed = _remove_shm(job)
            if removed:
                print(f"{run.label:<9} removed {removed} shared-memory segment(s) it left in /dev/shm", flush=True)
    _analyse(run, steplog)
    if run.launcher == "stead":
        try:
            run.ledger = _ledger(store, job, rundir)
            run.ledger_goodput = _ledger_goodput(run.ledger)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            run.error = run.error or f"no ledger: {exc}"


def _exited(proc: subprocess.Popen[bytes], wait: float) -> bool:
    """Wait up to ``wait`` s for ``proc`` to exit (collecting the orphans of the faults meanwhile); whether it did."""
    until = time.time() + wait
    while True:
        try:
            proc.wait(timeout=max(0.0, min(1.0, until - time.time())))
        except subprocess.TimeoutExpired:
            _reap(skip=proc.pid)
            if time.time() >= until:
                return False
        else:
            return True


# -- output ----------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return f"{x:6.1%}" if x is not None else "     -"


def _secs(x: float | None) -> str:
    return f"{x:6.2f} s" if x is not None else "     - "


def _report(run: Run) -> None:
    print(f"\n{run.label}: {run.steps} steps counted, median step {_secs(run.median_step_s)}, "
          f"useful {run.useful_s:.1f} s of {run.wall_s:.1f} s")
    if run.faults:
        print(f"  {'#':>2}  {'fault':<12} {'at':>8}  {'cost':>9}  {'recovery':>9}  victim")
        first = run.launched + (run.startup_s or 0.0)
        for number, fault in enumerate(run.faults, 1):
            at = f"{fault.at - first:7.1f}s" if fault.at is not None else "       -"
            cost = _secs(fault.cost_s) if fault.cost_s is not None or fault.at is None else "(ended)"
            print(f"  {number:>2}  {KIND_NAMES[fault.kind]:<12} {at}  {cost:>9}  {_secs(fault.recovery_s):>9}  "
                  f"{fault.detail}")
    print(f"  start-up {_secs(run.startup_s)}   goodput (step log) {_pct(run.goodput)}", end="")
    if run.launcher == "stead" and run.ledger is not None:
        print(f"   ledger {_pct(run.ledger_goodput)} (over the job: {_pct(_num(run.ledger.get('goodput')))})", end="")
    print(f"\n  error: {run.error}" if run.error else "", flush=True)


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) else None


def _round(x: float | None, digits: int) -> float | None:
    return round(x, digits) if x is not None else None


def schedule(minutes: float, every: float, seed: int, *, hangs: bool = False) -> list[Fault]:
    """One fault every ``every`` seconds while the run lasts: worker crash and node loss alternating (or hangs)."""
    rng = random.Random(seed)
    faults = []
    k = 1
    while k * every < minutes * 60 - every / 4:  # none in the run's last moments
        kind = "hang" if hangs else ("worker_crash" if k % 2 else "node_loss")
        victim = rng.randrange(NODES if kind == "node_loss" else WORLD)
        faults.append(Fault(kind=kind, offset_s=k * every, victim=victim))
        k += 1
    return faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3-minute runs, no goal")
    parser.add_argument("--minutes", type=float, default=None, help="length of each run (default 10; --quick 3)")
    parser.add_argument("--step-time", type=float, default=1.0, help="seconds per step (default 1.0)")
    parser.add_argument("--save-every", type=int, default=1,
                        help="checkpoint every N steps (default 1: a flash save of this model is a memcpy of it)")
    parser.add_argument("--persist-every", type=int, default=None,
                        help="stead: also write every Nth step's flash checkpoint to disk, in the background (default: "
                             "--save-every; 0: never, and a node loss rolls back to the last step persisted)")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the victims' choice")
    parser.add_argument("--launchers", default="stead,torchrun", help="which to run: stead,torchrun")
    parser.add_argument("--hangs", action="store_true", help="also a stead run with one hang (SIGSTOP) per interval")
    parser.add_argument("--stead-set", action="append", default=[], metavar="NAME=VALUE",
                        help="a stead setting for the stead runs (repeatable), as stead run --set")
    parser.add_argument("--torchrun-shared-store", action="store_true",
                        help="leave torchrun's rendezvous store shared with the workers (its default; here its "
                             "restarts then fail: the workers find the previous attempt's gloo addresses)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, step logs, stores)")
    args = parser.parse_args()
    args.minutes = args.minutes if args.minutes is not None else (3.0 if args.quick else 10.0)
    args.persist_every = args.save_every if args.persist_every is None else args.persist_every
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    if set(launchers) - {"stead", "torchrun"} or not (launchers or args.hangs):
        parser.error("--launchers takes stead, torchrun or both (or nothing, with --hangs)")

    faults = schedule(args.minutes, args.fault_every, args.seed)
    runs: dict[str, Run] = {}
    if "stead" in launchers:
        runs["stead"] = Run("stead", "stead", [dataclasses.replace(f) for f in faults])
    if "torchrun" in launchers:
        runs["torchrun"] = Run("torchrun", "torchrun", [dataclasses.replace(f) for f in faults
                                                        if f.kind == "worker_crash"])
    if args.hangs:
        runs["hangs"] = Run("hangs", "stead", schedule(args.minutes, args.fault_every, args.seed, hangs=True))
    kinds = ", ".join(f"{n} {KIND_NAMES[k]}" for k, n in _counts(faults).items())
    print(f"{args.minutes:g} min per run, {WORLD} workers ({NODES} nodes x {NPROC}), steps of {args.step_time:g} s, "
          f"checkpoint every {args.save_every} steps (stead: flash, persisted every {args.persist_every or 'no'} "
          f"steps; torchrun: torch.save); faults every {args.fault_every:g} s: {kinds}", flush=True)
    if "torchrun" in runs:
        print("torchrun gets the worker crashes only (at the same times, on the same ranks): it cannot survive the "
              "loss of its single agent, which is the whole job", flush=True)

    _subreaper()
    workdir = Path(tempfile.mkdtemp(prefix="stead-bench-goodput-"))
    try:
        for run in runs.values():
            _run(run, workdir, args)
            _report(run)
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    stead, torchrun, hangs = runs.get("stead"), runs.get("torchrun"), runs.get("hangs")
    diff = None
    if stead is not None and stead.goodput is not None and stead.ledger_goodput is not None:
        diff = stead.ledger_goodput - stead.goodput
    print("\nsummary")
    if stead is not None:
        print(f"  stead     goodput {_pct(stead.ledger_goodput)} (ledger)  {_pct(stead.goodput)} (step log)  "
              + (f"differ by {abs(diff) * 100:.2f} pt: {'agree' if abs(diff) <= 0.01 else 'DISAGREE'}"
                 if diff is not None else "cannot be compared")
              + f"; start-up {_secs(stead.startup_s)}")
        print(f"            cost per fault (median): worker crash {_secs(stead.cost('worker_crash'))}, "
              f"node loss {_secs(stead.cost('node_loss'))}; fault -> next step (median): worker crash "
              f"{_secs(stead.recovery('worker_crash'))}, node loss {_secs(stead.recovery('node_loss'))}")
    if torchrun is not None:
        print(f"  torchrun  goodput {_pct(torchrun.goodput)} (step log; worker crashes only); start-up "
              f"{_secs(torchrun.startup_s)}; worker crash cost (median) {_secs(torchrun.cost('worker_crash'))}")
    if hangs is not None:
        print(f"  stead, one hang per {args.fault_every:g} s: goodput {_pct(hangs.ledger_goodput)} (ledger) "
              f"{_pct(hangs.goodput)} (step log); hang cost (median) {_secs(hangs.cost('hang'))} (no goal)")
    full = not args.quick and args.minutes >= 10
    goal_met = None
    if full and stead is not None:
        goal_met = stead.ledger_goodput is not None and stead.ledger_goodput >= GOAL
        print(f"  goal: stead >= {GOAL:.0%}: {'met' if goal_met else 'NOT met'}")
    elif stead is None:
        print("  (no goal: the goal is stead's, and stead did not run)")
    else:
        print(f"  (no goal for a {args.minutes:g}-minute run: the goal is for the 10-minute one)")
    errors = {run.label: run.error for run in runs.values() if run.error}
    for label, error in errors.items():
        print(f"  {label} failed: {error.splitlines()[0] if error else ''}")
    result = {
        "bench": "goodput", "minutes": args.minutes, "step_time_s": args.step_time, "save_every": args.save_every,
        "persist_every": args.persist_every, "fault_every_s": args.fault_every, "seed": args.seed,
        "stead_goodput": _round(stead.ledger_goodput, 4) if stead else None,
        "stead_goodput_steplog": _round(stead.goodput, 4) if stead else None,
        "stead_ledger_job_goodput": _round(_num(stead.ledger.get("goodput")), 4) if stead and stead.ledger else None,
        "stead_ledger": {k: stead.ledger.get(k) for k in ("wall_s", "useful_s", "lost_s", "recovery_s", "waiting_s",
                                                          "idle_s", "recoveries")} if stead and stead.ledger else None,
        "ledger_diff_pt": _round(diff * 100, 2) if diff is not None else None,
        "ledger_agrees": abs(diff) <= 0.01 if diff is not None else None,
        "torchrun_goodput": _round(torchrun.goodput, 4) if torchrun else None,
        "stead_startup_s": _round(stead.startup_s, 2) if stead else None,
        "torchrun_startup_s": _round(torchrun.startup_s, 2) if torchrun else None,
        "worker_crash_cost_s": _round(stead.cost("worker_crash"), 2) if stead else None,
        "node_loss_cost_s": _round(stead.cost("node_loss"), 2) if stead else None,
        "torchrun_worker_crash_cost_s": _round(torchrun.cost("worker_crash"), 2) if torchrun else None,
        "worker_crash_recovery_s": _round(stead.recovery("worker_crash"), 2) if stead else None,
        "node_loss_recovery_s": _round(stead.recovery("node_loss"), 2) if stead else None,
        "torchrun_worker_crash_recovery_s": _round(torchrun.recovery("worker_crash"), 2) if torchrun else None,
        "stead_hang_goodput": _round(hangs.ledger_goodput, 4) if hangs else None,
        "stead_hang_goodput_steplog": _round(hangs.goodput, 4) if hangs else None,
        "hang_cost_s": _round(hangs.cost("hang"), 2) if hangs else None,
        "faults": _counts([f for f in stead.faults if f.at is not None]) if stead else {},
        "torchrun_faults": _counts([f for f in torchrun.faults if f.at is not None]) if torchrun else {},
        "stead_fault_costs_s": [[f.kind, _round(f.cost_s, 2)] for f in stead.faults] if stead else [],
        "torchrun_fault_costs_s": [[f.kind, _round(f.cost_s, 2)] for f in torchrun.faults] if torchrun else [],
        "errors": errors, "goal": GOAL, "goal_met": goal_met,
    }
    print(json.dumps(result))
    if errors:
        sys.exit(1)


def _counts(faults: list[Fault]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for fault in faults:
        counts[fault.kind] = counts.get(fault.kind, 0) + 1
    return counts


if __name__ == "__main__":
    main()
