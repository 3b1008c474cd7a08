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

Each boundary (a row of core/boundary_graph.py's `Boundaries`) is filed in one of four
orders by rank (protected or not, dead or live), with two more by last use: the reused
ones newest first, whose first `protected` are the protected ones (a change moves the
boundaries at the edge of that prefix, not the rest), and the unprotected ones oldest
first (the live ones newest first are its end). Dead and live are split at `cutoff`,
which only moves at a choice (`sync`): the boundaries whose last use it crosses change
orders. So a change costs O(log n) per boundary it moves and a choice O(log n) per
boundary it looks at. The orders are `RowOrder`s (core/row_order.py): arrays, which the
garbage collector does not walk item by item.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from hybridkv.core.boundary_graph import Boundaries
from hybridkv.core.row_order import RowOrder

# Offsets of a boundary's place within an order (its `place` is the order's base plus one).
PROTECTED_LIVE, PROTECTED_DEAD, LIVE, DEAD = range(1, 5)


class BoundaryOrder:
    def __init__(self, rows: Boundaries, base: int, room: float):
        self.rows = rows
        self.base = base  # places base+1 .. base+4 are this order's
        self.room = room  # bytes the protected ones may take
        self.cutoff = -math.inf  # dead: last used before it
        self._recent = RowOrder()  # reused, newest first (keyed by -used)
        self._protected = 0  # the first this many of `_recent`
        self._protected_bytes = 0
        self._rest = RowOrder()  # unprotected, oldest first (keyed by used)
        self._ranked = {p: RowOrder() for p in range(1, 5)}  # keyed by rank

    def __len__(self) -> int:
        return sum(len(r) for r in self._ranked.values())

    def owns(self, b: int) -> bool:
        return self.base < self.rows.place[b] <= self.base + 4

    # ---- changes --------------------------------------------------------------------------
    def add(self, b: int) -> None:
        rows = self.rows
        if not rows.reused[b]:
            self._place(b, False)
            return
        key, seq = -rows.used[b], rows.seq[b]
        at = self._recent.position(key, seq)
        self._recent.add(key, seq, b)
        if at < self._protected:
            self._protected += 1
            self._protected_bytes += rows.own_bytes[b]
            self._place(b, True)
            self._shrink()
        else:
            self._place(b, False)
            self._grow()

    def remove(self, b: int) -> None:
        rows = self.rows
        if rows.reused[b]:
            key, seq = -rows.used[b], rows.seq[b]
            at = self._recent.position(key, seq)
            self._recent.remove(key, seq)
            if at < self._protected:
                self._protected -= 1
                self._protected_bytes -= rows.own_bytes[b]
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
        # Every boundary last used in [lo, hi] (uses are whole ticks): filtered below.
        crossing = [
            *self._rest.rows_between(lo, hi),
            *self._recent.rows_between(-hi, -lo),
        ]
        rows, base = self.rows, self.base
        place, used, rank, seq = rows.place, rows.used, rows.rank, rows.seq
        for b in crossing:
            off = place[b] - base
            if lo <= used[b] < hi and off in moves:  # (an unprotected one is met twice)
                self._ranked[off].remove(rank[b], seq[b])
                place[b] = base + moves[off]
                self._ranked[moves[off]].add(rank[b], seq[b], b)

    def _place(self, b: int, protected: bool) -> None:
        rows = self.rows
        dead = rows.used[b] < self.cutoff
        if protected:
            off = PROTECTED_DEAD if dead else PROTECTED_LIVE
        else:
            off = DEAD if dead else LIVE
            self._rest.add(rows.used[b], rows.seq[b], b)
        rows.place[b] = self.base + off
        self._ranked[off].add(rows.rank[b], rows.seq[b], b)

    def _unplace(self, b: int) -> None:
        rows = self.rows
        off = rows.place[b] - self.base
        self._ranked[off].remove(rows.rank[b], rows.seq[b])
        if off in (LIVE, DEAD):
            self._rest.remove(rows.used[b], rows.seq[b])
        rows.place[b] = 0

    def _shrink(self) -> None:
        while self._protected_bytes > self.room:
            self._protected -= 1
            b = self._recent.row_at(self._protected)
            self._protected_bytes -= self.rows.own_bytes[b]
            self._unplace(b)
            self._place(b, False)

    def _grow(self) -> None:
        while self._protected < len(self._recent):
            b = self._recent.row_at(self._protected)
            if self._protected_bytes + self.rows.own_bytes[b] > self.room:
                return
            self._unplace(b)
            self._protected += 1
            self._protected_bytes += self.rows.own_bytes[b]
            self._place(b, True)

    # ---- the order ------------------------------------------------------------------------
    def order(self, looping: bool) -> Iterator[int]:
        """From the first to evict to the last (the module docstring)."""
        r = self._ranked
        if not looping:
            for _, _, b in heapq.merge(r[DEAD], r[LIVE]):
                yield b
            for _, _, b in heapq.merge(r[PROTECTED_DEAD], r[PROTECTED_LIVE]):
                yield b
            return
        for _, _, b in heapq.merge(r[DEAD], r[PROTECTED_DEAD]):
            yield b
        yield from self._live_newest_first()
        yield from r[PROTECTED_LIVE].rows()

    def _live_newest_first(self) -> Iterator[int]:
        """The unprotected live ones, most recently used first (the first admitted first
        among those used at once)."""
        ties: list[int] = []
        last = None
        for used, b in self._rest.rows_reversed():
            if used < self.cutoff:
                break
            if ties and used != last:
                yield from reversed(ties)
                ties = []
            ties.append(b)
            last = used
        yield from reversed(ties)

    def clear(self) -> None:
        self._recent.clear()
        self._rest.clear()
        for r in self._ranked.values():
            r.clear()
        self._protected = self._protected_bytes = 0
        self.cutoff = -math.inf
