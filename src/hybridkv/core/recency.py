"""Entries least recently used first, as eviction reads them: every entry of a layout
without recurrent groups (core/eviction.py's `LruPolicy`), and the orphan chunks of one
with them (`BoundaryPolicy`).

An entry that is held (pinned, being promoted) stays in the order but cannot go. A plain
LRU list would look at it again at every choice, and a running request's chunks stay
pinned for its whole life, so one choice could pass over thousands of them. Here a held
entry met at the front is set aside once, with its place (`_held`), and comes back in that
place when it is released (`_ready`): everything set aside is older than everything still
in the list, so the order is the same as the plain list's and each held entry costs O(1)
per hold, not per choice.

The order is a `LinkedKeys` list (core/linked_keys.py: a native `KeyTable` and
`Column`s, no Python object per key), not an `OrderedDict`: CPython's garbage collector
walks every key of an `OrderedDict` in each full collection, on vLLM's scheduler thread
(`LruPolicy` holds every entry in CPU memory, a million in production), and never looks
inside a column or a `KeyTable`. A `KeyTable` never rebuilds while its keys come and go
and grows a 64th at a time (the longest admission at a million entries: 116-121 ms with
one dict per map, 3.7-5.0 ms with dicts split 64 ways, 1.0-2.2 ms with a `KeyTable`:
`bench/lookup.py --lru-entries`, docs/benchmarks.md), and its lookups of keys no recent
step touched miss the cache less than a dict's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from sortedcontainers import SortedList

from hybridkv.core.linked_keys import END, LinkedKeys


class RecencyQueue(LinkedKeys):
    def __init__(self) -> None:
        super().__init__()
        self._held: dict[bytes, int] = {}  # set aside from the front -> its place
        self._ready: SortedList = SortedList()  # (place, key) set aside, then released
        self._places = 0

    def __len__(self) -> int:
        return len(self._slots) + len(self._held)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots or key in self._held

    def add(self, key: bytes) -> None:
        """Add the key, or make it the most recently used."""
        if key in self._held:
            self.discard(key)
        slot = self._slots.get(key)
        if slot is None:
            self._link_new(key)
        else:
            self._to_end(slot)

    def use(self, key: bytes) -> None:
        """Make the key the most recently used, if it is here."""
        self.use_all((key,))

    def use_all(self, keys: Iterable[bytes]) -> None:
        """`use` of each key, in order: one call for a hit's hundreds, most of which (the
        chunks boundaries need) are not here."""
        held = self._held
        if held:
            keys = [key for key in keys if key in self._slots or key in held]
        else:  # nothing set aside: one call finds the keys here
            keys = self._slots.present(keys)
        for key in keys:
            self.add(key)

    def discard(self, key: bytes) -> None:
        self.discard_all((key,))

    def discard_all(self, keys: Sequence[bytes]) -> None:
        """Take out each of `keys` that is here: an eviction's dozens, most of which (the
        boundaries' states) never were, in one call on the table."""
        held, remove = self._held, self._remove
        for key, slot in zip(keys, self._slots.pop_many(keys, None), strict=True):
            if slot is not None:
                remove(slot)
            elif held:
                place = held.pop(key, None)
                if place is not None:
                    self._ready.discard((place, key))

    def hold(self, keys: list[bytes], held: bool) -> None:
        """The keys became held, or evictable again (set aside keys return to their place;
        the others are looked at when the front reaches them)."""
        places = self._held
        if not places:  # nothing set aside: a hit's hundreds of keys cost one test
            return
        for key in keys:
            place = places.get(key)
            if place is None:
                continue
            if held:
                self._ready.discard((place, key))
            else:
                self._ready.add((place, key))

    def candidates(self, held: Callable[[bytes], bool]) -> Iterator[bytes]:
        """The keys that are not `held`, least recently used first. Held ones met at the
        front are set aside as it goes; nothing else changes, so a caller may stop at any
        point."""
        for _, key in self._ready:
            yield key
        nxt, key_of = self._next, self._keys.__getitem__
        while (slot := nxt[END]) != END and held(key := key_of(slot)):
            del self._slots[key]
            self._remove(slot)
            self._held[key] = self._places
            self._places += 1
        slot = nxt[END]
        while slot != END:
            key = key_of(slot)
            slot = nxt[slot]
            if not held(key):  # a held one behind: set aside when it reaches the front
                yield key

    def clear(self) -> None:
        super().clear()
        self._held.clear()
        self._ready.clear()
