"""The scaler: what a job's nodes really used, and the requests to make for its next run.

Every ``sample_every_s`` it adds each node's last reported figures (its workers'
resident memory and CPU, its GPUs' memory and utilisation; a node reports none it
cannot measure) to one distribution per resource (:mod:`.usage`). ``stead status``
shows the peaks, percentiles and recommendations so far (:mod:`.recommend`: e.g.
"memory: peak 11.2Gi, p95 10.8Gi per node; recommend 14Gi"), and when the job ends
the scaler records them as ``scaler.recommended``. The figures live under the
plugin's store key ``usage``, so a master that takes over the job carries them on.

It also owns membership: how many nodes the job runs on, within MIN:MAX. Its
policy (:mod:`.membership`, pluggable) decides a target after each ``stead scale``
request (served here, ``ScalerService.Scale``), after a node is lost or exits, and
every ``policy_every_s``; the decision is recorded as ``membership.decided`` and the
job machine requests or retires nodes and resizes the running round to match.

A node its platform killed for its memory (a Kubernetes pod's ``OOMKilled``) waits
for its resources before it is relaunched: the scaler multiplies its memory limit
by ``oom_memory_factor`` (capped by ``max_memory``, at most ``oom_memory_budget``
times per node) and records it as ``node.resources_decided``, which the job
machine relaunches it with.

A failure the diagnosis classifies as out of memory is answered on the local platform
by a smaller per-worker batch hint (``oom_batch_factor`` per OOM, ``oom_budget`` of
them, recorded as ``scaler.oom``): agents pass it to the next rounds' workers as
``STEAD_BATCH_SCALE`` (:class:`.agent.ScalerAgentExtension`), which scripts opt into with
``stead.data.batch_size``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time

from stead.core.quantity import QuantityError, format_bytes, parse_quantity
from stead.plugin import (
    MAX_NODE_ID_CHARS,
    ChunkedValue,
    CodecError,
    JobFailed,
    JobStopped,
    JobSucceeded,
    MembershipDecided,
    NodeExited,
    NodeLost,
    NodePending,
    NodeResourcesDecided,
    Plugin,
    PluginContext,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RetryableError,
    RoomFound,
    RoundStarted,
    at_least,
    backend_errors,
    check_name,
    invalid,
)
from stead.plugins.scaler._proto.stead import v1 as proto
from stead.plugins.scaler.events import (
    DecisionRejected,
    OomAnswered,
    PendingAnswered,
    ResourcesRecommended,
    ScaleRequested,
)
from stead.plugins.scaler.membership import Decision, MembershipPolicy, MembershipView, check, load_policy
from stead.plugins.scaler.recommend import Recommendation, recommend
from stead.plugins.scaler.settings import ScalerSettings
from stead.plugins.scaler.usage import UsageBook

__all__ = ["Decision", "MembershipView", "ResourcesRecommended", "ScaleRequested", "ScalerPlugin", "ScalerSettings",
           "proto"]

Ctx = PluginContext[ScalerSettings]

#: after a node is lost or a round starts, the policy looks again this much later, once for the whole burst
_BURST_S = 0.2


class ScalerPlugin(Plugin[ScalerSettings]):
    name = "scaler"
    settings_class = ScalerSettings
    subscriptions = (JobSucceeded, JobFailed, JobStopped, NodeLost, NodeExited, NodePending, RoomFound,
                     RoundStarted, RecoveryDecided)

    def __init__(self, *, settings: ScalerSettings | None = None) -> None:
        super().__init__(settings=settings or ScalerSettings())
        self.book = UsageBook()
        #: node id -> when (the master's clock) its figures were last added: a silent node is not counted again
        self._added_at: dict[str, float] = {}
        self._watch: asyncio.Task[None] | None = None
        #: heartbeats looked at so far (one per node and look, whatever they reported)
        self.looks = 0
        self._saved_looks = -1
        self.policy: MembershipPolicy | None = None
        #: the latest request (None: none yet) and the nodes lost or exited while the job ran
        self.requested: int | None = None
        self.losses = 0
        #: out-of-memory failures answered, and the batch scale they led to
        self.ooms = 0
        self.batch_scale = 1.0
        self._oom_seq = 0  # the last OOM decision answered (a master that takes over replays the log)
        #: node id -> how many times its memory limit was raised; the last out-of-memory kill answered
        self.memory_raises: dict[str, int] = {}
        self._kill_seq = 0
        #: while the platform has no room for some nodes: how many it has room for, until when (time.time())
        self._room: tuple[int, float] | None = None
        #: what the nodes asked their platform for (bytes of memory, cores of cpu), where it says
        self._requested: dict[str, float] = {}
        #: the newest round whose start this plugin handled: every decision before it is answered
        self._round_seen = 0
        self._round_changed = asyncio.Condition()
        self._last_rejected = ""
        self._deciding = asyncio.Lock()
        self._decide_task: asyncio.Task[None] | None = None
        #: set by the events that call for a new look (a node gone, a round started): one look for many of them
        self._wake = asyncio.Event()
        #: the figures in the store: their node list grows with the job (past one etcd write at some 100,000 nodes)
        self._usage: ChunkedValue | None = None

    async def start(self, *, ctx: Ctx) -> None:
        self._usage = ChunkedValue(ctx.store, ctx.key("usage"))
        try:
            saved_usage = await self._usage.get()
            if saved_usage is not None:
                self.book = UsageBook.from_json(json.loads(saved_usage))
        except (CodecError, ValueError, TypeError, KeyError, AttributeError) as exc:  # advice: start afresh
            ctx.log.warning("scaler_usage_unreadable", error=repr(exc), action="counting from now on")
        self.policy = load_policy(self.settings.policy)
        kv = await ctx.store.get(ctx.key("membership"))
        if kv is not None:
            try:
                saved = json.loads(kv.value)
                self.requested = None if saved["requested"] is None else int(saved["requested"])
                self.losses = int(saved["losses"])
                self.ooms, self.batch_scale = int(saved.get("ooms", 0)), float(saved.get("batch_scale", 1.0))
                self._oom_seq = int(saved.get("oom_seq", 0))
                self.memory_raises = {str(k): int(v) for k, v in (saved.get("memory_raises") or {}).items()}
                self._kill_seq = int(saved.get("kill_seq", 0))
            except (ValueError, TypeError, KeyError) as exc:
                ctx.log.warning("scaler_membership_unreadable", error=repr(exc), action="no request in force")
        ctx.add_rpc_handler(ScalerServicer(self, ctx))
        self._watch = ctx.tasks.start(self._sample_every, ctx, name="sample")
        self._decide_task = ctx.tasks.start(self._decide_every, ctx, name="decide")

    async def stop(self, *, ctx: Ctx) -> None:
        # (under a master its tasks have ended already; a context of a test's own ends them here)
        await ctx.tasks.end(self._decide_task, self._watch)
        if self._watch is not None:
            self.sample(ctx)
            await self._save(ctx)

    async def handle(self, *, record: Record, ctx: Ctx) -> None:
        """A node went away: ask the policy again; an OOM: shrink the batch hint; the job ended: record what it
        used, once per run of the job."""
        if isinstance(record.event, RecoveryDecided):
            if (record.event.failure_class == "oom" and record.event.action is RecoveryAction.RESTART
                    and (record.seq or 0) > self._oom_seq):
                self._oom_seq = record.seq or 0
                await self.out_of_memory(ctx, record.event)
            return
        if isinstance(record.event, NodePending):
            if not ctx.state.phase.terminal:
                await self.no_room(ctx, record.event)
            return
        if isinstance(record.event, RoomFound):
            if self._room is not None and not ctx.state.phase.terminal:  # what it gave up on may fit now
                ctx.log.info("scaler_room_found", reason=record.event.reason, gave_up_room=self._room[0])
                self._room = None
                await self.decide(ctx)
            return
        if isinstance(record.event, NodeExited) and record.event.oom and (record.seq or 0) > self._kill_seq:
            self._kill_seq = record.seq or 0
            if not ctx.state.phase.terminal:
                await self.more_memory(ctx, record.event)
        if isinstance(record.event, RoundStarted):
            async with self._round_changed:
                self._round_seen = max(self._round_seen, record.event.round)
                self._round_changed.notify_all()
        if isinstance(record.event, (NodeLost, NodeExited, RoundStarted)):
            if isinstance(record.event, (NodeLost, NodeExited)) and not ctx.state.phase.terminal:
                self.losses += 1
            self._wake.set()  # the policy looks again shortly, once for a burst (a mass failure is many losses)
            return
        life = ctx.state.life
        done = await ctx.store.get(ctx.key("recommended"))
        if done is not None and done.value == str(life).encode():
            return  # a master that took over replays the end: recorded already
        self.sample(ctx)
        await ctx.emit(self.recommendation())
        await ctx.store.put(ctx.key("recommended"), str(life).encode())
        await self._save(ctx)

    def sample(self, ctx: Ctx) -> None:
        """Add each node's figures reported since the last look, and note what the nodes asked their platform for
        (the largest memory and CPU limit of a live node, where the platform says)."""
        asked: dict[str, float] = {}
        for node in ctx.current_state().nodes.values():
            for name, value in node.resources:
                if name in ("memory", "cpu") and node.phase.alive:
                    with contextlib.suppress(QuantityError):
                        asked[name] = max(asked.get(name, 0.0), float(parse_quantity(value)))
        if asked:
            self._requested = asked
        for node_id, seen in ctx.node_telemetry().items():
            if seen.seen <= self._added_at.get(node_id, -1.0):
                continue
            self._added_at[node_id] = seen.seen
            self.looks += 1
            self.book.add(node_id, {"rss_bytes": seen.rss_bytes, "cpu_percent": seen.cpu_percent,
                                    "gpu_memory_bytes": seen.gpu_memory_bytes,
                                    "gpu_util_percent": seen.gpu_util_percent})

    def recommendation(self) -> ResourcesRecommended:
        found = {r.resource: r for r in recommend(self.book, headroom=self.settings.headroom,
                                                  requested=self._requested)}

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
            await ctx.clock.sleep(self.settings.sample_every_s)
            try:  # one look's failure is logged; the sampling goes on
                self.sample(ctx)
                await self._save(ctx)
            except RetryableError as exc:  # the store is away: said once a look, without a traceback
                ctx.log.warning("scaler_sample_failed", error=str(exc))
            except Exception as exc:
                ctx.log.exception("scaler_sample_failed", error=repr(exc))

    async def _save(self, ctx: Ctx) -> None:
        """The figures, and the lines ``stead status`` shows for the scaler (written when there is news)."""
        if self.looks == self._saved_looks:
            return
        self._saved_looks = self.looks
        lines = [r.line for r in recommend(self.book, headroom=self.settings.headroom, requested=self._requested)]
        summary = ([f"resources, from {self.book.samples} looks at {len(self.book.nodes)} node(s):", *lines]
                   if lines else ["resources: no node has reported its use yet"])
        self._usage = self._usage or ChunkedValue(ctx.store, ctx.key("usage"))
        await self._usage.put(json.dumps(self.book.to_json()).encode())
        await ctx.store.put(ctx.key("status"), json.dumps({"summary": summary, "at": time.time()}).encode())

    # -- membership ----------------------------------------------------------------------------------------

    def view(self, ctx: Ctx) -> MembershipView | None:
        state = ctx.current_state()
        spec = state.spec
        if spec is None or state.phase.terminal:
            return None
        capacity = ctx.stead_settings.capacity_nodes or None
        source = "capacity_nodes"
        if self._room is not None and time.time() < self._room[1] and (capacity is None or self._room[0] < capacity):
            capacity, source = self._room[0], "the nodes the platform has room for now"
        live = sum(1 for n, s in state.nodes.items() if s.phase.alive and n not in state.retired)
        return MembershipView(min_nodes=spec.min_nodes, max_nodes=spec.max_nodes, target=state.target_nodes,
                              requested=self.requested, capacity=capacity, capacity_source=source, live=live,
                              ready=sum(1 for n in state.ready if n not in state.retired),
                              members=len(state.rdzv.members) if state.rdzv.active else 0, losses=self.losses,
                              phase=state.phase.value)

    async def request(self, ctx: Ctx, *, nodes: int, by: str, reason: str) -> tuple[int, int, str]:
        """Someone asks for ``nodes`` nodes: checked, recorded, decided; (target, previous target, why)."""
        state = ctx.current_state()
        spec = state.spec
        if spec is None:
            invalid(f"job {ctx.job!r} has not been submitted yet; wait until it runs")
        if state.phase.terminal:
            invalid(f"job {ctx.job!r} has {state.phase.value}; only a running job can be scaled (stead run resumes it)")
        if not spec.min_nodes <= nodes <= spec.max_nodes:
            invalid(f"--nodes {nodes} is outside the job's MIN:MAX {spec.min_nodes}:{spec.max_nodes}; a job's range "
                    "is fixed when it starts (stead run --nnodes MIN:MAX)")
        previous = state.target_nodes
        await ctx.emit(ScaleRequested(nodes=nodes, by=by or "unnamed", reason=reason))
        self.requested = nodes
        await self._save_membership(ctx)
        target, why = await self.decide(ctx)
        return target, previous, why

    async def decide(self, ctx: Ctx) -> tuple[int, str]:
        """Ask the policy; record its decision (or its refusal); the target in force afterwards, and why."""
        async with self._deciding:
            view = self.view(ctx)
            if view is None or self.policy is None:
                return 0, "the job is not running"
            try:
                decision: object = self.policy.decide(view)
            except Exception as exc:
                ctx.log.exception("scaler_policy_failed", policy=self.settings.policy)
                return await self._rejected(ctx, view, returned=repr(exc), reason="the policy raised an exception")
            problem = check(decision, view)
            if problem:
                return await self._rejected(ctx, view, returned=repr(decision), reason=problem)
            if not isinstance(decision, Decision) or decision.target == view.target:
                return view.target, "unchanged"
            self._last_rejected = ""
            await ctx.emit(MembershipDecided(target=decision.target, reason=decision.reason,
                                             by=f"scaler ({self.settings.policy} policy)"))
            ctx.log.info("scaler_decided", target=decision.target, previous=view.target, reason=decision.reason)
            return decision.target, decision.reason

    async def _rejected(self, ctx: Ctx, view: MembershipView, *, returned: str, reason: str) -> tuple[int, str]:
        why = f"the {self.settings.policy} policy {reason}; the job keeps {view.target} nodes"
        if why != self._last_rejected:  # a policy that keeps returning the same nonsense is recorded once
            self._last_rejected = why
            ctx.log.error("scaler_decision_rejected", policy=self.settings.policy, returned=returned, reason=reason)
            await ctx.emit(DecisionRejected(policy=self.settings.policy, returned=returned[:500], reason=why))
        return view.target, why

    async def _decide_every(self, ctx: Ctx) -> None:
        saved_losses = self.losses
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.policy_every_s):
                    await self._wake.wait()
                    await asyncio.sleep(_BURST_S)
            self._wake.clear()
            try:  # one look's failure is logged; the policy is asked again next time
                if self.losses != saved_losses:
                    saved_losses = self.losses
                    await self._save_membership(ctx)
                await self.decide(ctx)
            except Exception as exc:
                ctx.log.exception("scaler_decide_failed", error=repr(exc))

    async def batch_hint(self, round_: int, *, wait_s: float) -> float:
        """The batch scale for the workers of ``round_``: once the plugin has seen that round start (so the OOM
        that led to it was answered), or after ``wait_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s), self._round_changed:
                await self._round_changed.wait_for(lambda: self._round_seen >= round_)
        return self.batch_scale

    async def out_of_memory(self, ctx: Ctx, decided: RecoveryDecided) -> None:
        """Answer an OOM: a smaller batch hint for the next rounds, within the budget; recorded either way."""
        self.ooms += 1
        if self.ooms <= self.settings.oom_budget:
            self.batch_scale *= self.settings.oom_batch_factor
            reason = (f"out of memory in rank {decided.rank} (round {decided.round}): the workers restart with "
                      f"STEAD_BATCH_SCALE={self.batch_scale:g} (scripts opt in with stead.data.batch_size)")
        else:
            reason = (f"out of memory again (OOM {self.ooms}, oom_budget {self.settings.oom_budget} spent): the "
                      f"workers restart with the same STEAD_BATCH_SCALE={self.batch_scale:g}")
        ctx.log.warning("scaler_oom", ooms=self.ooms, batch_scale=self.batch_scale, rank=decided.rank)
        await self._save_membership(ctx)
        await ctx.emit(OomAnswered(ooms=self.ooms, batch_scale=self.batch_scale, reason=reason))

    async def no_room(self, ctx: Ctx, pending: NodePending) -> None:
        """The platform has no room for a node: go on without the nodes it has no room for while MIN hold (asked
        again after pending_retry_s), else wait for them; recorded either way."""
        state = ctx.current_state()
        node = state.nodes.get(pending.node_id)
        spec = state.spec
        if spec is None or node is None or node.incarnation != pending.incarnation or node.phase.value != "requested":
            return  # it started meanwhile, or was replaced
        live = [n for n, s in state.nodes.items() if s.phase.alive and n not in state.retired]
        waiting = [n for n in live if state.nodes[n].phase.value == "requested" and state.nodes[n].pending]
        room = len(live) - max(1, len(waiting))
        retry = self.settings.pending_retry_s
        if room >= spec.min_nodes:
            self._room = (room, time.time() + retry)
            if self.requested is None:  # what the job aims at once there is room again
                self.requested = state.target_nodes
                await self._save_membership(ctx)
            decision = "give_up"
            reason = (f"{pending.node_id} got no room for {pending.pending_s:.0f} s ({pending.reason}): the job goes "
                      f"on with {room} node(s) and asks for more again in {retry:g} s (scaler.pending_retry_s)")
        else:
            decision = "wait"
            reason = (f"{pending.node_id} got no room for {pending.pending_s:.0f} s ({pending.reason}): MIN "
                      f"{spec.min_nodes} needs it, so the job waits (it fails after join_timeout_s="
                      f"{spec.join_timeout_s:g} s if it gets none)")
        ctx.log.warning("scaler_no_room", node=pending.node_id, decision=decision, room=room)
        await ctx.emit(PendingAnswered(node_id=pending.node_id, incarnation=pending.incarnation, decision=decision,
                                       reason=reason))
        if decision == "give_up":
            await self.decide(ctx)

    async def more_memory(self, ctx: Ctx, exited: NodeExited) -> None:
        """A node killed for its memory: its next incarnation gets more (within the budget and the cap)."""
        node = ctx.state.nodes.get(exited.node_id)
        given = dict(node.resources) if node is not None else {}
        raised = self.memory_raises.get(exited.node_id, 0)
        resources: tuple[tuple[str, str], ...] = tuple(sorted(given.items()))
        memory = given.get("memory", "")
        try:
            limit = float(parse_quantity(memory)) if memory else 0.0
            cap = float(parse_quantity(self.settings.max_memory)) if self.settings.max_memory else math.inf
        except QuantityError as exc:
            limit, cap, memory = 0.0, math.inf, ""
            ctx.log.warning("scaler_memory_unreadable", node=exited.node_id, error=str(exc))
        if not memory:
            reason = ("it was killed for its memory but had no memory limit to raise: relaunched as it was (give "
                      "the job a memory request, e.g. --set k8s.memory=32Gi)")
        elif raised >= self.settings.oom_memory_budget:
            reason = (f"killed for its memory again with {memory} (oom_memory_budget {self.settings.oom_memory_budget}"
                      " spent): relaunched with the same limit")
        elif limit >= cap:
            reason = f"killed for its memory with {memory}, already at max_memory: relaunched with the same limit"
        else:
            more = format_bytes(min(limit * self.settings.oom_memory_factor, cap))
            resources = tuple(sorted({**given, "memory": more}.items()))
            self.memory_raises[exited.node_id] = raised + 1
            factor = self.settings.oom_memory_factor
            reason = (f"killed for its memory with {memory}: relaunched with {more} (x{factor:g}, raise {raised + 1} "
                      f"of {self.settings.oom_memory_budget})")
        ctx.log.warning("scaler_more_memory", node=exited.node_id, incarnation=exited.incarnation, reason=reason)
        await self._save_membership(ctx)
        await ctx.emit(NodeResourcesDecided(node_id=exited.node_id, incarnation=exited.incarnation,
                                            resources=resources, reason=reason, by="scaler"))

    async def _save_membership(self, ctx: Ctx) -> None:
        saved = {"requested": self.requested, "losses": self.losses, "ooms": self.ooms,
                 "batch_scale": self.batch_scale, "oom_seq": self._oom_seq, "memory_raises": self.memory_raises,
                 "kill_seq": self._kill_seq}
        await ctx.store.put(ctx.key("membership"), json.dumps(saved).encode())


class ScalerServicer(proto.ScalerServiceBase):
    """ScalerService: ``stead scale`` and the embedding API (every call authenticated by the RpcServer)."""

    def __init__(self, plugin: ScalerPlugin, ctx: Ctx) -> None:
        self._plugin = plugin
        self._ctx = ctx

    async def scale(self, message: proto.ScaleRequest) -> proto.ScaleReply:
        # ``by`` and ``reason`` are bounded as the request is decoded (the server refuses longer ones)
        with backend_errors("ScalerService.Scale"):
            target, previous, why = await self._plugin.request(self._ctx, nodes=message.nodes, by=message.by,
                                                               reason=message.reason)
        return proto.ScaleReply(target=target, previous=previous, reason=why)

    async def batch_hint(self, message: proto.BatchHintRequest) -> proto.BatchHintReply:
        check_name("BatchHintRequest.node_id", message.node_id, max_chars=MAX_NODE_ID_CHARS,
                   what="the node's id (STEAD_NODE_ID)")
        at_least("BatchHintRequest.round", message.round, 0, "rendezvous rounds count from 0 (STEAD_ROUND)")
        # a round the job has started is one this plugin will see start: wait for it (the agent's call times out
        # after rpc_timeout_s); a round the job has not started may never come, and is answered at once
        started = message.round <= self._ctx.current_state().rdzv.round
        wait = self._ctx.stead_settings.rpc_timeout_s / 2 if started else 0.0
        scale = await self._plugin.batch_hint(message.round, wait_s=wait)
        return proto.BatchHintReply(batch_scale=scale, ooms=self._plugin.ooms)
