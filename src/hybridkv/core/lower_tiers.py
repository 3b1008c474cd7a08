"""What the tiers below CPU memory hold, as far as the scheduler side knows: hints, not
an exact view (core/index.py).

The disk tier keeps its own budget and may be shared with other engines, so a key counts
as on disk once every rank has reported it stored, and until one reports it gone. A
shared tier (Redis) is written by other replicas too: a probe's answer is trusted for a
while (`hint`) and then lapses.

A disk key's ranks are one int (a bitmask: with up to eight ranks one of Python's cached
small ints), not a set per key, because a disk tier lists far more entries than CPU
memory holds. Lapsed hints are dropped oldest first as new ones come (a queue in the
order they were given), so an answer costs O(1) per key it names, not a pass over every
hint; `on_tier` checks the time itself, so one not dropped yet is never trusted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable


class LowerTiers:
    def __init__(self, ranks: int):
        self.ranks = ranks
        self._disk: dict[bytes, int] = {}  # key -> bitmask of the ranks that reported it
        self.disk_entries = 0  # keys every rank reported
        self._hints: dict[str, dict[bytes, float]] = {}  # tier -> key -> good until
        self._given: dict[str, deque[tuple[float, bytes]]] = {}  # tier -> (until, key)

    @property
    def tiers(self) -> Iterable[str]:
        """The shared tiers hinted at."""
        return self._hints.keys()

    def on_disk(self, key: bytes) -> bool:
        ranks = self._disk.get(key)
        return ranks is not None and ranks.bit_count() >= self.ranks

    def disk_changed(self, rank: int, key: bytes, present: bool) -> None:
        before = self.on_disk(key)
        ranks = self._disk.get(key, 0)
        ranks = ranks | 1 << rank if present else ranks & ~(1 << rank)
        if ranks:
            self._disk[key] = ranks
        else:
            self._disk.pop(key, None)
        self.disk_entries += self.on_disk(key) - before

    def forget_disk(self, key: bytes) -> None:
        self.disk_entries -= self.on_disk(key)
        self._disk.pop(key, None)

    def on_tier(self, key: bytes, tier: str) -> bool:
        hints = self._hints.get(tier)
        until = hints.get(key) if hints else None
        return until is not None and until > time.monotonic()

    def hint(self, tier: str, keys: Iterable[bytes], until: float) -> None:
        """A probe found `keys` in `tier`: trust it until `until` (monotonic)."""
        hints = self._hints.setdefault(tier, {})
        given = self._given.setdefault(tier, deque())
        now = time.monotonic()
        while given and given[0][0] <= now:
            lapsed, key = given.popleft()
            if hints.get(key) == lapsed:
                del hints[key]
        for key in keys:
            hints[key] = until
            given.append((until, key))

    def forget_hint(self, tier: str, key: bytes) -> None:
        self._hints.get(tier, {}).pop(key, None)

    def clear(self) -> None:
        self._disk.clear()
        self.disk_entries = 0
        self._hints.clear()
        self._given.clear()
