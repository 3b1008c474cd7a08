"""Row ids sorted by a float key, ties by a sequence number, in arrays of machine numbers:
the eviction orders of core/boundary_order.py and core/eviction.py, which hold every
boundary in CPU memory (a hundred thousand at a million entries).

Why not `sortedcontainers`: its lists hold a Python object per item and per sort key, and
a full collection of CPython's garbage collector follows every reference of every list it
tracks, on vLLM's scheduler thread. At a million entries the orders' lists were 570,000 of
the 2.9 million references a 190-300 ms collection followed (docs/benchmarks.md). Here the
items live in `array.array`s, which a collection passes as one object each. The layout is
sortedcontainers' (sorted chunks of at most 2 * LOAD items, and each chunk's last item for
the outer bisection), so a change costs O(log n) plus a memmove of one chunk.

An item is (key, seq, row); (key, seq) is unique: seq is a boundary's admission number.

`RowQueue` keeps rows in the order they were appended, for an order whose every insertion
goes at its end (every boundary by last use: a use is always the clock's latest tick), in
O(1) per change instead of a bisection.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from itertools import repeat

from hybridkv._columns import Column

LOAD = 512


class RowOrder:
    __slots__ = ("_keys", "_seqs", "_rows", "_last_key", "_last_seq", "_len")

    def __init__(self) -> None:
        self._keys: list[array] = []  # per chunk, sorted
        self._seqs: list[array] = []
        self._rows: list[array] = []
        self._last_key = array("d")  # each chunk's last item
        self._last_seq = array("q")
        self._len = 0

    def __len__(self) -> int:
        return self._len

    # ---- finding --------------------------------------------------------------------------
    def _find(self, key: float, seq: int) -> tuple[int, int]:
        """The chunk and the place in it of (key, seq), or where it would go: a bisection
        on the key, then on seq among the items tied on it (rare for ranks). Both
        bisections written out: this runs at every change of every order."""
        last_key = self._last_key
        i = bisect_left(last_key, key)
        if i < len(last_key) and last_key[i] == key and self._last_seq[i] < seq:
            i = bisect_left(self._last_seq, seq, i + 1, bisect_right(last_key, key, i))
        if i == len(last_key):
            i -= 1  # after every item: the last chunk's end
        keys = self._keys[i]
        at = bisect_left(keys, key)
        if at < len(keys) and keys[at] == key and self._seqs[i][at] < seq:
            at = bisect_left(self._seqs[i], seq, at + 1, bisect_right(keys, key, at))
        return i, at

    def position(self, key: float, seq: int) -> int:
        """How many items sort before (key, seq): the chunks' lengths summed from the
        nearer end (no running counts to keep up at every change)."""
        if not self._len:
            return 0
        i, at = self._find(key, seq)
        keys = self._keys
        if 2 * i <= len(keys):
            return sum(map(len, keys[:i])) + at
        return self._len - sum(map(len, keys[i:])) + at

    def row_at(self, position: int) -> int:
        for rows in self._rows:
            if position < len(rows):
                return rows[position]
            position -= len(rows)
        raise IndexError(position)

    def first(self) -> tuple[float, int, int]:
        return self._keys[0][0], self._seqs[0][0], self._rows[0][0]

    def last(self) -> tuple[float, int, int]:
        return self._keys[-1][-1], self._seqs[-1][-1], self._rows[-1][-1]

    # ---- changes --------------------------------------------------------------------------
    def add(self, key: float, seq: int, row: int) -> None:
        self._len += 1
        if not self._keys:
            self._keys.append(array("d", (key,)))
            self._seqs.append(array("q", (seq,)))
            self._rows.append(array("q", (row,)))
            self._last_key.append(key)
            self._last_seq.append(seq)
            return
        i, at = self._find(key, seq)
        keys = self._keys[i]
        keys.insert(at, key)
        self._seqs[i].insert(at, seq)
        self._rows[i].insert(at, row)
        if at == len(keys) - 1:
            self._last_key[i], self._last_seq[i] = key, seq
        if len(keys) > 2 * LOAD:
            self._split(i)

    def remove(self, key: float, seq: int) -> None:
        if self._len:
            i, at = self._find(key, seq)
            keys, seqs = self._keys[i], self._seqs[i]
            if at < len(keys) and keys[at] == key and seqs[at] == seq:
                self._len -= 1
                del keys[at], seqs[at], self._rows[i][at]
                if not keys:
                    self._drop(i)
                    return
                if at == len(keys):
                    self._last_key[i], self._last_seq[i] = keys[-1], seqs[-1]
                if len(keys) < LOAD // 2 and i + 1 < len(self._keys):
                    self._merge(i)
                return
        raise KeyError((key, seq))

    def _split(self, i: int) -> None:
        for chunks in (self._keys, self._seqs, self._rows):
            chunk = chunks[i]
            chunks.insert(i + 1, chunk[LOAD:])
            del chunk[LOAD:]
        self._last_key.insert(i, self._keys[i][-1])
        self._last_seq.insert(i, self._seqs[i][-1])

    def _merge(self, i: int) -> None:
        """Chunk i takes the items of chunk i + 1 (split again if that is too many)."""
        for chunks in (self._keys, self._seqs, self._rows):
            chunks[i].extend(chunks.pop(i + 1))
        del self._last_key[i], self._last_seq[i]
        if len(self._keys[i]) > 2 * LOAD:
            self._split(i)

    def _drop(self, i: int) -> None:
        del self._keys[i], self._seqs[i], self._rows[i], self._last_key[i], self._last_seq[i]

    def clear(self) -> None:
        self._keys.clear()
        self._seqs.clear()
        self._rows.clear()
        del self._last_key[:], self._last_seq[:]
        self._len = 0

    # ---- reading --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[float, int, int]]:
        """(key, seq, row) from the first; the order must not change meanwhile."""
        for keys, seqs, rows in zip(self._keys, self._seqs, self._rows, strict=True):
            yield from zip(keys, seqs, rows, strict=True)

    def rows(self) -> Iterator[int]:
        for rows in self._rows:
            yield from rows

    def rows_reversed(self) -> Iterator[tuple[float, int]]:
        """(key, row) from the last."""
        for keys, rows in zip(reversed(self._keys), reversed(self._rows), strict=True):
            yield from zip(reversed(keys), reversed(rows), strict=True)

    def rows_between(self, lo: float, hi: float) -> list[int]:
        """The rows whose key is in [lo, hi]."""
        out: list[int] = []
        if not self._len:
            return out
        i = bisect_left(self._last_key, lo)
        for keys, rows in zip(self._keys[i:], self._rows[i:], strict=True):
            if keys[0] > hi:
                break
            out.extend(rows[bisect_left(keys, lo) : bisect_right(keys, hi)])
        return out


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
