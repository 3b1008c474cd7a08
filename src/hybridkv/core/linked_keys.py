"""Keys in an order of their own (least recently used first), with no Python object per
key: the base of the eviction orders' `RecencyQueue` (core/recency.py) and of the tiers'
maps of what they hold (`LruMap`: the disk tier's index, what the Redis tier stored).

Why not an `OrderedDict`: it keeps a key object, a link node and an int per entry, about
190 bytes each once the table's slack is counted, and the garbage collector walks every
key of it in each full collection. A disk tier of a million files held 190 MB that way in
every worker, walked on the model runner's thread; here an entry is a slot of a native
`KeyTable` (core/keytable.py) and a row of native `Column`s (src/hybridkv/_columns.c),
neither of which the collector looks into (`bench/disk_index.py`, docs/benchmarks.md).

The order is a doubly linked list through the columns `_next` and `_prev` of slot
numbers; slot `END` is its sentinel (its next is the oldest key, its previous the newest),
and slots freed by removals are handed out again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from hybridkv._columns import Column
from hybridkv.core.keytable import KeyTable

END = 0  # the list's sentinel slot: its next is the oldest key, its previous the newest
_MISSING = object()


class LinkedKeys:
    def __init__(self) -> None:
        self._slots = KeyTable()  # key -> its slot in the list
        self._keys = Column("k")  # slot -> its key
        self._next = Column("q")
        self._prev = Column("q")
        self._free = Column("q")  # slots to hand out again
        self._new_slot()  # END

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def _unlink(self, slot: int) -> None:
        nxt, prv = self._next[slot], self._prev[slot]
        self._next[prv], self._prev[nxt] = nxt, prv

    def _append(self, slot: int) -> None:
        last = self._prev[END]
        self._next[last], self._prev[slot] = slot, last
        self._next[slot], self._prev[END] = END, slot

    def _new_slot(self) -> None:
        self._next.append(END)
        self._prev.append(END)
        self._keys.append(b"")

    def _link_new(self, key: bytes) -> int:
        """A slot for `key` (not here), linked in as the newest."""
        slot = self._free[-1] if self._free else len(self._next)
        self._slots[key] = slot  # first: a key the KeyTable refuses (over 23 bytes) changes nothing
        if self._free:
            self._free.pop()
        else:
            self._new_slot()
        self._keys[slot] = key
        self._append(slot)
        return slot

    def _to_end(self, slot: int) -> None:
        self._unlink(slot)
        self._append(slot)

    def _remove(self, slot: int) -> None:
        self._unlink(slot)
        self._free.append(slot)

    def _slots_in_order(self) -> Iterator[int]:
        """The slots, oldest first; the caller may unlink the slot it was given."""
        nxt = self._next
        slot = nxt[END]
        while slot != END:
            after = nxt[slot]
            yield slot
            slot = after

    def clear(self) -> None:
        self._slots.clear()
        for column in (self._keys, self._next, self._prev, self._free):
            column.clear()
        self._new_slot()


class LruMap(LinkedKeys):
    """Keys with an integer each (a file's or a value's bytes), least recently used
    first: the part of `OrderedDict`'s interface the tiers use. Setting a key already
    here changes its value, not its place; `move_to_end` and `popitem(last=False)` move
    and take from the order. Iteration is oldest first and must not run while the map
    changes."""

    def __init__(self, items: Iterable[tuple[bytes, int]] = ()) -> None:
        self._values = Column("q")  # slot -> value (first: the sentinel's slot takes a row)
        super().__init__()
        for key, value in items:
            self[key] = value

    def _new_slot(self) -> None:
        super()._new_slot()
        self._values.append(0)

    def __getitem__(self, key: bytes) -> int:
        return self._values[self._slots[key]]

    def get(self, key: bytes, default: int | None = None) -> int | None:
        slot = self._slots.get(key)
        return default if slot is None else self._values[slot]

    def __setitem__(self, key: bytes, value: int) -> None:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._link_new(key)
        self._values[slot] = value

    def __delitem__(self, key: bytes) -> None:
        self._remove(self._slots.pop(key))

    def pop(self, key: bytes, default: object = _MISSING) -> object:
        slot = self._slots.pop(key, None)
        if slot is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._remove(slot)
        return self._values[slot]

    def popitem(self, last: bool = True) -> tuple[bytes, int]:
        slot = self._prev[END] if last else self._next[END]
        if slot == END:
            raise KeyError("popitem(): the map is empty")
        key = self._keys[slot]
        del self._slots[key]
        self._remove(slot)
        return key, self._values[slot]

    def move_to_end(self, key: bytes) -> None:
        self._to_end(self._slots[key])

    def __iter__(self) -> Iterator[bytes]:
        key_of = self._keys.__getitem__
        return (key_of(slot) for slot in self._slots_in_order())

    def clear(self) -> None:
        self._values.clear()
        super().clear()
