"""Attention chunks evicted from CPU memory, remembered for a while (`core/eviction.py`:
a chunk stored again is a *return*, and returns tell a workload that loops).

The list keeps (key, last use) of the most recent evictions, oldest out first, up to
GHOSTS_PER_ENTRY times the entries in CPU memory. At production sizes that is millions of
keys, more Python objects than the index itself holds, so above SAMPLED_FROM remembered
keys the list keeps a spatial sample instead (SHARDS, Waldspurger et al., FAST '15): only
keys whose hash falls in the sampled fraction, a power of two chosen so that at most
SAMPLED_FROM are kept. A key is sampled or not the same way when it is evicted and when it
comes back, so the share of returns and their gaps are measured on the sample without
bias; only sampled keys are looked up. Below SAMPLED_FROM every key is kept, exactly as an
unsampled list would.
"""

from __future__ import annotations

from collections import OrderedDict

GHOSTS_PER_ENTRY = 4
GHOSTS_MIN = 1024
SAMPLED_FROM = 16384


class Ghosts:
    def __init__(self) -> None:
        self._last_use: OrderedDict[bytes, int] = OrderedDict()  # oldest eviction first
        self._mask = 0  # a key is sampled when hash(key) & mask == 0

    def __len__(self) -> int:
        return len(self._last_use)

    def sampled(self, key: bytes) -> bool:
        return hash(key) & self._mask == 0

    def returned(self, key: bytes) -> int | None:
        """The last use of a remembered key stored again (it is forgotten), else None.
        Only for sampled keys."""
        return self._last_use.pop(key, None)

    def remember(self, last_use: dict[bytes, int], entries: int) -> None:
        """Add evicted chunks (key -> last use); `entries`: in CPU memory now."""
        cap = max(GHOSTS_MIN, GHOSTS_PER_ENTRY * entries)
        sample = 1
        while cap // sample > SAMPLED_FROM:
            sample *= 2
        self._mask = sample - 1
        ghosts = self._last_use
        for key, used in last_use.items():
            if hash(key) & self._mask == 0:
                ghosts[key] = used
                ghosts.move_to_end(key)
        while len(ghosts) > cap // sample:
            ghosts.popitem(last=False)

    def clear(self) -> None:
        self._last_use.clear()
        self._mask = 0
