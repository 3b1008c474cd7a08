"""The eviction orders of core/boundary_order.py and core/eviction.py, which hold every
boundary in CPU memory (a hundred thousand at a million entries), in machine numbers.

Why not `sortedcontainers`: its lists hold a Python object per item and per sort key, and
a full collection of CPython's garbage collector follows every reference of every list it
tracks, on vLLM's scheduler thread. At a million entries the orders' lists were 570,000 of
the 2.9 million references a 190-300 ms collection followed (docs/benchmarks.md).

`RowOrder` (native, src/hybridkv/_roworder.c): row ids sorted by a float key, ties by a
sequence number (a boundary's admission number), in sorted chunks of C structs, with
sortedcontainers' layout, so a change costs two bisections and a memmove of one chunk.
It was this layout in Python over `array.array`s first; the interpreted bookkeeping of a
change cost a few microseconds, 11 % of a step that stores or evicts a long prompt.

`RowQueue` keeps rows in the order they were appended, for an order whose every insertion
goes at its end (every boundary by last use: a use is always the clock's latest tick), in
O(1) per change instead of a bisection.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import repeat

from hybridkv._columns import Column
from hybridkv._roworder import RowOrder

__all__ = ["RowOrder", "RowQueue"]


class RowQueue:
    """Rows in the order they were appended, as a doubly linked list through columns
    indexed by row (slot 0 is the list's sentinel, row r is slot r + 1), native `Column`s
    that grow a page at a time, as the boundaries' own columns (core/boundary_graph.py).
    The caller keeps track of which rows are in it."""

    __slots__ = ("_next", "_prev", "_len")

    def __init__(self) -> None:
        self._next = Column("q")
        self._prev = Column("q")
        self.clear()

    def __len__(self) -> int:
        return self._len

    def append(self, row: int) -> None:
        slot, nxt, prv = row + 1, self._next, self._prev
        if slot >= len(nxt):
            grow = slot + 1 - len(nxt)
            nxt.extend(repeat(0, grow))
            prv.extend(repeat(0, grow))
        last = prv[0]
        nxt[last], prv[slot], nxt[slot], prv[0] = slot, last, 0, slot
        self._len += 1

    def remove(self, row: int) -> None:
        slot, nxt, prv = row + 1, self._next, self._prev
        after, before = nxt[slot], prv[slot]
        nxt[before], prv[after] = after, before
        self._len -= 1

    def first(self) -> int:
        """The row appended earliest of those still in, or -1 if none is."""
        return self._next[0] - 1

    def rows(self) -> Iterator[int]:
        slot, nxt = self._next[0], self._next
        while slot:
            yield slot - 1
            slot = nxt[slot]

    def clear(self) -> None:
        for column in (self._next, self._prev):
            column.clear()
            column.append(0)
        self._len = 0
