"""Sets of sample slots as sorted, disjoint half-open ranges.

The ledger's whole state is made of these: what remains to be leased, what a round
started from, what a checkpoint's cursor says is left. A set is keyed by *part*
(an epoch of a dataset, a partition of a streaming source) in :class:`SlotMap`.
Sets stay small in practice (a few ranges per part: a frontier plus the holes left
by leases in flight), so plain sorted lists are fast enough.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

__all__ = ["Range", "SlotMap", "SlotSet"]

#: (part, start, end): slots [start, end) of one part
Range = tuple[int, int, int]


class SlotSet:
    """A mutable set of integers stored as sorted, disjoint, non-adjacent ``[start, end)`` ranges."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in sorted(ranges):
            self._append_sorted(start, end)

    def _append_sorted(self, start: int, end: int) -> None:
        if end <= start:
            return
        if self._ends and start <= self._ends[-1]:
            self._ends[-1] = max(self._ends[-1], end)
        else:
            self._starts.append(start)
            self._ends.append(end)

    def ranges(self) -> Iterator[tuple[int, int]]:
        return zip(self._starts, self._ends, strict=True)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __len__(self) -> int:
        """How many ranges (not slots): see :attr:`total`."""
        return len(self._starts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotSet) and self._starts == other._starts and self._ends == other._ends

    def __repr__(self) -> str:
        return f"SlotSet({list(self.ranges())})"

    @property
    def total(self) -> int:
        return sum(e - s for s, e in self.ranges())

    def first(self) -> int | None:
        return self._starts[0] if self._starts else None

    def copy(self) -> SlotSet:
        new = SlotSet()
        new._starts, new._ends = list(self._starts), list(self._ends)
        return new

    def add(self, start: int, end: int) -> None:
        """Union with ``[start, end)``."""
        if end <= start:
            return
        lo = bisect.bisect_left(self._ends, start)  # first range that ends at or after start
        hi = bisect.bisect_right(self._starts, end)  # ranges starting after end are untouched
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def update(self, other: SlotSet) -> None:
        for start, end in other.ranges():
            self.add(start, end)

    def remove(self, start: int, end: int) -> None:
        """Difference with ``[start, end)``, in place."""
        if end <= start:
            return
        lo = bisect.bisect_right(self._ends, start)  # first range ending after start
        hi = bisect.bisect_left(self._starts, end)  # ranges from hi on start at or after end
        if lo >= hi:
            return
        keep_starts: list[int] = []
        keep_ends: list[int] = []
        if self._starts[lo] < start:
            keep_starts.append(self._starts[lo])
            keep_ends.append(start)
        if self._ends[hi - 1] > end:
            keep_starts.append(end)
            keep_ends.append(self._ends[hi - 1])
        self._starts[lo:hi] = keep_starts
        self._ends[lo:hi] = keep_ends

    def difference(self, other: SlotSet) -> SlotSet:
        """A new set: these slots without ``other``'s."""
        out = SlotSet()
        theirs = list(other.ranges())
        j = 0
        for start, end in self.ranges():
            cur = start
            while j < len(theirs) and theirs[j][1] <= cur:
                j += 1
            k = j
            while k < len(theirs) and theirs[k][0] < end:
                o_start, o_end = theirs[k]
                if o_start > cur:
                    out._append_sorted(cur, o_start)
                cur = max(cur, o_end)
                if o_end >= end:
                    break
                k += 1
            if cur < end:
                out._append_sorted(cur, end)
        return out

    def intersection(self, other: SlotSet) -> SlotSet:
        """A new set: the slots in both."""
        return self.difference(self.difference(other))

    def intersects(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._ends, start)
        return i < len(self._starts) and self._starts[i] < end

    def issubset(self, other: SlotSet) -> bool:
        return not self.difference(other)

    def take(self, *, align: int, limit: int | None = None) -> tuple[int, int] | None:
        """Remove and return the lowest piece: up to the next multiple of ``align`` and below ``limit``."""
        if not self._starts:
            return None
        start, end = self._starts[0], self._ends[0]
        stop = min(end, (start // align + 1) * align)
        if limit is not None:
            stop = min(stop, limit)
        if stop <= start:
            return None
        if stop == end:
            del self._starts[0], self._ends[0]
        else:
            self._starts[0] = stop
        return start, stop


class SlotMap:
    """One :class:`SlotSet` per part (epoch or partition); empty sets are dropped."""

    __slots__ = ("_parts",)

    def __init__(self, ranges: Iterable[Range] = ()) -> None:
        self._parts: dict[int, SlotSet] = {}
        for part, start, end in ranges:
            self.add(part, start, end)

    def add(self, part: int, start: int, end: int) -> None:
        if end > start:
            self._parts.setdefault(part, SlotSet()).add(start, end)

    def update(self, other: SlotMap) -> None:
        for part, start, end in other.ranges():
            self.add(part, start, end)

    def remove(self, part: int, start: int, end: int) -> None:
        slots = self._parts.get(part)
        if slots is not None:
            slots.remove(start, end)

    def part(self, part: int) -> SlotSet:
        """The set of ``part`` (a live view: taking from it changes this map)."""
        return self._parts.setdefault(part, SlotSet())

    def has(self, part: int) -> bool:
        return bool(self._parts.get(part))

    def parts(self) -> list[int]:
        return sorted(p for p, s in self._parts.items() if s)

    def ranges(self) -> Iterator[Range]:
        for part in self.parts():
            for start, end in self._parts[part].ranges():
                yield part, start, end

    def difference(self, other: SlotMap) -> SlotMap:
        out = SlotMap()
        for part in self.parts():
            theirs = other._parts.get(part)
            out._parts[part] = self._parts[part].difference(theirs) if theirs else self._parts[part].copy()
        return out

    def issubset(self, other: SlotMap) -> bool:
        return not self.difference(other)

    def copy(self) -> SlotMap:
        out = SlotMap()
        out._parts = {p: s.copy() for p, s in self._parts.items() if s}
        return out

    @property
    def total(self) -> int:
        return sum(s.total for s in self._parts.values())

    def __bool__(self) -> bool:
        return any(self._parts.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotMap) and list(self.ranges()) == list(other.ranges())

    def __repr__(self) -> str:
        return f"SlotMap({list(self.ranges())})"

    def to_json(self) -> list[list[int]]:
        return [[p, s, e] for p, s, e in self.ranges()]
