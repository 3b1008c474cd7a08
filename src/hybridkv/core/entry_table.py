"""One table for what the scheduler side's index knows per entry key: its bytes in CPU
memory (the byte ledger's, core/ledger.py) and how many live boundary segments need it
(the boundary graph's, core/boundary_graph.py).

Why one table: the two were separate maps over the same keys, and at a production tier's
million entries a second slot per attention entry was a sixth of all the memory the
index held (issue 27: "resident memory per entry, goal 200 bytes"). Here each key has
one 32-byte slot of a native `KeyTable` (core/keytable.py: the key kept in the slot, no
Python object per key), whose value packs both counts:

    value = needers << SHIFT | size class

The size class indexes the distinct entry sizes seen (a layout has one per group, so a
handful); sizes beyond the first 14 distinct ones share class ODD and are kept per key
in a side dict. The table holds exactly the keys in CPU memory, so "is it there", asked
hundreds of times per lookup, is one membership test; the few keys needed but not in CPU
memory (a needed chunk lost or deleted) keep their count in another side dict, `away`.

`sizes` and `needers` are the two views, each a read-only mapping of the keys where its
count is not 0, so the ledger and the graph read them as they read their own maps; the
graph's writes (`need`, `unneed`) answer the question it asks next, whether the key is
in CPU memory with no segment needing it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from hybridkv.core.keytable import KeyTable

SHIFT = 4
MASK = (1 << SHIFT) - 1
ONE = 1 << SHIFT  # one needer
ODD = MASK  # the class of sizes past the first MASK - 1 distinct ones


class EntryTable:
    __slots__ = ("slots", "away", "odd", "classes", "_class_of", "sizes", "needers")

    def __init__(self) -> None:
        self.slots = KeyTable()  # key -> needers << SHIFT | size class
        self.away: dict[bytes, int] = {}  # needed, not in CPU memory: key -> needers
        self.odd: dict[bytes, int] = {}  # key -> bytes, of class ODD
        self.classes: list[int] = [0]  # size class -> bytes (class 0 unused)
        self._class_of: dict[int, int] = {}
        self.sizes = Sizes(self)
        self.needers = Needers(self)

    # ---- the ledger's side ----------------------------------------------------------------
    def insert(self, key: bytes, nbytes: int) -> bool:
        """Count `key` in CPU memory with `nbytes`; False (nothing changed) if it was."""
        slots = self.slots
        if key in slots:
            return False
        cls = self._class_of.get(nbytes) or self._new_class(nbytes)
        if cls == ODD:
            self.odd[key] = nbytes
        slots[key] = self.away.pop(key, 0) << SHIFT | cls
        return True

    def remove(self, keys: Sequence[bytes]) -> list[int | None]:
        """Take `keys` out of CPU memory (an eviction's, in one pass over the table);
        the bytes of each, None for one that was not there."""
        away, odd, classes = self.away, self.odd, self.classes
        out: list[int | None] = []
        for key, value in zip(keys, self.slots.pop_many(keys, None), strict=True):
            if value is None:
                out.append(None)
                continue
            if value >= ONE:
                away[key] = value >> SHIFT
            cls = value & MASK
            out.append(odd.pop(key) if cls == ODD else classes[cls])
        return out

    def size(self, key: bytes, value: int) -> int:
        cls = value & MASK
        return self.odd[key] if cls == ODD else self.classes[cls]

    def clear_sizes(self) -> None:
        """Take every key out of CPU memory (what is needed stays needed)."""
        items = self.slots.items()
        self.away.update((key, value >> SHIFT) for key, value in items if value >= ONE)
        self.slots.clear()
        self.odd.clear()

    def _new_class(self, nbytes: int) -> int:
        if len(self.classes) == ODD:
            return ODD
        self.classes.append(nbytes)
        self._class_of[nbytes] = len(self.classes) - 1
        return len(self.classes) - 1

    # ---- the graph's side -----------------------------------------------------------------
    def need(self, key: bytes) -> bool:
        """One more live segment needs `key`; whether it is in CPU memory and none did."""
        slots = self.slots
        value = slots.get(key)
        if value is not None:
            slots[key] = value + ONE
            return value < ONE
        self.away[key] = self.away.get(key, 0) + 1
        return False

    def unneed(self, key: bytes) -> bool:
        """One live segment fewer needs `key` (one did); whether it is in CPU memory and
        none does now."""
        slots = self.slots
        value = slots.get(key)
        if value is not None:
            slots[key] = value = value - ONE
            return value < ONE
        n = self.away[key] - 1
        if n:
            self.away[key] = n
        else:
            del self.away[key]
        return False

    def unneeded(self, key: bytes) -> bool:
        """In CPU memory, and no live segment needs it."""
        value = self.slots.get(key)
        return value is not None and value < ONE

    def clear_needers(self) -> None:
        """No segment needs anything any more (what is in CPU memory stays)."""
        slots = self.slots
        for key, value in slots.items():
            if value >= ONE:
                slots[key] = value & MASK
        self.away.clear()


class _View(Mapping[bytes, int]):
    """One of the table's two read-only views."""

    __slots__ = ("_t", "_slots")

    def __init__(self, table: EntryTable):
        self._t = table
        self._slots = table.slots


class Sizes(_View):
    """Bytes of each entry in CPU memory (over all ranks)."""

    __slots__ = ()

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __getitem__(self, key: bytes) -> int:
        return self._t.size(key, self._slots[key])

    def get(self, key: bytes, default=None):
        value = self._slots.get(key)
        return default if value is None else self._t.size(key, value)

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._slots)

    def missing(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys not in CPU memory, in their order: one call for a lookup's hundreds."""
        return self._slots.missing(keys)

    def present(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys in CPU memory, in their order (`missing`'s complement)."""
        return self._slots.present(keys)

    def total(self, keys: Iterable[bytes]) -> int:
        """The bytes of `keys`, all in CPU memory: one call for a hit's hundreds."""
        keys = list(keys)
        values = self._slots.get_many(keys, None)
        if None in values:
            raise KeyError(keys[values.index(None)])
        classes, odd = self._t.classes, self._t.odd
        return sum(
            odd[key] if value & MASK == ODD else classes[value & MASK]
            for key, value in zip(keys, values, strict=True)
        )


class Needers(_View):
    """How many live boundary segments need each entry (keys needed by none: absent)."""

    __slots__ = ()

    def __contains__(self, key: object) -> bool:
        return self.get(key) > 0  # type: ignore[arg-type]

    def __getitem__(self, key: bytes) -> int:
        n = self.get(key)
        if not n:
            raise KeyError(key)
        return n

    def get(self, key: bytes, default=0):
        value = self._slots.get(key)
        n = self._t.away.get(key, 0) if value is None else value >> SHIFT
        return n or default

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self) -> Iterator[bytes]:
        yield from [key for key, value in self._slots.items() if value >= ONE]
        yield from list(self._t.away)
