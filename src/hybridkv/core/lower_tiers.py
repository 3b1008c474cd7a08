"""What the tiers below CPU memory hold, as far as the scheduler side knows: hints, not
an exact view (core/index.py).

The disk tier keeps its own budget and may be shared with other engines, so a key counts
as on disk once every rank has reported it stored, and until one reports it gone. A
shared tier (Redis) is written by other replicas too: a probe's answer is trusted for a
while (`hint`) and then lapses.

A disk key's ranks are one int (a bitmask: with up to eight ranks one of Python's cached
small ints), not a set per key, because a disk tier lists far more entries than CPU
memory holds. Hints lapse as core/lapsing.py says: O(1) per key an answer names, never
a pass over every hint.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hybridkv.core.keytable import KeyTable
from hybridkv.core.lapsing import Lapsing


class LowerTiers:
    def __init__(self, ranks: int):
        self.ranks = ranks
        self._disk = KeyTable()  # key -> bitmask of the ranks that reported it
        self.disk_entries = 0  # keys every rank reported
        self._hints: dict[str, Lapsing] = {}  # tier -> what a probe found there

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
        return hints is not None and bool(hints.get(key, time.monotonic()))

    def not_hinted(self, tier: str, keys: list[bytes]) -> list[bytes]:
        """Of `keys`, those `tier` is not known to hold (`on_tier` for many keys)."""
        hints = self._hints.get(tier)
        return keys if hints is None else hints.without_yes(keys, time.monotonic())

    def hint(self, tier: str, keys: Iterable[bytes], until: float) -> None:
        """A probe found `keys` in `tier`: trust it until `until` (monotonic)."""
        hints = self._hints.setdefault(tier, Lapsing())
        hints.drop_lapsed(time.monotonic())
        for key in keys:
            hints.put(key, until)

    def forget_hint(self, tier: str, key: bytes) -> None:
        hints = self._hints.get(tier)
        if hints is not None:
            hints.pop(key)

    def clear(self) -> None:
        self._disk.clear()
        self.disk_entries = 0
        self._hints.clear()
