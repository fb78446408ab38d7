"""Flash checkpoints in one process, for tests and benchmarks: the master's plugin behind a real
RpcServer and real agent extensions, on an event loop thread of their own, so that the caller uses
the worker API (FlashCheckpointer, blocking) directly, as a training script does::

    with LocalCluster(tmp_path, CheckpointSettings(dir=...), job="j") as cluster:
        cluster.agent()
        cluster.round(1)
        with cluster.worker() as ckpt:
            ckpt.save(1, state)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import ssl
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from stead.core.rpc import MasterClient, RpcServer, client_tls, new_token, write_token_file
from stead.core.rpc.tls import server_context, tls_files
from stead.core.store import open_store
from stead.plugin import AgentContext, Event, JobState, PluginContext, Record, RoundInfo, Settings
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._codec import encode
from stead.plugins.ckpt._disk import tensor_bytes
from stead.plugins.ckpt._layout import LayoutDoc, parse_document, plan
from stead.plugins.ckpt._memreshard import SlotPart, slot_part
from stead.plugins.ckpt.agent import CheckpointAgentExtension
from stead.plugins.ckpt.plugin import CheckpointPlugin
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["LocalCluster", "SlotImage", "environ_set", "slot_image"]


class LocalCluster:
    """One job's master plugin and any number of node agents (extensions), in this process."""

    def __init__(self, tmp: Path, settings: CheckpointSettings, job: str, *,
                 stead_settings: Settings | None = None) -> None:
        self.tmp, self.settings, self.job = tmp, settings, job
        self.stead_settings = stead_settings or Settings()
        self.events: list[Event] = []
        self.token = new_token()
        self.token_file = tmp / "token"
        write_token_file(self.token_file, self.token)
        self.plugin = CheckpointPlugin(settings=settings)
        self.agents: dict[str, CheckpointAgentExtension] = {}
        self.address = ""
        self._stack = contextlib.ExitStack()
        self.portal: BlockingPortal

    def __enter__(self) -> LocalCluster:
        self.portal = self._stack.enter_context(start_blocking_portal())
        self._stop = self.portal.call(anyio.Event)
        _, self.address = self.portal.start_task(self._serve_master)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for ext in list(self.agents.values()):
                self.portal.call(functools.partial(ext.stop, job_ended=True))
            self.agents.clear()
            self.portal.call(self._stop.set)
        finally:
            self._stack.close()

    async def _serve_master(self, *, task_status: Any) -> None:
        store = await open_store("memory://")

        async def emit(event: Event) -> Record:
            self.events.append(event)
            return Record(seq=len(self.events), at=0.0, event=event)

        handlers: list[Any] = []
        ctx = PluginContext(plugin="ckpt", job=self.job, settings=self.settings, stead_settings=self.stead_settings,
                            store=store, state=JobState, emit=emit, add_rpc_handler=handlers.append)
        await self.plugin.start(ctx=ctx)
        try:
            async with RpcServer(handlers, token=self.token, tls=self._server_tls()) as server:
                task_status.started(server.address)
                await self._stop.wait()
        finally:
            await store.close()

    def _server_tls(self) -> ssl.SSLContext | None:
        """Mutual TLS when the stead settings name the tls_* files (the agents' clients then use them too)."""
        files = tls_files(self.stead_settings)
        return server_context(files) if files is not None else None

    # -- agents -------------------------------------------------------------------------------------

    def agent(self, node_id: str = "node-0", *, incarnation: int = 1, nproc: int = 1) -> CheckpointAgentExtension:
        old = self.agents.pop(node_id, None)
        if old is not None:
            self.portal.call(lambda: old.stop(job_ended=False))
        workdir = self.tmp / f"{node_id}-{incarnation}"
        workdir.mkdir(exist_ok=True)
        ext = CheckpointAgentExtension(settings=self.settings)
        client = MasterClient(self.address, self.token, call_timeout_s=5, tls=client_tls(self.stead_settings))
        ctx = AgentContext(job=self.job, node_id=node_id, incarnation=incarnation, nproc=nproc,
                           settings=self.stead_settings, client=client,
                           master_address=self.address, token_file=str(self.token_file), workdir=workdir)
        self.portal.call(lambda: ext.start(ctx=ctx))
        self.agents[node_id] = ext
        return ext

    def stop_agent(self, node_id: str = "node-0") -> None:
        ext = self.agents.pop(node_id)
        self.portal.call(lambda: ext.stop(job_ended=True))

    def kill_agent(self, node_id: str = "node-0") -> None:
        """Like a SIGKILL: the extension's loop stops, nothing is cleaned up (its segments stay in /dev/shm)."""
        ext = self.agents.pop(node_id)
        names = ext._names
        ext._names = None  # stop() must not unlink: a killed agent cannot
        if ext._node is not None:  # nor persist what it holds
            ext._node.ckpt = dataclasses.replace(ext._node.ckpt, persist_on_stop=False)
        self.portal.call(lambda: ext.stop(job_ended=False))
        ext._names = names

    def round(self, round_: int, *, node_id: str = "node-0", restart_count: int = 0, world: int = 1,
              nproc: int = 1, node_rank: int = 0) -> None:
        ext = self.agents[node_id]
        info = RoundInfo(id=f"start/{round_}", round=round_, node_rank=node_rank, nnodes=max(1, world // nproc),
                         nproc_per_node=nproc, world_size=world, restart_count=restart_count,
                         master_addr="127.0.0.1", master_port=1)
        self.portal.call(lambda: ext.before_round(round=info))

    def failure(self, node_id: str = "node-0", *, round_: int = 1) -> None:
        ext = self.agents[node_id]
        self.portal.call(lambda: ext.after_failure(round=round_, local_rank=0, exit_code=17, signal=None))

    def worker(self, *, node_id: str = "node-0", rank: int = 0, world: int = 1, local_rank: int | None = None,
               round_: int = 1, **kwargs: Any) -> FlashCheckpointer:
        ext = self.agents[node_id]
        lr = rank if local_rank is None else local_rank
        env = {**ext.worker_env(round=round_, local_rank=lr), "STEAD_ROUND": str(round_), "STEAD_JOB": self.job}
        with environ_set(env):
            return FlashCheckpointer(rank=rank, world_size=world, local_rank=lr, settings=self.settings, **kwargs)

    def event_types(self) -> list[str]:
        return [e.type_name for e in self.events]

    def settle(self, seconds: float = 0.2) -> None:
        """Let the agents and the master finish what they are doing (reports, events)."""
        self.portal.call(anyio.sleep, seconds)


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in os.environ for the block (how a worker's environment looks), then restore it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclasses.dataclass(frozen=True)
class SlotImage:
    """A state laid out as a worker saves it into a slot (tensors, their checksums, the layout document)."""

    data: bytearray
    doc: LayoutDoc
    sums: tuple[int, ...]

    def part(self, *, where: str, fetched: list[tuple[int, int]] | None = None) -> SlotPart:
        """The slot as a reshard reads it, from this memory (``fetched``: each (rank, offset) read is noted)."""

        def fetch(offset: int, nbytes: int) -> memoryview:
            if fetched is not None:
                fetched.append((self.doc.rank, offset))
            return memoryview(self.data)[offset:offset + nbytes]

        return slot_part(self.doc, self.sums, fetch, where=where)


def slot_image(state: Mapping[str, Any], *, step: int, rank: int, world: int, round_: int = 1) -> SlotImage:
    """``state`` (DTensors as their local shards) in a slot's bytes, as rank ``rank`` of ``world`` saves it in
    round ``round_``: a node's memory for tests of the memory tiers without an agent."""
    encoded = encode(state)
    layout = plan([m.to_json() for m in encoded.metas])
    document = layout.document(tree=encoded.tree, step=step, round_=round_, rank=rank, world=world)
    data = bytearray(layout.needed(document))
    sums = []
    for tensor, offset, nbytes in zip(encoded.tensors, layout.offsets, layout.nbytes, strict=True):
        local = tensor.detach().cpu().contiguous()
        data[offset:offset + nbytes] = tensor_bytes(local) if nbytes else b""
        sums.append(checksum(data[offset:offset + nbytes]))
    data[layout.checks_off:layout.layout_off] = struct.pack(f"<{len(sums)}Q", *sums)
    data[layout.layout_off:] = document
    doc = parse_document(document, expected_sum=checksum(document), where=f"the slot of rank {rank}")
    return SlotImage(data=data, doc=doc, sums=tuple(sums))
