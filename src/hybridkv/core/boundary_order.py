"""Leaf boundaries, or branch points, in the order `BoundaryPolicy` evicts them
(core/eviction.py), kept as they change instead of sorted at each choice.

The order (the policy's steps 3 and 4):
- *protected*: the reused boundaries, most recently used first, as many as fit in `room`
  bytes (the first that does not fit ends them), and of those only the live ones;
- while the workload does not loop: every other boundary by rank, then the protected
  ones by rank;
- while it loops: the *dead* ones (last used before `cutoff`), protected or not, by rank;
  then the live unprotected ones, most recently used first; then the protected ones by
  rank.
Ties go to the boundary admitted first, as a stable sort of them in admission order would.

Each boundary is filed in one of four lists by rank (protected or not, dead or live),
with two more by last use: the reused ones newest first, whose first `protected` are the
protected ones (a change moves the boundaries at the edge of that prefix, not the rest),
and the unprotected ones oldest first (the live ones newest first are its end). Dead
and live are split at `cutoff`, which only moves at a choice (`sync`): the boundaries
whose last use it crosses change lists. So a change costs O(log n) per boundary it moves
and a choice O(log n) per boundary it looks at.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from operator import attrgetter

from sortedcontainers import SortedKeyList

from hybridkv.core.boundary_graph import Boundary, by_recent, by_used

_RANK = attrgetter("by_rank")
# Offsets of a boundary's place within an order (its `place` is the order's base plus one).
PROTECTED_LIVE, PROTECTED_DEAD, LIVE, DEAD = range(1, 5)


class BoundaryOrder:
    def __init__(self, base: int, room: float):
        self.base = base  # places base+1 .. base+4 are this order's
        self.room = room  # bytes the protected ones may take
        self.cutoff = -math.inf  # dead: last used before it
        self._recent = SortedKeyList(key=attrgetter("by_recent"))  # reused, newest first
        self._protected = 0  # the first this many of `_recent`
        self._protected_bytes = 0
        self._rest = SortedKeyList(key=attrgetter("by_used"))  # unprotected, oldest first
        self._ranked = {p: SortedKeyList(key=_RANK) for p in range(1, 5)}

    def __len__(self) -> int:
        return sum(len(r) for r in self._ranked.values())

    def owns(self, b: Boundary) -> bool:
        return self.base < b.place <= self.base + 4

    # ---- changes --------------------------------------------------------------------------
    def add(self, b: Boundary) -> None:
        if not b.reused:
            self._place(b, False)
            return
        at = self._recent.bisect_key_left(b.by_recent)
        self._recent.add(b)
        if at < self._protected:
            self._protected += 1
            self._protected_bytes += b.own_bytes
            self._place(b, True)
            self._shrink()
        else:
            self._place(b, False)
            self._grow()

    def remove(self, b: Boundary) -> None:
        if b.reused:
            at = self._recent.index(b)
            del self._recent[at]
            if at < self._protected:
                self._protected -= 1
                self._protected_bytes -= b.own_bytes
            self._unplace(b)
            if at <= self._protected:
                self._grow()
        else:
            self._unplace(b)

    def resize(self, room: float) -> None:
        self.room = room
        self._shrink()
        self._grow()

    def sync(self, cutoff: float) -> None:
        """Move the boundaries whose last use `cutoff` crossed since the last call."""
        old, self.cutoff = self.cutoff, cutoff
        if cutoff == old:
            return
        died = cutoff > old
        lo, hi = (old, cutoff) if died else (cutoff, old)
        moves = {LIVE: DEAD, PROTECTED_LIVE: PROTECTED_DEAD}
        if not died:
            moves = {v: k for k, v in moves.items()}
        # Every boundary last used in [lo, hi) and, in `_recent`, a few at hi: filtered
        # below. Uses are whole ticks.
        first = None if lo == -math.inf else math.ceil(lo)
        top = math.ceil(hi)
        crossing = [
            *self._rest.irange_key(None if first is None else by_used(first, 0), by_used(top, 0)),
            *self._recent.irange_key(
                by_recent(top, 0), None if first is None else by_recent(first - 1, 0)
            ),
        ]
        for b in crossing:
            off = b.place - self.base
            if lo <= b.used < hi and off in moves:  # (an unprotected one is met twice)
                self._ranked[off].remove(b)
                b.place = self.base + moves[off]
                self._ranked[moves[off]].add(b)

    def _place(self, b: Boundary, protected: bool) -> None:
        dead = b.used < self.cutoff
        if protected:
            off = PROTECTED_DEAD if dead else PROTECTED_LIVE
        else:
            off = DEAD if dead else LIVE
            self._rest.add(b)
        b.place = self.base + off
        self._ranked[off].add(b)

    def _unplace(self, b: Boundary) -> None:
        off = b.place - self.base
        self._ranked[off].remove(b)
        if off in (LIVE, DEAD):
            self._rest.remove(b)
        b.place = 0

    def _shrink(self) -> None:
        while self._protected_bytes > self.room:
            self._protected -= 1
            b = self._recent[self._protected]
            self._protected_bytes -= b.own_bytes
            self._unplace(b)
            self._place(b, False)

    def _grow(self) -> None:
        while self._protected < len(self._recent):
            b = self._recent[self._protected]
            if self._protected_bytes + b.own_bytes > self.room:
                return
            self._unplace(b)
            self._protected += 1
            self._protected_bytes += b.own_bytes
            self._place(b, True)

    # ---- the order ------------------------------------------------------------------------
    def order(self, looping: bool) -> Iterator[Boundary]:
        """From the first to evict to the last (the module docstring)."""
        r = self._ranked
        if not looping:
            yield from heapq.merge(r[DEAD], r[LIVE], key=_RANK)
            yield from heapq.merge(r[PROTECTED_DEAD], r[PROTECTED_LIVE], key=_RANK)
            return
        yield from heapq.merge(r[DEAD], r[PROTECTED_DEAD], key=_RANK)
        yield from self._live_newest_first()
        yield from r[PROTECTED_LIVE]

    def _live_newest_first(self) -> Iterator[Boundary]:
        """The unprotected live ones, most recently used first (the first admitted first
        among those used at once)."""
        ties: list[Boundary] = []
        for b in reversed(self._rest):
            if b.used < self.cutoff:
                break
            if ties and b.used != ties[-1].used:
                yield from reversed(ties)
                ties = []
            ties.append(b)
        yield from reversed(ties)

    def clear(self) -> None:
        self._recent.clear()
        self._rest.clear()
        for r in self._ranked.values():
            r.clear()
        self._protected = self._protected_bytes = 0
        self.cutoff = -math.inf
