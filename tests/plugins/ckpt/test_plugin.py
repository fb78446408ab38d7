"""The master's CheckpointService: bad input is refused, a long poll returns when the commit comes, an agent's
report of a corrupt copy is recorded as the event it holds."""

from __future__ import annotations

import anyio
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.config import Settings
from stead.core.events import CheckpointCommitted, Event, Record
from stead.core.plugins import PluginContext, validate_plugin
from stead.core.rpc import RpcConnection, RpcServer, attach_token, new_token
from stead.core.statemachine import JobState
from stead.core.store import open_store
from stead.plugins.ckpt import proto
from stead.plugins.ckpt._client import CheckpointClient, Saved
from stead.plugins.ckpt.events import CheckpointCorrupt
from stead.plugins.ckpt.plugin import CheckpointPlugin
from stead.plugins.ckpt.settings import CheckpointSettings

pytestmark = pytest.mark.anyio


async def test_the_plugin_is_valid_and_serves_commits_that_survive_a_master_restart() -> None:
    store = await open_store("memory://")
    events: list[Event] = []

    async def emit(event: Event) -> Record:
        events.append(event)
        return Record(seq=len(events), at=0.0, event=event)

    def context(handlers: list[object]) -> PluginContext[CheckpointSettings]:
        return PluginContext(plugin="ckpt", job="j", settings=CheckpointSettings(), stead_settings=Settings(),
                             store=store, state=JobState, emit=emit, add_rpc_handler=handlers.append)

    token = new_token()
    plugin = validate_plugin(CheckpointPlugin(settings=CheckpointSettings()), source="test")
    handlers: list[object] = []
    await plugin.start(ctx=context(handlers))  # type: ignore[attr-defined]
    async with RpcServer(handlers, token=token) as server:  # type: ignore[arg-type]
        conn = RpcConnection(server.address, token, 5.0)
        conn.open()
        try:
            node0 = CheckpointClient(conn, node_id="node-0", incarnation=1)
            node1 = CheckpointClient(conn, node_id="node-1", incarnation=1)
            waited = {}
            held_3 = Saved(3, frozenset({3}), seconds={3: 0.25})

            async def wait_for_commit() -> None:
                waited["reply"] = await node0.get_committed(round_=1, after_step=-1, wait_s=10, ranks=[0])

            async with anyio.create_task_group() as tg:
                reply = await node0.report_saved(round_=1, world_size=2, tier="memory", ranks={0: held_3})
                assert reply.round_step == -1
                tg.start_soon(wait_for_commit)
                await anyio.sleep(0.1)
                reply = await node1.report_saved(round_=1, world_size=2, tier="memory",
                                                 ranks={1: Saved(3, frozenset({3}), seconds={3: 0.5})})
                assert reply.round_step == 3
            assert waited["reply"].round_step == 3 and waited["reply"].step == 3
            commits = [e for e in events if isinstance(e, CheckpointCommitted)]
            assert commits == [CheckpointCommitted(step=3, save_s=0.5)]  # the slower rank's copy
            corrupt = CheckpointCorrupt(node_id="node-1", rank=5, step=1200, tier="disk",
                                        detail="tensor w fails its checksum")
            await node1.report_corrupt(corrupt)
            assert events[-1] == corrupt  # the report is recorded as the event it holds, every field crossed

            channel = Channel(server.host, server.port)
            attach_token(channel, token)
            try:
                for bad in (proto.ReportSavedRequest(node_id="n", round=1, world_size=0, tier="memory"),
                            proto.ReportSavedRequest(node_id="n", round=1, world_size=2, tier="tape"),
                            proto.ReportSavedRequest(node_id="n", round=1, world_size=2, tier="memory",
                                                     ranks=[proto.RankSaved(rank=5, step=1)]),
                            proto.ReportSavedRequest(node_id="n", round=1, world_size=1, tier="disk",
                                                     ranks=[proto.RankSaved(rank=0, step=1, seconds={1: -2.0})])):
                    with pytest.raises(GRPCError) as caught:
                        await proto.CheckpointServiceStub(channel).report_saved(bad, timeout=5)
                    assert caught.value.status == Status.INVALID_ARGUMENT
            finally:
                channel.close()
        finally:
            conn.close()
    restarted = CheckpointPlugin(settings=CheckpointSettings())
    await restarted.start(ctx=context([]))
    assert (restarted.book.step, restarted.book.step_round) == (3, 1)
    await store.close()
