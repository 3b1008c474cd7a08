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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from sortedcontainers import SortedList


class RecencyQueue:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._held: dict[bytes, int] = {}  # set aside from the front -> its place
        self._ready: SortedList = SortedList()  # (place, key) set aside, then released
        self._places = 0

    def __len__(self) -> int:
        return len(self._order) + len(self._held)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order or key in self._held

    def add(self, key: bytes) -> None:
        """Add the key, or make it the most recently used."""
        if key in self._held:
            self.discard(key)
        self._order[key] = None
        self._order.move_to_end(key)

    def use(self, key: bytes) -> None:
        """Make the key the most recently used, if it is here."""
        if key in self._order:
            self._order.move_to_end(key)
        elif key in self._held:
            self.add(key)

    def discard(self, key: bytes) -> None:
        if self._order.pop(key, 0) is None:
            return
        place = self._held.pop(key, None)
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
        while self._order:
            key = next(iter(self._order))
            if held(key):
                del self._order[key]
                self._held[key] = self._places
                self._places += 1
                continue
            break
        for key in self._order:
            if held(key):
                continue  # behind an evictable one: set aside when it reaches the front
            yield key

    def clear(self) -> None:
        self._order.clear()
        self._held.clear()
        self._ready.clear()
