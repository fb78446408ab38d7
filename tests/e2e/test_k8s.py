"""Jobs on Kubernetes end to end: `stead run --platform k8s` against a test cluster whose pods really run.

The cluster is :mod:`tests.support.kube`: an API server that speaks the real REST and watch
protocol (the platform's kubernetes_asyncio client and the operator's kopf talk to it over HTTP)
and a fake kubelet that runs each pod's command as a local process on one of three fake hosts,
each with its own /dev/shm and scratch space. The store is a real etcd. The job trains with
gloo on the CPU and saves a flash checkpoint every step; faults come from the test: a node's
pod deleted, the master's pod deleted, a pod OOM-killed, a host whose health check fails, a pod
that finds no room.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from stead.platforms.k8s import names
from tests.support.kube import FakeKubeApi, FakeKubelet, local_image_env

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

IMAGE = "stead:test"
#: a guard against a hung job, not a measured duration
TIMEOUT_S = 120.0

TRAIN = """
import os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import stead
from stead.ckpt import FlashCheckpointer

dist.init_process_group("gloo")
rank, world, round_ = dist.get_rank(), dist.get_world_size(), os.environ["STEAD_ROUND"]
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
ckpt = FlashCheckpointer()
step = 0
found = ckpt.load({"model": model.state_dict(), "opt": opt.state_dict()})
if found is not None:
    step, state = found
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    if rank == 0:
        with open("resumed.log", "a") as f:
            f.write(f"{round_} {step}\\n")
while True:
    x = torch.full((4, 8), float(step % 7))
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    stead.report_step(step)
    # every 10th step on disk from both ranks: the proof a relaunched rank needs to take the other's copy of a
    # replicated state (a failure persists only the surviving rank's step)
    ckpt.save(step, {"model": model.state_dict(), "opt": opt.state_dict()}, persist=step % 10 == 0)
    if rank == 0:
        with open("steps.log", "a") as f:
            f.write(f"{step} {round_} {world}\\n")
    stop = torch.tensor([int(os.path.exists("stop"))])
    dist.all_reduce(stop)
    if stop.item():
        break
    time.sleep(0.05)
ckpt.close()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, **kubelet: Any) -> AsyncIterator[tuple[FakeKubeApi, FakeKubelet]]:
    """The test cluster; its pods' logs are kept in ``pod-logs/`` (the kubelet removes its nodes' files)."""
    async with FakeKubeApi() as api, FakeKubelet(api.url, root=tmp_path / "nodes", images={IMAGE: local_image_env()},
                                                 retry_s=0.2, **kubelet) as fake:
        try:
            yield api, fake
        finally:
            kept = tmp_path / "pod-logs"
            kept.mkdir(exist_ok=True)
            for log in (tmp_path / "nodes").glob("*/logs/*.log"):
                shutil.copy(log, kept / f"{log.parent.parent.name}_{log.name}")


class Job:
    """A `stead run --platform k8s` process, the job's directory, and what the test watches of it."""

    def __init__(self, process: anyio.abc.Process, cwd: Path, name: str, store: str, api: FakeKubeApi) -> None:
        self.process, self.cwd, self.name, self.store, self.api = process, cwd, name, store, api
        self.stderr = b""

    def steps(self) -> list[tuple[int, int, int]]:
        path = self.cwd / "steps.log"
        if not path.exists():
            return []
        return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in path.read_text().splitlines()
                                                             if line.count(" ") == 2)]

    def pods(self, role: str = names.ROLE_NODE) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.api.objects("pods", "default")
                if p["metadata"].get("labels", {}).get(names.LABEL_ROLE) == role
                and p["metadata"]["labels"].get(names.LABEL_JOB) == self.name}

    def running(self, role: str = names.ROLE_NODE) -> list[str]:
        return sorted(n for n, p in self.pods(role).items() if (p.get("status") or {}).get("phase") == "Running"
                      and not p["metadata"].get("deletionTimestamp"))

    async def until(self, what: str, holds: Callable[[], bool]) -> None:
        with anyio.fail_after(TIMEOUT_S):
            while not holds():
                self._still_running(what)
                await anyio.sleep(0.1)

    async def step_beyond(self, steps: int) -> int:
        """Wait until training went ``steps`` steps past where it is now; the step then."""
        now = max((s for s, _, _ in self.steps()), default=0)
        await self.until(f"step {now + steps}", lambda: max((s for s, _, _ in self.steps()), default=0) >= now + steps)
        return now + steps

    def events(self) -> list[dict[str, Any]]:
        out = subprocess.run(self._events_command(), cwd=self.cwd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e["data"] for e in self.events() if e["type"] == kind]

    async def until_recorded(self, what: str, kind: str, holds: Callable[[list[dict[str, Any]]], bool]) -> None:
        """Wait until the data of the job's events of ``kind`` so far hold; read without blocking the event loop,
        which serves the test cluster the job runs on."""
        with anyio.fail_after(TIMEOUT_S):
            while True:
                out = await anyio.run_process(self._events_command(), cwd=self.cwd, check=False)
                assert out.returncode == 0, out.stderr.decode(errors="replace")
                events = [json.loads(line) for line in out.stdout.decode().splitlines() if line.strip()]
                if holds([e["data"] for e in events if e["type"] == kind]):
                    return
                self._still_running(what)
                await anyio.sleep(0.5)

    def _events_command(self) -> list[str]:
        return [sys.executable, "-m", "stead", "events", "--job", self.name, "--store", self.store, "--json"]

    def _still_running(self, what: str) -> None:
        if self.process.returncode is not None:
            raise AssertionError(f"the job ended (exit {self.process.returncode}) while waiting for {what}; "
                                 f"its output:\n{self.stderr.decode(errors='replace')[-4000:]}")


@contextlib.asynccontextmanager
async def job(tmp_path: Path, api: FakeKubeApi, store: str, name: str, flags: Sequence[str]) -> AsyncIterator[Job]:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    command = [sys.executable, "-m", "stead", "run", "--platform", "k8s", "--job-name", name, "--store", store,
               "--set", f"k8s.api_url={api.url}", "--set", f"k8s.pod_api_url={api.url}", "--set", f"k8s.image={IMAGE}",
               "--set", "k8s.master_host=127.0.0.1", "--set", f"k8s.master_port={_free_port()}",
               "--set", f"k8s.working_dir={tmp_path}", "--set", "k8s.grace_period_s=10", "--log-format", "json",
               *flags, "train.py"]
    process = await anyio.open_process(command, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    running = Job(process, tmp_path, name, store, api)

    async def collect() -> None:
        assert process.stderr is not None
        async for chunk in process.stderr:
            running.stderr += chunk

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(collect)
        try:
            yield running
        finally:
            (tmp_path / "stop").touch()
            with anyio.move_on_after(TIMEOUT_S / 2):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            tasks.cancel_scope.cancel()


async def finish(running: Job) -> int:
    (running.cwd / "stop").touch()
    with anyio.fail_after(TIMEOUT_S):
        return await running.process.wait()


@pytest.mark.long(45)
async def test_a_job_survives_a_deleted_pod_its_master_pod_deleted_and_an_oom_kill(tmp_path: Path,
                                                                               etcd_url: str) -> None:
    # a relaunched node's new pod restores from the checkpoints its predecessor persisted: on a claim every pod
    # mounts (a pod's own disk goes with it), which the job asks for and allows (an escalation is said twice)
    async with cluster(tmp_path) as (api, kubelet), _claimed(api, "checkpoints"), job(
            tmp_path, api, etcd_url, "kube-a", ("--nnodes", "2", "--nproc-per-node", "1", "--set", "health_check=off",
                                                "--set", "k8s.memory=6Gi", "--set", "scaler.oom_memory_budget=1",
                                                "--set", "ckpt.keep_last=5",
                                                "--set", "k8s.checkpoint_claim=checkpoints",
                                                "--set", "k8s.allowed_claims=checkpoints",
                                                "--max-node-relaunches", "3")) as running:
        await running.until("both node pods running", lambda: len(running.running()) == 2)
        await running.step_beyond(5)
        assert sorted(running.pods()) == ["kube-a-node-0-1", "kube-a-node-1-1"]

        # a node's pod deleted: relaunched under a new name, training goes on from the flash checkpoint
        await _delete(api, "kube-a-node-1-1")
        await running.until("node-1's new pod", lambda: "kube-a-node-1-2" in running.running())
        await running.step_beyond(5)

        # the master's pod deleted: a new master adopts the running pods, none is recreated
        [master] = running.running(names.ROLE_MASTER)
        before = sorted(running.pods())
        await _delete(api, master)
        await running.until("a new master pod", lambda: any(m != master for m in running.running(names.ROLE_MASTER)))
        await running.step_beyond(10)
        assert sorted(running.pods()) == before, "a node pod was recreated when the master changed"

        # node-0's pod OOM-killed: classified, relaunched with a larger memory limit; once the budget of raises
        # (scaler.oom_memory_budget=1 here) is spent, with the same limit
        for incarnation, memory in ((1, "9Gi"), (2, "9Gi")):
            await kubelet.oom_kill("default", f"kube-a-node-0-{incarnation}")
            relaunched = f"kube-a-node-0-{incarnation + 1}"
            await running.until(f"{relaunched} running", lambda pod=relaunched: pod in running.running())
            limits = running.pods()[relaunched]["spec"]["containers"][0]["resources"]["limits"]
            assert limits["memory"] == memory
            await running.step_beyond(5)
        assert await finish(running) == 0, running.stderr.decode(errors="replace")[-4000:]

    exits = running.of("node.exited")
    assert any(e["node_id"] == "node-0" and e["oom"] and "OOMKilled" in e["reason"] for e in exits)
    raised, kept = running.of("node.resources_decided")
    assert raised["node_id"] == "node-0" and dict(raised["resources"])["memory"] == "9Gi"
    assert dict(kept["resources"])["memory"] == "9Gi" and "oom_memory_budget 1 spent" in kept["reason"]
    [recommended] = running.of("scaler.recommended")  # what the nodes asked for, beside what they used
    assert any(line.startswith("memory: requested 9Gi, peak ") for line in recommended["lines"]), recommended
    classified = running.of("diagnosis.classified")
    assert any(c["failure_class"] == "oom" and c["node_id"] == "node-0" for c in classified), (classified, exits)
    # each recovery restored a step no older than the newest the job had committed when the fault came: not an
    # older one (a rollback), nor none (the workers would start again from step 0 and write no resumed.log line)
    resumed = dict(tuple(map(int, line.split())) for line in (tmp_path / "resumed.log").read_text().splitlines())
    floors = _committed_at_faults(running.events())
    assert len(floors) >= 3, floors  # the deleted pod and both OOM kills
    assert all(resumed.get(round_, -1) >= step for round_, step in floors.items()), (floors, resumed)
    steps = [s for s, _, _ in running.steps()]
    assert steps == sorted(steps) or max(steps) > 20  # training went on across every fault


def _committed_at_faults(events: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Round -> the newest step the job promised to keep when the first fault of the round before it was recorded,
    for each round that a fault started (a node that exited, was lost or whose worker failed) after some step was
    committed: the newest committed step, except for a pod killed at once (OOM: its memory gone with it, nothing
    persisted on its way out), where it is the newest replicated one (``ckpt.replicated``: its copy in another
    host's memory; the commits may run ahead of the copies on a loaded machine).

    The first fault, not the last: a step committed later in that round (a late report) is not asked for."""
    floors: dict[int, int] = {}
    committed: int | None = None
    replicated: int | None = None
    at_fault: int | None = None
    started = False
    for event in sorted(events, key=lambda e: e["seq"]):
        match event["type"]:
            case "checkpoint.committed":
                committed = event["data"]["step"]  # the latest, as the job has it: after a rollback, that step
            case "ckpt.replicated":
                replicated = event["data"]["step"]
            case "node.exited" if started and at_fault is None and event["data"].get("oom"):
                at_fault = replicated
            case "node.exited" | "node.lost" | "worker.failed" if started and at_fault is None:
                at_fault = committed
            case "round.started":
                if at_fault is not None:
                    floors[event["data"]["round"]] = at_fault
                started, at_fault = True, None
    return floors


@contextlib.asynccontextmanager
async def _claimed(api: FakeKubeApi, claim: str) -> AsyncIterator[None]:
    """A ReadWriteMany claim in the test cluster (the fake kubelet gives every node the same directory)."""
    from stead.platforms.k8s import Kube, Resource
    from stead.platforms.k8s.settings import K8sSettings

    async with Kube(K8sSettings(api_url=api.url, namespace="default"), pool=1) as kube:
        await kube.create(Resource("persistentvolumeclaims"), {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    yield


async def _delete(api: FakeKubeApi, pod: str) -> None:
    from stead.platforms.k8s import PODS, Kube
    from stead.platforms.k8s.settings import K8sSettings

    async with Kube(K8sSettings(api_url=api.url, namespace="default"), pool=1) as kube:
        assert await kube.delete(PODS, pod, grace_period_s=30)



@pytest.mark.extended("a failed health check's host kept out: tests/e2e/test_slurm.py's platform test (the node on the "
                      "spare), k8s's node anti-affinity: test_k8s_objects and test_fake_kubelet; a pod with no room "
                      "reported pending once: test_k8s_platform; given up while MIN holds and asked for again when "
                      "room comes: test_scaler_membership; the k8s job itself: the deleted-pod and OOM test above")
@pytest.mark.long(50)
async def test_a_failing_host_is_kept_out_and_a_node_with_no_room_is_given_up_then_asked_for_again(
        tmp_path: Path, etcd_url: str) -> None:
    # host-a's GPUs are broken (its pods' health checks fail); host-b has room for no pod at first
    faulty = {"host-a": {"STEAD_FAULT_HEALTH": "host:host-a:fail"}}
    async with cluster(tmp_path, nodes=("host-a", "host-b", "host-c"), node_env=faulty) as (api, kubelet):
        await kubelet.set_capacity("host-b", pods=0)
        await kubelet.set_capacity("host-c", pods=1)  # the master goes to host-a (least loaded), then a node here
        async with job(tmp_path, api, etcd_url, "kube-b", (
                "--nnodes", "1:2", "--nproc-per-node", "1", "--set", "health_check=all",
                "--set", "k8s.pending_timeout_s=2", "--set", "scaler.pending_retry_s=4",
                "--rdzv-conf", "last_call_timeout=1")) as running:
            # one node lands on host-a, fails its check and is relaunched away from host-a, but no other host has
            # room for it; the job goes on with the other node meanwhile (MIN is 1, and the rendezvous's last call
            # ends before k8s.pending_timeout_s)
            await running.until("a round with one node", lambda: any(w == 1 for _, _, w in running.steps()))
            relaunched: list[dict[str, Any]] = []

            def kept_off() -> bool:
                relaunched.extend(p for n, p in running.pods().items() if not n.endswith("-1"))
                return bool(relaunched)

            await running.until("a relaunched pod", kept_off)
            terms = relaunched[0]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["host-a"]
            # the relaunch waits for room for k8s.pending_timeout_s, is reported pending and given up; room that came
            # sooner would have it scheduled, with nothing pending (the one-node round starts before the timeout)
            await running.until_recorded("the relaunch given up", "scaler.pending",
                                         lambda answered: any(a["decision"] == "give_up" for a in answered))
            # room appears on host-b: the scaler asks for the node again and the job grows to two
            await kubelet.set_capacity("host-b", pods=2)
            await running.until("a round with two nodes", lambda: running.steps()[-1][2] == 2)
            await running.step_beyond(3)
            assert await finish(running) == 0, running.stderr.decode(errors="replace")[-4000:]

    checked = running.of("health.checked")
    assert any(c["failed"] for c in checked), checked
    pending = running.of("node.pending")
    assert pending and all("Unschedulable" in p["reason"] for p in pending)
    answered = running.of("scaler.pending")
    assert answered and answered[0]["decision"] == "give_up"
    hosts = {p["spec"].get("nodeName") for p in running.pods().values()}
    assert hosts == {"host-b", "host-c"}  # the pod that failed on host-a was deleted; none ran there again
