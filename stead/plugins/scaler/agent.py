"""The scaler's agent extension (entry point ``stead.agent_extensions: scaler``): the batch hint for workers.

Before each round the agent asks the master's scaler for the batch scale the job's out-of-memory failures
led to, and passes it to the round's workers as ``STEAD_BATCH_SCALE`` (only when below 1), which
``stead.data.batch_size`` applies. A master that cannot answer leaves the last scale in force.
"""

from __future__ import annotations

import structlog

from stead.plugin import (
    AgentContext,
    AgentExtension,
    RoundInfo,
    RpcConnection,
    SteadError,
    client_tls,
    read_token_file,
)
from stead.plugins.scaler._proto.stead import v1 as proto
from stead.plugins.scaler.settings import ScalerSettings

__all__ = ["BATCH_SCALE_ENV", "ScalerAgentExtension"]

log = structlog.get_logger("stead.plugins.scaler")

#: the per-worker batch multiplier a worker's ``stead.data.batch_size`` applies
BATCH_SCALE_ENV = "STEAD_BATCH_SCALE"


class ScalerAgentExtension(AgentExtension[ScalerSettings]):
    name = "scaler"
    settings_class = ScalerSettings

    def __init__(self, *, settings: ScalerSettings) -> None:
        super().__init__(settings=settings)
        self._conn: RpcConnection | None = None
        self._node_id = ""
        self.batch_scale = 1.0

    async def start(self, *, ctx: AgentContext) -> None:
        self._node_id = ctx.node_id
        self._conn = RpcConnection(ctx.master_address, read_token_file(ctx.token_file), ctx.settings.rpc_timeout_s,
                                   tls=client_tls(ctx.settings))
        self._conn.open()

    async def before_round(self, *, round: RoundInfo) -> None:
        if self._conn is None:
            return
        try:
            with self._conn.errors("ScalerService.BatchHint"):
                reply = await proto.ScalerServiceStub(self._conn.channel).batch_hint(
                    proto.BatchHintRequest(node_id=self._node_id, round=round.round),
                    timeout=self._conn.call_timeout_s)
        except SteadError as exc:
            log.warning("scaler_batch_hint_unknown", error=str(exc), effect=f"keeping {self.batch_scale:g}")
            return
        if 0 < reply.batch_scale <= 1:
            self.batch_scale = reply.batch_scale

    async def worker_env(self, *, round: int, local_rank: int) -> dict[str, str]:
        return {BATCH_SCALE_ENV: f"{self.batch_scale:g}"} if self.batch_scale < 1 else {}

    async def stop(self, *, job_ended: bool) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
