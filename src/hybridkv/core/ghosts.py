"""Attention chunks evicted from CPU memory, remembered for a while (`core/eviction.py`:
a chunk stored again is a *return*, and returns tell a workload that loops).

The list keeps (key, last use) of the most recent evictions, oldest out first, up to
GHOSTS_PER_ENTRY times the entries in CPU memory. At production sizes that is millions of
keys, more Python objects than the index itself holds, so above SAMPLED_FROM remembered
keys the list keeps a spatial sample instead (SHARDS, Waldspurger et al., FAST '15): only
keys whose bits fall in the sampled fraction, a power of two chosen so that at most
SAMPLED_FROM are kept. The bits are the key's own (its first bytes: blake3 output), not
Python's `hash`, which differs with each process's hash seed: the sample, and with it
the eviction policy's choices, would differ from one run of the same trace to the next.
A key is sampled or not the same way when it is evicted and when it comes back, so the
share of returns and their gaps are measured on the sample without bias; only sampled
keys are looked up. Below SAMPLED_FROM every key is kept, exactly as an
unsampled list would.
"""

from __future__ import annotations

GHOSTS_PER_ENTRY = 4
GHOSTS_MIN = 1024
SAMPLED_FROM = 16384


def _bits(key: bytes) -> int:
    """The low 24 bits of the key's first bytes (enough for a sample of one key in 2^24):
    indexing allocates nothing, where `int.from_bytes` of a slice cost the index's stream
    2 % a step (bench/paired_lookup.py)."""
    return key[0] | key[1] << 8 | key[2] << 16


class Ghosts:
    """Oldest eviction out first. Three plain dicts of bytes and ints, not an
    `OrderedDict`: CPython's garbage collector walks every key and value of an
    `OrderedDict` in each full collection (on vLLM's scheduler thread), and never looks
    inside a dict of bytes and ints (core/tracked.py). A key's *place* is its eviction's
    number; the oldest place still held is found by counting up from the last one
    dropped (each number is passed once)."""

    def __init__(self) -> None:
        self._place: dict[bytes, int] = {}  # key -> place
        self._key: dict[int, bytes] = {}  # place -> key
        self._used: dict[int, int] = {}  # place -> the key's last use
        self._head = 0  # no place below it is held
        self._tail = 0  # the next place
        self._mask = 0  # a key is sampled when _bits(key) & mask == 0

    def __len__(self) -> int:
        return len(self._place)

    def sampled(self, key: bytes) -> bool:
        return _bits(key) & self._mask == 0

    def returned(self, key: bytes) -> int | None:
        """The last use of a remembered key stored again (it is forgotten), else None.
        Only for sampled keys."""
        place = self._place.pop(key, None)
        if place is None:
            return None
        del self._key[place]
        return self._used.pop(place)

    def remember(self, last_use: dict[bytes, int], entries: int) -> None:
        """Add evicted chunks (key -> last use); `entries`: in CPU memory now."""
        cap = max(GHOSTS_MIN, GHOSTS_PER_ENTRY * entries)
        sample = 1
        while cap // sample > SAMPLED_FROM:
            sample *= 2
        self._mask = sample - 1
        places, keys, used = self._place, self._key, self._used
        for key, when in last_use.items():
            if _bits(key) & self._mask == 0:
                self.returned(key)  # remembered again: it moves to the end
                places[key] = self._tail
                keys[self._tail] = key
                used[self._tail] = when
                self._tail += 1
        while len(places) > cap // sample:
            while self._head not in keys:
                self._head += 1
            del places[keys.pop(self._head)], used[self._head]
            self._head += 1

    def clear(self) -> None:
        self._place.clear()
        self._key.clear()
        self._used.clear()
        self._head = self._tail = 0
        self._mask = 0
