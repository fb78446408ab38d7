"""Restoring a step on every rank: the ranks agree on the step, then each takes it from the best copy it has.

When every rank holds the committed step in its agent's memory, each copies it from there
(:meth:`Restore.memory_candidate`, no disk read). Otherwise (:meth:`Restore.from_tiers`) the
ranks agree on the newest step that every rank can take, each from the best tier that has it:

1. its own memory: the committed step, or an older one still in the other slot when it is known committed (the
   rank's agent heard of its commit, or it is the replicated or replicating step the worker keeps, or it was
   fetched from a peer host's replica: only committed steps are replicated; or some rank's agent wrote it to disk:
   agents write committed steps only), checked against its checksums;
2. its own copy on disk, saved at this world size;
3. another rank's copy on disk, for a replicated state only (DDP: :mod:`._copies` says when),
   the same state as every copy the other ranks restore; or, for a sharded state saved by
   another world size, the step resharded (:func:`._fromdisk.stage_resharded`).

Before the tiers, when the world size changed and every old rank's slot of the committed step is in the memory of
a node of the round (own slots, peers' replicas; read over another node's replica port when this rank's node lacks
it), the step is resharded from those (:meth:`Restore.reshard_from_memory`) and no file is read.

So a node that replaces a lost one restores the step its surviving peers restore from memory.
Every byte is verified before it reaches the caller's tensors (a copy on disk is checked whole,
then read; a resharded step is read and checked into memory of its own, then copied), all ranks
restore the same step (of the same round) or none does, and only committed steps are restored.
A copy that fails its checks, or that a rank cannot read (an OSError: permissions, EIO, a stale
NFS handle), is reported and the ranks try an older step together: no rank leaves the others
waiting in a collective. Once copying into the caller's tensors has begun, a failure stops every
rank with an error saying the state may be partly overwritten, never with "nothing restored".
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import structlog
import torch

from stead.core.events import RestoreBound
from stead.plugins.ckpt import _copies, _disk, _fromdisk
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._codec import TensorMeta, decode, find
from stead.plugins.ckpt._group import Group
from stead.plugins.ckpt._layout import LayoutDoc, parse_document
from stead.plugins.ckpt._mapped import MappedSlot
from stead.plugins.ckpt._memparts import MappedParts, is_sharded
from stead.plugins.ckpt._memreshard import stage_from_memory
from stead.plugins.ckpt._remoteparts import RemoteSlot, with_other_nodes
from stead.plugins.ckpt._restore import Template, as_dict, check_template, destination
from stead.plugins.ckpt._shm import Control, SlotInfo, VerifyState
from stead.plugins.ckpt.errors import CheckpointError, StateMismatch
from stead.plugins.ckpt.settings import CheckpointSettings

__all__ = ["Copy", "Resharded", "Restore"]

log = structlog.get_logger("stead.ckpt")

#: how many other ranks' copies of a step a rank compares before it takes one as a replicated state
_REPLICA_CHECKS = 3
#: what a rank without the value puts in a MIN all-reduce (above any step, round, rank or fingerprint)
_NONE = 1 << 62
#: the step bound of the first look at the disk (above any step)
_NO_BOUND = 1 << 62

Restored = tuple[int, dict[Any, Any]]


class Resharded(NamedTuple):
    """A step resharded from memory, and how many of the old ranks' slots read were this node's own slots, its
    peers' replicas it holds, and slots read from other nodes of the round."""

    restored: Restored
    own: int
    peer: int
    other_nodes: int


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy of a step this rank can restore: in its memory (a slot) or on disk (a rank's manifest)."""

    step: int
    round: int
    #: the rank that saved it
    rank: int
    #: what identical states share (:func:`._copies.fingerprint`); None when the copy's checksums are not known
    fingerprint: int | None
    memory: tuple[SlotInfo, LayoutDoc] | None = None
    manifest: _disk.Manifest | None = None
    #: a sharded state saved by another world size: read through torch.distributed.checkpoint's reshard
    reshard: bool = False

    @property
    def tier(self) -> str:
        return "memory" if self.memory is not None else "disk"

    @property
    def tree(self) -> Any:
        return self.memory[1].tree if self.memory is not None else self._manifest.tree

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.memory[1].tensors if self.memory is not None else self._manifest.tensors

    @property
    def _manifest(self) -> _disk.Manifest:
        assert self.manifest is not None
        return self.manifest


class Restore:
    """One load() of one rank: its memory slots, its job's checkpoint directory, and its peers through ``group``."""

    def __init__(self, *, rank: int, world: int, root: Path, settings: CheckpointSettings, group: Group,
                 control: Control | None, mapped: Callable[[int], MappedSlot | None],
                 report_corrupt: Callable[[int, str, str], None], bounds: tuple[RestoreBound, ...] = ()) -> None:
        self.rank, self.world, self.root, self.settings, self.group = rank, world, root, settings, group
        self.control, self.mapped, self.report_corrupt = control, mapped, report_corrupt
        #: the replica mismatches' bounds: a copy one of them excludes is never restored (every rank has the same)
        self.bounds = bounds

    def excluded(self, step: int, round_: int) -> bool:
        """Whether a restore bound keeps the copy of ``step`` saved in ``round_`` out (it may hold a corruption)."""
        bound = next((b for b in self.bounds if b.excludes(step, round_)), None)
        if bound is not None:
            log.info("ckpt_restore_bounded", step=step, round=round_, rank=self.rank, at_most=bound.step,
                     mismatch_round=bound.round, reason="replicas' fingerprints last agreed at that step")
        return bound is not None

    # -- memory ----------------------------------------------------------------------------------------

    def memory_candidate(self, hint: tuple[int, int]) -> tuple[SlotInfo, LayoutDoc] | None:
        """The slot holding the committed step the agent handed over, checked; None when unusable."""
        step, round_ = hint
        if self.control is None or step < 0 or self.excluded(step, round_):
            return None
        slot = next((s for s in self.control.slots() if s.holds(step, round_)), None)
        if slot is None:
            log.info("ckpt_not_in_memory", step=step, round=round_, rank=self.rank)
            return None
        if slot.rank != self.rank or slot.world != self.world:
            log.info("ckpt_memory_of_another_rank", step=step, saved_by=slot.rank, saved_world=slot.world,
                     rank=self.rank, world=self.world)
            return None
        found = self._document(slot)
        if found is None or not self._verified(slot, found[0], found[1]):
            return None
        return slot, found[0]

    def _document(self, slot: SlotInfo) -> tuple[LayoutDoc, MappedSlot] | None:
        mapped = self.mapped(slot.index)
        if mapped is None or mapped.capacity < slot.layout_off + slot.layout_len:
            return None
        where = f"slot {slot.index} of rank {self.rank}"
        try:
            doc = parse_document(bytes(mapped.memory(slot.layout_off, slot.layout_len)),
                                 expected_sum=slot.layout_sum, where=where)
            doc.check_fits(mapped.capacity, where=where)
        except CheckpointError as exc:
            self.report_corrupt(slot.step, "memory", str(exc))
            return None
        return doc, mapped

    def _verified(self, slot: SlotInfo, doc: LayoutDoc, mapped: MappedSlot) -> bool:
        assert self.control is not None
        deadline = time.monotonic() + self.settings.verify_wait_s
        info = slot
        while info.verify_seq == slot.seq and info.verify_state is VerifyState.RUNNING:
            if time.monotonic() > deadline:
                log.warning("ckpt_verify_late", step=slot.step, effect="verifying in the worker")
                break
            time.sleep(0.001)
            info = self.control.slot(slot.index)
        if info.seq != slot.seq:
            return False
        if info.verify_seq == slot.seq and info.verify_state is VerifyState.OK:
            return True
        if info.verify_seq == slot.seq and info.verify_state is VerifyState.CORRUPT:
            return False  # the agent reported it
        if info.checks_seq != slot.seq:
            log.warning("ckpt_restore_unverified", step=slot.step, rank=self.rank,
                        reason="the previous worker died before the agent checksummed the step")
            return True
        return self._sums_match(slot, doc, mapped)

    def _sums_match(self, slot: SlotInfo, doc: LayoutDoc, mapped: MappedSlot) -> bool:
        expected = self._stored_sums(slot, doc, mapped)
        bad = [i for i, (offset, nbytes) in enumerate(doc.regions())
               if checksum(mapped.memory(offset, nbytes)) != expected[i]]
        if bad:
            self.report_corrupt(slot.step, "memory", f"{len(bad)} tensors fail their checksums")
            return False
        return True

    @staticmethod
    def _stored_sums(slot: SlotInfo, doc: LayoutDoc, mapped: MappedSlot) -> list[int]:
        """The checksums the agent computed for the slot (check ``checks_seq`` first)."""
        view = memoryview(mapped.mm)[slot.checks_off:slot.checks_off + 8 * len(doc.tensors)].cast("Q")
        try:
            return list(view)
        finally:
            view.release()

    def _older_slot(self, step: int, hint: tuple[SlotInfo, LayoutDoc] | None) -> Copy | None:
        """A copy of ``step`` in this rank's other slot: usable once it is known committed (the agent heard of its
        commit, or some rank's agent wrote the same step and round to disk: agents write committed steps only) and
        the slot passes the checksums its agent computed."""
        if self.control is None:
            return None
        for slot in self.control.slots():
            if (not slot.complete or slot.step != step or (slot.rank, slot.world) != (self.rank, self.world)
                    or (hint is not None and slot.index == hint[0].index) or slot.checks_seq != slot.seq
                    or not self._known_committed(step, slot.round)):
                continue
            found = self._document(slot)
            if found is None or not self._sums_match(slot, *found):
                continue
            doc, mapped = found
            return Copy(step=step, round=slot.round, rank=self.rank, memory=(slot, doc),
                        fingerprint=_copies.fingerprint(doc.tree, doc.tensors, self._stored_sums(slot, doc, mapped)))
        return None

    def _committed_slot_steps(self) -> list[int]:
        """The steps this rank's slots hold, saved as this rank in this world, that are known committed."""
        if self.control is None:
            return []
        recent = self._committed_pairs()
        return [s.step for s in self.control.slots() if s.complete and (s.rank, s.world) == (self.rank, self.world)
                and (s.step, s.round) in recent]

    def _committed_pairs(self) -> set[tuple[int, int]]:
        """(step, round) of the commits this rank's agent heard of lately, and of the replicated and replicating
        steps (committed both, however old)."""
        if self.control is None:
            return set()
        return {*self.control.recently_committed(), *(p for p in self.control.kept if p[0] >= 0)}

    def _known_committed(self, step: int, round_: int) -> bool:
        return (step, round_) in self._committed_pairs() or self._committed_on_disk(step, round_)

    def _committed_on_disk(self, step: int, round_: int) -> bool:
        for rank in _disk.written_ranks(self.root, step):
            with contextlib.suppress(OSError, CheckpointError):
                if _disk.read_manifest(self.root, step, rank).round == round_:
                    return True
        return False

    def _memory_copy(self, memory: tuple[SlotInfo, LayoutDoc]) -> Copy:
        slot, doc = memory
        fingerprint = None
        mapped = self.mapped(slot.index)
        if mapped is not None and self.control is not None and self.control.slot(slot.index).checks_seq == slot.seq:
            fingerprint = _copies.fingerprint(doc.tree, doc.tensors, self._stored_sums(slot, doc, mapped))
        return Copy(step=doc.step, round=doc.round, rank=self.rank, memory=memory, fingerprint=fingerprint)

    def restore_memory(self, slot: SlotInfo, doc: LayoutDoc, template: Mapping[str, Any] | None) -> dict[Any, Any]:
        mapped = self.mapped(slot.index)
        if mapped is None:
            raise CheckpointError(f"slot {slot.index} of rank {self.rank} is no longer mapped")
        metas = [TensorMeta.from_json(t, where=f"slot {slot.index}") for t in doc.tensors]
        if any(m.device == "cuda" for m in metas):
            mapped.pin_for_cuda()  # host-to-device copies from pinned memory run at full speed
        offsets = [int(t["offset"]) for t in doc.tensors]
        cuda = []

        def leaf(index: int, path: tuple[object, ...]) -> Any:
            meta = metas[index]
            value, target = destination(meta, find(template, path) if template is not None else None, path)
            mapped.copy_out(target, offsets[index], meta.nbytes)
            if target.device.type == "cuda":
                cuda.append(target)
            return value

        with torch.no_grad():
            result = decode(doc.tree, leaf, where=f"slot {slot.index}")
        if cuda:
            torch.cuda.synchronize()
        return as_dict(result)

    def agreed_template(self, given: Template, tree: Any, tensors: Any, strict: bool,
                        step: int) -> Mapping[str, Any] | None:
        """The template to restore into, made (when given as a function) and checked on every rank before any
        byte moves: a misfit on any rank stops every rank, with nothing loaded."""
        mismatch: StateMismatch | None = None
        template: Mapping[str, Any] | None = None
        try:
            metas = [TensorMeta.from_json(t, where=f"step {step}") for t in tensors]
            skeleton = decode(tree, lambda i, _path: metas[i], where=f"step {step}")
            template = given(skeleton) if callable(given) else given
            if template is not None:
                check_template(template, tree, metas, strict=strict, where=f"step {step}")
        except StateMismatch as exc:
            mismatch = exc
        if not self.group.agree(mismatch is None):
            raise mismatch or StateMismatch(f"another rank's state does not fit step {step} of the checkpoint "
                                            "(its log says why); nothing was loaded")
        return template

    # -- the tiers -------------------------------------------------------------------------------------

    def from_tiers(self, given: Template, memory: tuple[SlotInfo, LayoutDoc] | None,
                   strict: bool) -> tuple[Restored | None, Copy | None]:
        """The newest step every rank can restore, each from its best copy (see the module docstring); the step and
        state, and the copy it came from (None, None: no step every rank can restore)."""
        bound = _NO_BOUND
        while True:
            mine = max([s for s in _disk.candidates(self.root, self.rank, any_rank=True) if s <= bound]
                       + ([memory[1].step] if memory is not None and memory[1].step <= bound else [])
                       + [s for s in self._committed_slot_steps() if s <= bound], default=-1)
            step = self.group.min([mine])[0]
            if step < 0:
                return None, None
            source = self._source(step, memory)
            if source is not None and source.reshard:
                assert source.manifest is not None  # a resharded copy is always read from a manifest
                state = self._read_resharded(source.manifest, given)
                if state is not None:
                    return (step, state), source
            elif source is not None:
                state = self._take(source, given, strict)
                if state is not None:
                    return (step, state), source
            bound = step - 1

    def _source(self, step: int, memory: tuple[SlotInfo, LayoutDoc] | None) -> Copy | None:
        """This rank's copy of ``step`` once every rank has one, all of the same kind; None on every rank if not."""
        own = self._guarded(step, lambda: self._own(step, memory))
        fingerprint = own.fingerprint if own is not None else None
        round_lo, round_hi, print_lo, print_hi, holder_lo, holder_hi = self.group.min([
            *_bounds(own.round if own is not None else None),
            *_bounds(fingerprint),
            *_bounds(self.rank if fingerprint is not None else None)])
        round_hi, print_hi, holder_hi = -round_hi, -print_hi, -holder_hi
        source: Copy | None
        if round_lo != _NONE and round_lo != round_hi:
            source = None  # copies of this step from different rounds (it was saved again after a rollback)
        elif own is not None:
            source = own
        else:
            holders = [] if print_lo == _NONE else [holder_lo, holder_hi]
            prints = [] if print_lo == _NONE else [print_lo, print_hi]
            round_ = round_lo if round_lo != _NONE else None
            source = self._guarded(step, lambda: self._replica(step, round_, prints, holders))
        if source is not None and self.excluded(source.step, source.round):
            source = None  # every rank's copy of it comes from the same round: every rank drops it (ranks agree below)
        reshard = source is not None and source.reshard
        every, all_reshard, any_reshard = self.group.min([int(source is not None), int(reshard), -int(reshard)])
        if every != 1 or all_reshard != -any_reshard:
            return None
        return source

    def _guarded(self, step: int, find: Callable[[], Copy | None]) -> Copy | None:
        """``find()``, or None when what it reads is damaged (reported): a rank never leaves the others waiting in a
        collective because one of its files is bad."""
        try:
            return find()
        except FileNotFoundError:
            return None  # gone since it was listed (retention): as if it had never been there
        except (CheckpointError, OSError) as exc:
            self._unusable(step, exc)
            return None

    def _unusable(self, step: int, exc: CheckpointError | OSError) -> None:
        """Report a copy of ``step`` this rank cannot use: damaged, or unreadable (an OSError, with its path)."""
        if isinstance(exc, OSError):
            path = exc.filename if exc.filename is not None else _disk.step_dir(self.root, step)
            detail = f"{path} cannot be read ({exc.strerror or exc!r}): check the storage and its permissions"
            log.warning("ckpt_unreadable", step=step, rank=self.rank, path=str(path), error=repr(exc))
        else:
            detail = str(exc)
        self.report_corrupt(step, "disk", detail)

    def _own(self, step: int, memory: tuple[SlotInfo, LayoutDoc] | None) -> Copy | None:
        """This rank's own copy of ``step``: in memory, else on disk saved at this world size."""
        if memory is not None and memory[1].step == step:
            return self._memory_copy(memory)
        older = self._older_slot(step, memory)
        if older is not None:
            return older
        try:
            manifest = _disk.read_manifest(self.root, step, self.rank)
        except FileNotFoundError:
            return None
        except (CheckpointError, OSError) as exc:
            self._unusable(step, exc)
            return None
        if manifest.world != self.world:
            return None
        return Copy(step=step, round=manifest.round, rank=self.rank, manifest=manifest,
                    fingerprint=_copies.manifest_fingerprint(manifest))

    def _replica(self, step: int, round_: int | None, prints: list[int], holders: list[int]) -> Copy | None:
        """Another rank's copy of ``step`` on disk, for a rank that has none of its own: for a replicated state,
        one that is the same as every other copy (``prints``: the fingerprints of the copies the ranks that have
        their own restore, ``holders``: those ranks); for a sharded one saved by another world size, to reshard.
        ``round_``: the round of the other ranks' own copies."""
        written = _disk.written_ranks(self.root, step)
        copies: list[_disk.Manifest] = []
        for rank in sorted(written, key=lambda r: r != self.rank)[:_REPLICA_CHECKS]:
            try:
                copies.append(_disk.read_manifest(self.root, step, rank))
            except FileNotFoundError:
                continue
            except (CheckpointError, OSError) as exc:
                self._unusable(step, exc)
        if round_ is not None:
            copies = [c for c in copies if c.round == round_]
        if not copies:
            return None
        first = copies[0]
        if any(TensorMeta.from_json(t, where=str(first.dir)).sharded for t in first.tensors):
            if first.world == self.world or not _disk.is_complete(self.root, step):
                log.info("ckpt_shards_missing", step=step, rank=self.rank,
                         reason="the step lacks the shards of ranks that did not write it")
                return None
            return Copy(step=step, round=first.round, rank=first.rank, manifest=first, reshard=True,
                        fingerprint=None)
        fingerprints = {*prints, *(_copies.manifest_fingerprint(c) for c in copies)}
        if len(fingerprints) != 1:
            log.info("ckpt_copies_differ", step=step, rank=self.rank, ranks=sorted({c.rank for c in copies}),
                     effect="the state is not replicated: no rank's copy is taken for another's")
            return None
        ranks = {*holders, *(c.rank for c in copies)}
        if len(ranks) >= 2 or first.world == 1:
            evidence = f"the copies of ranks {sorted(ranks)} agree" if len(ranks) >= 2 else "saved by one rank"
        elif _copies.replicated_before(self.root, step, _copies.layout(first.tree, first.tensors)):
            evidence = "an earlier step's copies agree"
        else:
            log.info("ckpt_replica_unproven", step=step, rank=self.rank, copy_of=first.rank,
                     effect="only one rank's copy is left and no earlier step shows the state replicated")
            return None
        log.info("ckpt_restore_from_another_rank", step=step, saved_world=first.world, world=self.world,
                 rank=self.rank, reading_rank=first.rank, evidence=evidence)
        return Copy(step=step, round=first.round, rank=first.rank, manifest=first,
                    fingerprint=next(iter(fingerprints)))

    def _take(self, source: Copy, given: Template, strict: bool) -> dict[Any, Any] | None:
        """Restore ``source`` into the caller's state, on every rank at once: each rank's copy verified whole first
        (None on every rank when one fails: an older step is tried), then copied."""
        with contextlib.ExitStack() as stack:
            handle = None
            verified = True
            if source.manifest is not None:
                try:
                    handle = stack.enter_context(_disk.open_data(source.manifest))
                    _disk.verify_data(source.manifest, handle)
                except FileNotFoundError:
                    verified = False  # the data went away since the manifest was read
                except (CheckpointError, OSError) as exc:
                    verified = False
                    self._unusable(source.step, exc)
            if not self.group.agree(verified):
                return None
            template = self.agreed_template(given, source.tree, source.tensors, strict, source.step)
            if source.memory is not None:
                slot, doc = source.memory
                return self._copy_in(source.step, lambda: self.restore_memory(slot, doc, template))
            manifest = source.manifest
            assert manifest is not None
            return self._copy_in(source.step, lambda: _fromdisk.read_step(manifest, template, handle))

    def _copy_in(self, step: int, copy: Callable[[], dict[Any, Any]]) -> dict[Any, Any]:
        """``copy()``: the verified ``step`` copied into the caller's state, on every rank; a failure on any rank
        stops every rank, saying the state may be partly overwritten."""
        state: dict[Any, Any] | None = None
        failure: Exception | None = None
        try:
            state = copy()
        except Exception as exc:  # whatever stopped it (a file, torch refusing a destination), every rank must hear
            failure = exc
        if not self.group.agree(failure is None) or state is None:
            cause = repr(failure) if failure is not None else "on another rank: its log says why"
            raise CheckpointError(
                f"step {step} failed while it was copied into the state passed to load(), after every "
                f"rank's copy had been verified ({cause}). The state may be partly overwritten: restart the workers "
                f"(they restore again), and check the storage under {self.root} if the files changed meanwhile or "
                "cannot be read") from failure
        return state

    def _read_resharded(self, manifest: _disk.Manifest, given: Template) -> dict[Any, Any] | None:
        """``manifest``'s step resharded into this world (:meth:`_resharded`), read from disk."""
        log.info("ckpt_resharding", step=manifest.step, saved_world=manifest.world, world=self.world,
                 rank=self.rank, tier="disk")
        return self._resharded(manifest.step, lambda: _fromdisk.stage_resharded(manifest, given, world=self.world),
                               tier="disk")

    def reshard_from_memory(self, given: Template, hint: tuple[int, int],
                            parts_of: Callable[[int, int], MappedParts | None]) -> Resharded | None:
        """The committed step ``hint`` resharded into this world from the old ranks' slots in memory, when the step,
        a sharded state, was saved by another world size and every old rank's slot of it is held by this rank's
        node (``parts_of``: its copies, mapped; None without an agent) or by another node of this round, read over
        its replica port (:mod:`._remoteparts`): the step and state, and how many of the slots read were this
        node's own slots, its peers' replicas and other nodes' slots. None on every rank otherwise, or when a part
        cannot be read or fails its checks (reported): the ranks then take the step from the other tiers (disk),
        as before.

        ``hint`` is the same on every rank (the newest commit any rank's agent heard of)."""
        step, round_ = hint
        mapped: MappedParts | None = None
        remote: list[RemoteSlot] = []
        try:
            if step >= 0 and not self.excluded(step, round_):
                try:
                    mapped = parts_of(step, round_)
                except (CheckpointError, OSError) as exc:
                    log.warning("ckpt_memory_parts_unusable", step=step, rank=self.rank, error=str(exc),
                                effect="the step is resharded from disk")
            saved = mapped.parts[0].doc.world if mapped is not None and mapped.parts else self.world
            # a state without shards (DDP) is taken from one old rank's copy by the tiers, once the copies are
            # shown to be the same (as before): only a sharded one is resharded
            sharded = mapped is not None and any(is_sharded(p) for p in mapped.parts[:1])
            here = mapped is not None and sharded and saved != self.world and len(mapped.parts) == saved
            if self.group.agree(here) and mapped is not None:
                parts = mapped.parts
            else:
                found = with_other_nodes(self.group, mapped.parts if mapped is not None else None,
                                         mapped.access if mapped is not None else None, rank=self.rank,
                                         world=self.world, step=step, round_=round_, remote=remote,
                                         report=self.report_corrupt)
                if found is None:
                    if here or (sharded and saved != self.world):
                        log.info("ckpt_reshard_not_from_memory", step=step, rank=self.rank, saved_world=saved,
                                 held=len(mapped.parts) if mapped is not None else 0,
                                 reason="some old rank's slot of the step is on no node of this round, or could "
                                        "not be read from the node holding it",
                                 effect="the step is resharded from disk")
                    return None
                parts = found
            assert mapped is not None
            log.info("ckpt_resharding", step=step, saved_world=parts[0].doc.world, world=self.world, rank=self.rank,
                     tier="memory", own=mapped.own, peer=mapped.peer, other_nodes=len(remote))
            state = self._resharded(step, lambda: stage_from_memory(parts, given, rank=self.rank, world=self.world),
                                    tier="memory")
            if remote:
                log.debug("ckpt_reshard_remote_reads", step=step, rank=self.rank,
                          bytes=sum(r.read_bytes for r in remote))
            return None if state is None else Resharded((step, state), mapped.own, mapped.peer, len(remote))
        finally:
            for slot in remote:
                slot.close()
            if mapped is not None:
                mapped.close()

    def _resharded(self, step: int, stage: Callable[[], _fromdisk.Staged], *, tier: str) -> dict[Any, Any] | None:
        """``step`` resharded into this world, on every rank at once: every chunk a rank restores read and checked
        first by ``stage`` (None on every rank when one fails or cannot be read: another tier or an older step is
        tried), then copied into the caller's state.

        A state that cannot take the step on any rank stops every rank, with nothing loaded.
        """
        staged: _fromdisk.Staged | None = None
        mismatch: StateMismatch | None = None
        try:
            staged = stage()
        except FileNotFoundError:
            pass  # a file went away since the manifest was read: the ranks try an older step together
        except StateMismatch as exc:
            mismatch = exc
        except (CheckpointError, OSError) as exc:
            if tier == "disk":
                self._unusable(step, exc)
            else:
                self.report_corrupt(step, tier, str(exc))
        if not self.group.agree(mismatch is None):
            raise mismatch or StateMismatch(f"another rank's state could not take step {step} resharded "
                                            "(its log says why); nothing was loaded")
        if not self.group.agree(staged is not None) or staged is None:
            return None
        return self._copy_in(step, staged.copy_in)


def _bounds(value: int | None) -> tuple[int, int]:
    """``value`` as a MIN all-reduce carries both its minimum and (negated) its maximum; ``_NONE`` when absent."""
    return (value, -value) if value is not None else (_NONE, _NONE)

