"""FlashCheckpointer: save a state dict into the agent's shared memory in the time of a memory copy.

Under ``stead run`` every worker has two slots of shared memory owned by its agent
(they outlive the worker). ``save`` copies the state dict into the slot that does
not hold the newest committed step, publishes it in the control block and tells
the agent with one non-blocking socket write: no RPC on the training thread. The
agent reports the save to the master, which commits the step once every rank holds
it; the agent computes checksums and, when asked (``persist=True``) or when a
worker failed, writes the step to disk in the background.

A save first makes sure the previous save was committed (normally long done: a
commit takes milliseconds). If it is not within ``ckpt_commit_wait_s`` (the master
is restarting) the save is skipped, and later saves are skipped without waiting
until the commit arrives: training never stops for checkpoints.

``load`` restores the committed step from shared memory (no disk read) when every
rank can, else the newest step every rank can take from the best copy it has (its
memory, its copy on disk, another rank's copy of a replicated state: ``_recover``),
else returns None.
Ranks agree through a tiny all-reduce on the process group, so call ``load`` after
``init_process_group`` (on a gloo group created for it when the default backend is
not gloo). Nothing read back is unpickled: the tree is JSON, tensors are raw bytes,
also when a step saved by another world size is resharded (``_fromdisk``).

Without a stead agent (plain ``torchrun`` or ``python``), FlashCheckpointer is
disk-only: ``save(..., persist=True)`` writes the step to disk before returning,
other saves keep nothing, and ``load`` reads from disk.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import structlog
import torch

from stead.core.worker.numerics_settings import RESTORE_BOUNDS_ENV, restore_bounds
from stead.core.worker.progress import resume_steps_at
from stead.plugin import load_settings
from stead.plugins.ckpt import _disk, _overlap
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._codec import Encoded, encode
from stead.plugins.ckpt._group import Group
from stead.plugins.ckpt._layout import SlotLayout, plan
from stead.plugins.ckpt._link import SOCKET_ENV, AgentLink
from stead.plugins.ckpt._mapped import MappedSlot
from stead.plugins.ckpt._memparts import MappedParts, map_parts, peer_access
from stead.plugins.ckpt._recover import Restore
from stead.plugins.ckpt._restore import Template
from stead.plugins.ckpt._shm import Control, SlotInfo
from stead.plugins.ckpt.errors import CheckpointError
from stead.plugins.ckpt.settings import CheckpointSettings

__all__ = ["STEP_ENV", "FlashCheckpointer", "kept_steps", "target_slot"]

log = structlog.get_logger("stead.ckpt")

STEP_ENV = "STEAD_CKPT_STEP"
ROUND_ENV = "STEAD_CKPT_ROUND"
PATH_ENV = "STEAD_CKPT_PATH"
#: how the sleep between two looks at the control block grows while a save waits for a commit
_POLL_FIRST_S, _POLL_MAX_S = 0.0001, 0.002
#: slack added to a slot when it has to grow, so that a slightly bigger state does not regrow it
_GROWTH = 1.25
#: a (round, step) pair packed into one int64 for an all-reduce: steps below 2**40
_STEP_BITS = 40


@dataclasses.dataclass
class _Cached:
    """The slot layout of the last state-dict structure saved."""

    signature: tuple[Any, ...]
    layout: SlotLayout


class FlashCheckpointer:
    """Save and restore a rank's state dict through its agent's shared memory (see the module docstring).

    ``size_hint`` (bytes, or a state dict to measure) lets the agent allocate and
    pre-fault both slots while training starts, so the first save costs no more than
    the later ones. ``copy_mode="overlap"`` returns from ``save`` as soon as CUDA
    copies are queued: the next step's forward and backward run while they copy,
    and the training stream waits for them (on the GPU) only before an optimizer's
    ``step()`` or the forward of a module whose saved buffers it would update
    (``_overlap``); CPU tensors are always copied before ``save`` returns.
    """

    def __init__(self, *, size_hint: int | Mapping[str, Any] | None = None,
                 copy_mode: Literal["sync", "overlap"] = "sync", settings: CheckpointSettings | None = None,
                 rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                 job: str | None = None) -> None:
        env = os.environ
        if copy_mode not in ("sync", "overlap"):
            raise ValueError(f"copy_mode={copy_mode!r} must be 'sync' or 'overlap'")
        self.settings = settings if settings is not None else load_settings(CheckpointSettings, "ckpt")
        self.rank = int(env.get("RANK", "0")) if rank is None else rank
        self.world_size = int(env.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.local_rank = int(env.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self.round = int(env.get("STEAD_ROUND", "0"))
        self.copy_mode = copy_mode
        # under plain torchrun or python: named after the script, so that running it again finds its checkpoints
        # (torchrun's run id is no key: --standalone draws a new one each time)
        job_name = job or env.get("STEAD_JOB") or Path(sys.argv[0] if sys.argv and sys.argv[0] else "").stem
        job_name = job_name if job_name and job_name not in ("-c", "-m") else "default"
        self.path = Path(env.get(PATH_ENV) or Path(self.settings.dir).resolve() / job_name)
        self._hint = (int(env.get(STEP_ENV, "-1")), int(env.get(ROUND_ENV, "0")))
        self._slots: dict[int, MappedSlot] = {}
        self._cache: _Cached | None = None
        self._pending: int | None = None  # the last step saved and not yet known to be committed
        self._degraded = False
        self._restored: tuple[int, int] | None = None  # (step, round) of the slot load() restored from
        self._persist_requested = -1
        self._group = Group(rank=self.rank, world=self.world_size)
        self._copy_stream: Any = None
        self._finishing: threading.Thread | None = None
        self._reserved = threading.Event()
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None
        self._link: AgentLink | None = None
        self._control: Control | None = None
        self._data_prefix = ""
        self._map_lock = threading.Lock()
        socket_path = env.get(SOCKET_ENV)
        if socket_path:
            self._link = AgentLink(socket_path, timeout_s=self.settings.agent_timeout_s)
            reply = self._link.request({"op": "hello", "local_rank": self.local_rank, "rank": self.rank,
                                        "world": self.world_size, "round": self.round, "pid": os.getpid()})
            self._control = Control(str(reply["control"]))
            self._data_prefix = str(reply["data_prefix"])
            self._prefault_restore()
        if size_hint is not None:
            self.reserve(size_hint)
        else:
            self._reserved.set()

    # -- public API -------------------------------------------------------------------------------

    @property
    def mode(self) -> Literal["agent", "disk"]:
        """``agent``: shared memory through a stead agent; ``disk``: no agent, persisted saves only."""
        return "agent" if self._link is not None else "disk"

    def reserve(self, size: int | Mapping[str, Any]) -> None:
        """Have both slots allocated and pre-faulted for ``size`` bytes (or this state dict), in the background."""
        if self._link is None:
            self._reserved.set()
            return
        if isinstance(size, int):
            nbytes = size
        else:
            encoded = encode(size)
            layout = self._plan(encoded)
            nbytes = layout.needed(layout.document(tree=encoded.tree, step=1 << 40, round_=self.round,
                                                   rank=self.rank, world=self.world_size))
        cuda = _cuda_device(isinstance(size, int) or any(m.device == "cuda" for m in encoded.metas))
        if cuda is not None and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # not in the first save
        if self._reserving is not None:
            self._reserving.join()
        self._reserved.clear()
        slack = nbytes // 100 + (1 << 20)  # the layout document and the checksums, if ``size`` counted tensors only
        self._reserving = threading.Thread(target=self._reserve_slots, args=(nbytes + slack, (0, 1), True, cuda),
                                           name="stead-ckpt-reserve", daemon=True)
        self._reserving.start()

    def save(self, step: int, state_dict: Mapping[str, Any], *, persist: bool = False) -> bool:
        """Copy ``state_dict`` as ``step``; True when saved, False when skipped (see the module docstring).

        Returns as soon as the in-memory copy is done. ``persist=True`` asks the agent to
        write the step to disk once every rank holds it (``wait_persisted`` waits for it).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        if self._link is None:
            if persist:
                self._save_to_disk(step, state_dict)
            return persist
        started = time.perf_counter()
        self._finish_previous()
        encoded = encode(state_dict)
        layout = self._plan(encoded)
        document = layout.document(tree=encoded.tree, step=step, round_=self.round, rank=self.rank,
                                   world=self.world_size)
        self._wait_reserved()
        if not self._previous_resolved():
            self._link.notify({"op": "skipped", "step": step})
            return False
        control = self._ctl
        with control.locked():
            target = self._target(control)
            seq = -1 if target is None else control.begin_write(target)
        if target is None:
            log.debug("ckpt_save_skipped", step=step, reason="both slots are kept (the newest commit, a persist's "
                                                              "step, the replicated step or the one copied to peers)")
            self._link.notify({"op": "skipped", "step": step})
            return False
        try:
            mapped = self._ensure_capacity(target, layout.needed(document))
            with torch.no_grad():
                pending_cuda = self._copy(encoded, layout, mapped)
            mapped.mm[layout.layout_off:layout.layout_off + len(document)] = document
        except BaseException:
            control.abandon_write(target)
            raise
        finish = dict(index=target, seq=seq, step=step, layout=layout, document=document, persist=persist,
                      started=started)
        if pending_cuda is not None and self.copy_mode == "overlap":
            self._finishing = threading.Thread(target=self._finish_after, args=(pending_cuda, finish),
                                               name="stead-ckpt-finish", daemon=True)
            self._finishing.start()
        else:
            if pending_cuda is not None:
                pending_cuda.synchronize()
            self._publish(**finish)  # type: ignore[arg-type]
        return True

    def load(self, state_dict: Template = None, *, strict: bool = False) -> tuple[int, dict[Any, Any]] | None:
        """The newest committed ``(step, state_dict)``: from memory, else from disk, else None.

        With ``state_dict`` (e.g. ``{"model": model.state_dict(), "optim": opt.state_dict()}``)
        tensors are copied in place into its tensors where the structure matches (the fast
        path: parameters are restored without a new allocation); DTensor shards need it.
        ``state_dict`` may be a function of the checkpoint's structure (its tensors shown as
        :class:`TensorMeta`) returning that mapping: it is called, on every rank, only when
        a step will be restored. Every tensor is checked against the mapping before any is
        copied (a mismatch raises :class:`StateMismatch` and nothing is loaded); with
        ``strict``, the tensors under each of the mapping's top-level keys must also be the
        same set as the checkpoint's, and a missing or unexpected one is named.

        After a replica mismatch the master bounds what may be restored (``STEAD_CKPT_RESTORE_BOUNDS``): the
        newest committed step at or before the last step whose fingerprints agreed, from any tier; None when no
        tier holds one (the script starts from its initial state).
        """
        self._finish_previous()
        self._hint = self._newest_hint()
        restore = Restore(rank=self.rank, world=self.world_size, root=self.path, settings=self.settings,
                          group=self._group, control=self._control, mapped=self._mapped,
                          report_corrupt=self._report_corrupt,
                          bounds=restore_bounds(os.environ.get(RESTORE_BOUNDS_ENV, "")))
        candidate = restore.memory_candidate(self._hint)
        result: tuple[int, dict[Any, Any]] | None = None
        tier, own, peer, other_nodes = "none", 0, 0, 0
        if self._group.agree(candidate is not None) and candidate is not None:
            slot, doc = candidate
            template = restore.agreed_template(state_dict, doc.tree, doc.tensors, strict, doc.step)
            result = doc.step, restore.restore_memory(slot, doc, template)
            self._restored = (doc.step, doc.round)
            tier = "memory"
        elif (resharded := restore.reshard_from_memory(state_dict, self._hint, self._memory_parts)) is not None:
            result, own, peer, other_nodes = resharded
            tier = "reshard"
        else:
            result, source = restore.from_tiers(state_dict, candidate, strict)
            if source is not None:
                tier = source.tier
                if source.memory is not None:
                    self._restored = (source.step, source.round)
        if self._link is not None:
            self._link.notify({"op": "restored", "step": result[0] if result else -1, "tier": tier,
                               **({"own": own, "peer": peer, "remote": other_nodes} if tier == "reshard" else {})})
        if result is not None:
            log.info("ckpt_restored", step=result[0], tier=tier, rank=self.rank)
            resume_steps_at(result[0] + 1)  # automatic step detection goes on from the restored step
        return result

    def _memory_parts(self, step: int, round_: int) -> MappedParts | None:
        """Every copy this node holds of the old ranks' slots of ``step`` (saved in ``round_``), mapped, and how to
        reach other nodes' replica ports for those it lacks; None without an agent."""
        if self._link is None:
            return None
        reply = self._link.request({"op": "parts", "step": step, "round": round_})
        if not reply.get("ok"):
            raise CheckpointError(f"the agent could not list the slots of step {step} it holds: "
                                  f"{reply.get('error')}")
        node_prefix = self._data_prefix.rpartition("-r")[0] + "-"  # this node's segments, whichever local rank's
        return map_parts(reply.get("parts"), step=step, round_=round_, prefix=node_prefix,
                         access=peer_access(reply.get("port")))

    def wait_persisted(self, timeout: float | None = None) -> int | None:
        """Wait until the newest ``persist=True`` save is on disk; its step, or None (none, failed or timed out)."""
        self._finish_previous()
        if self._link is None:
            return self._persist_requested if self._persist_requested >= 0 else None
        if self._persist_requested < 0:
            return None
        wait = self.settings.persist_grace_s if timeout is None else timeout
        reply = self._link.request({"op": "persisted", "step": self._persist_requested, "wait_s": wait},
                                   timeout_s=wait + self.settings.agent_timeout_s)
        step = int(reply.get("step", -1))
        return step if step >= self._persist_requested else None

    def close(self) -> None:
        """Unmap the slots and hang up on the agent (the agent keeps the memory)."""
        self._finish_previous()
        for mapped in list(self._slots.values()):
            mapped.stop_populating()
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        for mapped in self._slots.values():
            mapped.close()
        self._slots.clear()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._link is not None:
            self._link.close()
            self._link = None

    def __enter__(self) -> FlashCheckpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- saving ------------------------------------------------------------------------------------

    @property
    def _ctl(self) -> Control:
        if self._control is None:
            raise CheckpointError("this FlashCheckpointer was closed; create a new one")
        return self._control

    def _plan(self, encoded: Encoded) -> SlotLayout:
        signature = tuple((m.dtype, m.shape, m.device, m.global_shape, m.offsets) for m in encoded.metas)
        if self._cache is None or self._cache.signature != signature:
            if self._cache is not None:
                log.debug("ckpt_relayout", tensors=len(signature), reason="the state dict's structure changed")
            self._cache = _Cached(signature, plan([m.to_json() for m in encoded.metas]))
        return self._cache.layout

    def _wait_reserved(self) -> None:
        if not self._reserved.wait(self.settings.agent_timeout_s):
            raise CheckpointError("the agent did not allocate the checkpoint's shared memory in time; raise "
                                  "ckpt_agent_timeout_s")
        if self._reserve_error is not None:
            error, self._reserve_error = self._reserve_error, None
            raise error

    def _previous_resolved(self) -> bool:
        """Whether the previous save is committed or released; waits ckpt_commit_wait_s at most (once)."""
        if self._pending is None or self._resolved(self._pending):
            self._pending, self._degraded = None, False
            return True
        if self._degraded:
            return False
        deadline = time.monotonic() + self.settings.commit_wait_s
        pause = _POLL_FIRST_S
        while time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
            if self._resolved(self._pending):
                self._pending = None
                return True
        self._degraded = True
        log.warning("ckpt_commit_late", step=self._pending, waited_s=self.settings.commit_wait_s,
                    effect="saves are skipped until it is committed (is the master reachable?)")
        return False

    def _resolved(self, step: int) -> bool:
        control = self._ctl
        committed, committed_round = control.committed
        if committed_round == self.round and committed >= step:
            return True
        released, released_round = control.released
        return released_round == self.round and released == step

    def _target(self, control: Control) -> int | None:
        """The slot to write: none whose step must stay (:func:`kept_steps`, :func:`target_slot`)."""
        kept = kept_steps(round_=self.round, committed=control.committed, restored=self._restored,
                          pinned=control.pinned, replication=control.kept)
        return target_slot(control.slots(), kept)

    def _ensure_capacity(self, index: int, needed: int) -> MappedSlot:
        mapped = self._mapped(index)
        if mapped is None or mapped.capacity < needed:
            self._reserve_slots(int(needed * _GROWTH), (index,), False)
            mapped = self._mapped(index)
        if mapped is None or mapped.capacity < needed:
            raise CheckpointError(f"the agent did not grow slot {index} to {needed} bytes")
        return mapped

    def _prefault_restore(self) -> None:
        """Map the slot load() will restore and fault its pages in now, while the script builds its model."""
        if self._hint[0] < 0:
            return
        slot = next((s for s in self._ctl.slots() if s.holds(*self._hint)), None)
        mapped = self._mapped(slot.index) if slot is not None else None
        if mapped is not None:
            mapped.populate_in_background(_cuda_device(True))

    def _mapped(self, index: int) -> MappedSlot | None:
        """The mapping of slot ``index``, following the agent if it reallocated the segment."""
        with self._map_lock:
            return self._mapped_locked(index)

    def _mapped_locked(self, index: int) -> MappedSlot | None:
        info = self._ctl.slot(index)
        mapped = self._slots.get(index)
        if mapped is not None and mapped.gen == info.gen:
            return mapped
        if mapped is not None:
            mapped.close()
            del self._slots[index]
        if info.gen == 0 or info.capacity == 0:
            return None
        mapped = MappedSlot(self._data_name(index, info.gen), info.gen, info.capacity)
        self._slots[index] = mapped
        return mapped

    def _data_name(self, index: int, gen: int) -> str:
        return f"{self._data_prefix}s{index}-g{gen}"

    def _reserve_slots(self, nbytes: int, slots: tuple[int, ...], background: bool,
                       cuda_device: int | None = None) -> None:
        """Have the agent allocate; in the background, then fault the pages in, slot 0 (the first save's) first,
        and with ``cuda_device`` register each as pinned memory."""
        assert self._link is not None
        mapped: list[MappedSlot] = []
        try:
            self._link.request({"op": "reserve", "bytes": nbytes, "slots": list(slots)})
            mapped = [m for m in (self._mapped(index) for index in slots) if m is not None]
        except BaseException as exc:
            if not background:
                raise
            self._reserve_error = exc
        finally:
            if background:
                self._reserved.set()
        if background:
            for slot in mapped:  # one after the other: two at once on a busy node only slow each other down
                slot.prepare(cuda_device)

    def _copy(self, encoded: Encoded, layout: SlotLayout, mapped: MappedSlot) -> Any:
        """Copy every tensor; returns a CUDA event to wait for when device copies are in flight."""
        stream = None
        for tensor, offset, nbytes in zip(encoded.tensors, layout.offsets, layout.nbytes, strict=True):
            if tensor.device.type == "cuda" and stream is None:
                mapped.pin_for_cuda()
                if self._copy_stream is None:
                    self._copy_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                stream = self._copy_stream
                stream.wait_stream(torch.cuda.current_stream())
            mapped.copy_in(tensor, offset, nbytes, stream if tensor.device.type == "cuda" else None)
        if stream is None:
            return None
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
        if self.copy_mode == "overlap":  # else save() waits for ``done`` before it returns
            cuda = [t for t in encoded.tensors if t.device.type == "cuda"]
            for tensor in cuda:  # its memory is not reused while the copy reads it, even if the script drops it
                tensor.record_stream(stream)
            _overlap.guard(done, cuda)
        return done

    def _finish_after(self, event: Any, finish: dict[str, Any]) -> None:
        event.synchronize()
        _overlap.release(event)
        self._publish(**finish)

    def _finish_previous(self) -> None:
        if self._finishing is not None:
            self._finishing.join()
            self._finishing = None

    def _publish(self, *, index: int, seq: int, step: int, layout: SlotLayout, document: bytes,
                 persist: bool, started: float) -> None:
        self._ctl.end_write(index, seq=seq, step=step, round_=self.round, rank=self.rank, world=self.world_size,
                            data_bytes=layout.data_bytes, n_tensors=layout.n_tensors, checks_off=layout.checks_off,
                            layout_off=layout.layout_off, layout_len=len(document), layout_sum=checksum(document))
        self._pending = step
        if persist:
            self._persist_requested = step
        assert self._link is not None
        # seconds from save() to a complete copy: the step's stall (with a CUDA overlap, partly behind the next step)
        self._link.notify({"op": "saved", "slot": index, "step": step, "seq": seq + 1, "persist": persist,
                           "seconds": time.perf_counter() - started})

    def _save_to_disk(self, step: int, state_dict: Mapping[str, Any]) -> None:
        encoded = encode(state_dict)
        metas = [m.to_json() for m in encoded.metas]
        _disk.write_rank(self.path, step=step, round_=self.round, rank=self.rank, world=self.world_size,
                         tree=encoded.tree, metas=metas, tensors=list(encoded.tensors))
        _disk.finish_step(self.path, step, self.world_size, keep_last=self.settings.keep_last)
        self._persist_requested = step

    # -- restoring (the tiers and the ranks' agreement are in _recover) ---------------------------------

    def _report_corrupt(self, step: int, tier: str, detail: str) -> None:
        log.warning("ckpt_corrupt", step=step, tier=tier, rank=self.rank, detail=detail,
                    action="falling back to an older copy")
        if self._link is not None:
            self._link.notify({"op": "corrupt", "step": step, "tier": tier, "detail": detail})

    def _newest_hint(self) -> tuple[int, int]:
        """The newest committed step any rank's agent heard of (agents may ask the master a moment apart).

        Every committed step is held by every rank until a newer one is committed, so the
        newest is in every rank's memory.
        """
        step, round_ = self._hint
        key = (round_ << _STEP_BITS) | step if step >= 0 else -1
        newest = -self._group.min([-key])[0]
        if newest < 0:
            return -1, 0
        return newest & ((1 << _STEP_BITS) - 1), newest >> _STEP_BITS


def kept_steps(*, round_: int, committed: tuple[int, int], restored: tuple[int, int] | None, pinned: tuple[int, int],
               replication: tuple[tuple[int, int], tuple[int, int]]) -> list[tuple[int, int]]:
    """The (step, round) pairs a save of round ``round_`` must not overwrite:

    - the newest commit of this round, else the step this worker restored (what a restart restores);
    - the step a persist reads (``pinned``);
    - the replicated step R and the step being replicated X (``replication``, both (-1, -1) while the master does
      not ask to keep them), those of this round: the restored step stands for them until a step of this round is
      replicated, so that a host lost meanwhile still finds it in every survivor's memory.
    """
    kept = [pinned]
    if committed[1] == round_ and committed[0] >= 0:
        kept.append(committed)
    replicated, _ = replication
    if restored is not None and (len(kept) == 1 or (replicated[0] >= 0 and replicated[1] < round_)):
        kept.append(restored)
    kept += [pair for pair in replication if pair[0] >= 0 and pair[1] == round_]
    return kept


def target_slot(slots: list[SlotInfo], kept: list[tuple[int, int]]) -> int | None:
    """The slot a save writes: an empty or the oldest one among those holding none of the ``kept`` steps ((step,
    round) pairs: the newest commit, the step a persist reads, the replicated step and the one being replicated;
    (-1, -1): none); None when every slot holds one of them (the save is skipped)."""
    free = [slot for slot in slots if not any(step >= 0 and slot.holds(step, round_) for step, round_ in kept)]
    if not free:
        return None
    return min(free, key=lambda s: (s.complete, s.round, s.step)).index  # an empty or older slot first


def _cuda_device(wanted: bool) -> int | None:
    """The current CUDA device when ``wanted`` and this process already uses CUDA (slots are then registered as
    pinned memory in the background, on that device); None otherwise: a process that has not touched CUDA is not
    made to, and it registers a slot at its first CUDA copy instead."""
    return torch.cuda.current_device() if wanted and torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
