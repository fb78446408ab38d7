"""The scaler: what a job's nodes really used, and the requests to make for its next run.

Every ``sample_every_s`` it adds each node's last reported figures (its workers'
resident memory and CPU, its GPUs' memory and utilisation; a node reports none it
cannot measure) to one distribution per resource (:mod:`.usage`). ``stead status``
shows the peaks, percentiles and recommendations so far (:mod:`.recommend`: e.g.
"memory: peak 11.2Gi, p95 10.8Gi per node; recommend 14Gi"), and when the job ends
the scaler records them as ``scaler.recommended``. The figures live under the
plugin's store key ``usage``, so a master that takes over the job carries them on.

Membership decisions (growing and shrinking a running job within MIN:MAX) are
the scaler's to make too; they are not built yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from stead.plugin import JobFailed, JobStopped, JobSucceeded, Plugin, PluginContext, Record
from stead.plugins.scaler.events import ResourcesRecommended
from stead.plugins.scaler.recommend import Recommendation, recommend
from stead.plugins.scaler.settings import ScalerSettings
from stead.plugins.scaler.usage import UsageBook

__all__ = ["ResourcesRecommended", "ScalerPlugin", "ScalerSettings"]

Ctx = PluginContext[ScalerSettings]


class ScalerPlugin(Plugin[ScalerSettings]):
    name = "scaler"
    settings_class = ScalerSettings
    subscriptions = (JobSucceeded, JobFailed, JobStopped)

    def __init__(self, *, settings: ScalerSettings | None = None) -> None:
        super().__init__(settings=settings or ScalerSettings())
        self.book = UsageBook()
        #: node id -> when (the master's clock) its figures were last added: a silent node is not counted again
        self._added_at: dict[str, float] = {}
        self._watch: asyncio.Task[None] | None = None
        #: heartbeats looked at so far (one per node and look, whatever they reported)
        self.looks = 0
        self._saved_looks = -1

    async def start(self, *, ctx: Ctx) -> None:
        kv = await ctx.store.get(ctx.key("usage"))
        if kv is not None:
            try:
                self.book = UsageBook.from_json(json.loads(kv.value))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:  # figures are advice: start afresh
                ctx.log.warning("scaler_usage_unreadable", error=repr(exc), action="counting from now on")
        self._watch = asyncio.create_task(self._sample_every(ctx), name="scaler-sample")

    async def stop(self, *, ctx: Ctx) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self.sample(ctx)
            await self._save(ctx)

    async def handle(self, *, record: Record, ctx: Ctx) -> None:
        """The job ended: record what it used and what to request next time, once per run of the job."""
        life = ctx.state.life
        done = await ctx.store.get(ctx.key("recommended"))
        if done is not None and done.value == str(life).encode():
            return  # a master that took over replays the end: recorded already
        self.sample(ctx)
        await ctx.emit(self.recommendation())
        await ctx.store.put(ctx.key("recommended"), str(life).encode())
        await self._save(ctx)

    def sample(self, ctx: Ctx) -> None:
        """Add each node's figures reported since the last look."""
        for node_id, seen in ctx.node_telemetry().items():
            if seen.seen <= self._added_at.get(node_id, -1.0):
                continue
            self._added_at[node_id] = seen.seen
            self.looks += 1
            self.book.add(node_id, {"rss_bytes": seen.rss_bytes, "cpu_percent": seen.cpu_percent,
                                    "gpu_memory_bytes": seen.gpu_memory_bytes,
                                    "gpu_util_percent": seen.gpu_util_percent})

    def recommendation(self) -> ResourcesRecommended:
        found = {r.resource: r for r in recommend(self.book, headroom=self.settings.headroom)}

        def figure(resource: str, field: str) -> float | None:
            made: Recommendation | None = found.get(resource)
            value = getattr(made, field) if made is not None else None
            return None if value is None else float(value)

        def size(resource: str, field: str) -> int | None:
            value = figure(resource, field)
            return None if value is None else int(value)

        return ResourcesRecommended(
            samples=self.book.samples, nodes=len(self.book.nodes),
            memory_peak_bytes=size("memory", "peak"), memory_p95_bytes=size("memory", "p95"),
            memory_recommend_bytes=size("memory", "recommend"),
            cpu_peak_cores=figure("cpu", "peak"), cpu_p95_cores=figure("cpu", "p95"),
            cpu_recommend_cores=figure("cpu", "recommend"),
            gpu_memory_peak_bytes=size("gpu_memory", "peak"), gpu_util_median_percent=figure("gpu_util", "median"),
            lines=tuple(r.line for r in found.values()))

    async def _sample_every(self, ctx: Ctx) -> None:
        while True:
            await asyncio.sleep(self.settings.sample_every_s)
            try:  # one look's failure is logged; the sampling goes on
                self.sample(ctx)
                await self._save(ctx)
            except Exception as exc:
                ctx.log.exception("scaler_sample_failed", error=repr(exc))

    async def _save(self, ctx: Ctx) -> None:
        """The figures, and the lines ``stead status`` shows for the scaler (written when there is news)."""
        if self.looks == self._saved_looks:
            return
        self._saved_looks = self.looks
        lines = [r.line for r in recommend(self.book, headroom=self.settings.headroom)]
        summary = ([f"resources, from {self.book.samples} looks at {len(self.book.nodes)} node(s):", *lines]
                   if lines else ["resources: no node has reported its use yet"])
        await ctx.store.put(ctx.key("usage"), json.dumps(self.book.to_json()).encode())
        await ctx.store.put(ctx.key("status"), json.dumps({"summary": summary, "at": time.time()}).encode())
