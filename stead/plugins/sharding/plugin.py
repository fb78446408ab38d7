"""The master-side plugin: serves ShardService, returns failed workers' leases to the queue and records the samples
of skipped steps (the ranks' ``step_skipped`` notes, in ``numerics.reported``) as skipped."""

from __future__ import annotations

import structlog

from stead.plugin import (
    InvalidRequest,
    NodeExited,
    NodeLost,
    NumericsReported,
    Plugin,
    PluginContext,
    Record,
    WorkerFailed,
)
from stead.plugins.sharding.service import ShardService
from stead.plugins.sharding.servicer import ShardServicer
from stead.plugins.sharding.settings import ShardingSettings

__all__ = ["ShardingPlugin"]

log = structlog.get_logger("stead.plugins.sharding")


class ShardingPlugin(Plugin[ShardingSettings]):
    name = "sharding"
    subscriptions = (WorkerFailed, NodeLost, NodeExited, NumericsReported)
    settings_class = ShardingSettings

    def __init__(self, *, settings: ShardingSettings | None = None) -> None:
        super().__init__(settings=settings or ShardingSettings())
        self.service: ShardService | None = None

    async def start(self, *, ctx: PluginContext[ShardingSettings]) -> None:
        def max_world_size() -> int | None:
            spec = ctx.current_state().spec
            return spec.max_nodes * spec.nproc_per_node if spec is not None else None

        self.service = ShardService(ctx.store, prefix=ctx.key("v1"), settings=ctx.settings, emit=ctx.emit,
                                    max_world_size=max_world_size)
        ctx.add_rpc_handler(ShardServicer(self.service))

    async def handle(self, *, record: Record, ctx: PluginContext[ShardingSettings]) -> None:
        service = self.service
        if service is None:
            return
        if isinstance(record.event, NumericsReported):  # a skipped step's notes may come as the job ends: recorded
            await _record_skipped(service, record.event, ctx)
            return
        if ctx.state.phase.terminal:
            return  # a finished job's nodes exit: nothing is read any more
        match record.event:
            case WorkerFailed() as failure:
                why = (f"killed by signal {failure.signal}" if failure.signal is not None
                       else f"exit code {failure.exit_code}")
                await service.failed(node_id=failure.node_id, round_=failure.round, rank=failure.rank,
                                     reason=f"rank {failure.rank} failed ({why})")
            case NodeLost() | NodeExited() as ended if _older(ended, ctx):
                # an incarnation already replaced (a partitioned host's old agent hanging up once the link heals):
                # the streams of the node's id in this round are its successor's
                ctx.log.info("shard_streams_kept", node=ended.node_id, incarnation=ended.incarnation,
                             why="an older incarnation of the node ended; its successor reads on")
            case NodeLost() as lost:
                await service.failed(node_id=lost.node_id, reason=f"node {lost.node_id} lost ({lost.reason})")
            case NodeExited() as exited:
                await service.failed(node_id=exited.node_id, reason=f"node {exited.node_id} exited")


async def _record_skipped(service: ShardService, reported: NumericsReported,
                          ctx: PluginContext[ShardingSettings]) -> None:
    """The samples the ranks' skipped steps held, into their datasets' ledgers; a note the ledger refuses (a dataset
    it does not know, slots outside the dataset) is logged and left out."""
    for note in reported.notes:
        if note.kind != "step_skipped" or not note.samples:
            continue
        round_ = reported.round if note.round is None else note.round
        for part in note.samples:
            try:
                await service.skipped(dataset=part.dataset, round_=round_, rank=note.rank, step=note.step,
                                      ranges=part.ranges)
            except InvalidRequest as exc:
                ctx.log.warning("shard_skipped_refused", dataset=part.dataset, node=reported.node_id,
                                round=round_, rank=note.rank, step=note.step, reason=str(exc))


def _older(ended: NodeLost | NodeExited, ctx: PluginContext[ShardingSettings]) -> bool:
    """Whether ``ended`` speaks of an incarnation older than the node's newest (the job's state knows it)."""
    node = ctx.state.nodes.get(ended.node_id)
    return node is not None and ended.incarnation < node.incarnation
