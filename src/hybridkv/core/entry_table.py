"""One table for what the scheduler side's index knows per entry key: its bytes in CPU
memory (the byte ledger's, core/ledger.py) and how many live boundary segments need it
(the boundary graph's, core/boundary_graph.py).

Why one table: the two were separate maps over the same keys, and a dict slot costs
about 40 bytes per key (hash, key and value pointers, the index, the free share of the
table), on top of the key itself. At a production tier's million entries that second
slot per attention entry was a fifth of all the memory the index held (issue 27: "resident
memory per entry, goal 200 bytes"). Here each key has one slot, split 64 ways as in
core/keymap.py, whose value packs both counts into one small int:

    value = needers << shift | size class

The size class indexes the distinct entry sizes seen (a layout has one per group, so a
handful), so the value stays below 257 for a key needed by up to 15 segments, and
CPython's cached small ints mean no int object per entry. A layout with more distinct
sizes than the class bits hold widens them once, re-encoding every value. The table
holds exactly the keys in CPU memory, so "is it there", asked hundreds of times per
lookup, is a plain dict membership test; the few keys needed but not in CPU memory (a
needed chunk lost or deleted) keep their count in a small side dict, `away`.

`sizes` and `needers` are the two views, each a read-only mapping of the keys where its
count is not 0, so the ledger and the graph read them as they read their own maps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from hybridkv.core.keymap import PARTS


class EntryTable:
    __slots__ = ("parts", "away", "shift", "mask", "classes", "_class_of", "sizes", "needers")

    def __init__(self) -> None:
        self.parts: list[dict[bytes, int]] = [{} for _ in range(PARTS)]
        self.away: dict[bytes, int] = {}  # needed, not in CPU memory: key -> needers
        self.shift = 4
        self.mask = (1 << self.shift) - 1
        self.classes: list[int] = [0]  # size class -> bytes (class 0 unused)
        self._class_of: dict[int, int] = {}
        self.sizes = Sizes(self)
        self.needers = Needers(self)

    # ---- the ledger's side ----------------------------------------------------------------
    def insert(self, key: bytes, nbytes: int) -> bool:
        """Count `key` in CPU memory with `nbytes`; False (nothing changed) if it was."""
        part = self.parts[key[0] & PARTS - 1]
        if key in part:
            return False
        cls = self._class_of.get(nbytes) or self._new_class(nbytes)
        part[key] = self.away.pop(key, 0) << self.shift | cls
        return True

    def remove(self, key: bytes) -> int | None:
        """Take `key` out of CPU memory; its bytes, or None if it was not there."""
        value = self.parts[key[0] & PARTS - 1].pop(key, None)
        if value is None:
            return None
        if value >> self.shift:
            self.away[key] = value >> self.shift
        return self.classes[value & self.mask]

    def clear_sizes(self) -> None:
        """Take every key out of CPU memory (what is needed stays needed)."""
        shift = self.shift
        for part in self.parts:
            self.away.update((key, value >> shift) for key, value in part.items() if value >> shift)
            part.clear()

    def _new_class(self, nbytes: int) -> int:
        if len(self.classes) > self.mask:
            self._widen()
        self.classes.append(nbytes)
        self._class_of[nbytes] = len(self.classes) - 1
        return len(self.classes) - 1

    def _widen(self) -> None:
        """One more bit for size classes: every value re-encoded (once per doubling of
        the distinct sizes, which a layout has a handful of)."""
        old_shift, old_mask = self.shift, self.mask
        self.shift += 1
        self.mask = (1 << self.shift) - 1
        for part in self.parts:
            for key, value in part.items():
                part[key] = (value >> old_shift) << self.shift | value & old_mask

    # ---- the graph's side -----------------------------------------------------------------
    def need(self, key: bytes) -> int:
        """One more live segment needs `key`; how many did before."""
        part = self.parts[key[0] & PARTS - 1]
        value = part.get(key)
        if value is not None:
            part[key] = value + (1 << self.shift)
            return value >> self.shift
        n = self.away.get(key, 0)
        self.away[key] = n + 1
        return n

    def unneed(self, key: bytes) -> int:
        """One live segment fewer needs `key` (one did); how many still do."""
        part = self.parts[key[0] & PARTS - 1]
        value = part.get(key)
        if value is not None:
            part[key] = value = value - (1 << self.shift)
            return value >> self.shift
        n = self.away[key] - 1
        if n:
            self.away[key] = n
        else:
            del self.away[key]
        return n

    def clear_needers(self) -> None:
        """No segment needs anything any more (what is in CPU memory stays)."""
        mask = self.mask
        for part in self.parts:
            for key, value in part.items():
                part[key] = value & mask
        self.away.clear()


class Sizes(Mapping[bytes, int]):
    """Bytes of each entry in CPU memory (over all ranks)."""

    __slots__ = ("_t", "_parts")

    def __init__(self, table: EntryTable):
        self._t = table
        self._parts = table.parts

    def __contains__(self, key: object) -> bool:
        return key in self._parts[key[0] & PARTS - 1]  # type: ignore[index]

    def __getitem__(self, key: bytes) -> int:
        t = self._t
        return t.classes[self._parts[key[0] & PARTS - 1][key] & t.mask]

    def get(self, key: bytes, default=None):
        value = self._parts[key[0] & PARTS - 1].get(key)
        return default if value is None else self._t.classes[value & self._t.mask]

    def __len__(self) -> int:
        return sum(map(len, self._parts))

    def __iter__(self) -> Iterator[bytes]:
        for part in self._parts:
            yield from part

    def missing(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys not in CPU memory, in their order: one call for a lookup's hundreds."""
        parts = self._parts
        return [key for key in keys if key not in parts[key[0] & PARTS - 1]]


class Needers(Mapping[bytes, int]):
    """How many live boundary segments need each entry (keys needed by none: absent)."""

    __slots__ = ("_t", "_parts")

    def __init__(self, table: EntryTable):
        self._t = table
        self._parts = table.parts

    def __contains__(self, key: object) -> bool:
        return self.get(key) > 0  # type: ignore[arg-type]

    def __getitem__(self, key: bytes) -> int:
        n = self.get(key)
        if not n:
            raise KeyError(key)
        return n

    def get(self, key: bytes, default=0):
        value = self._parts[key[0] & PARTS - 1].get(key)
        n = self._t.away.get(key, 0) if value is None else value >> self._t.shift
        return n or default

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self) -> Iterator[bytes]:
        shift = self._t.shift
        for part in self._parts:
            yield from [key for key, value in part.items() if value >> shift]
        yield from list(self._t.away)
