"""CPU-memory tier: a byte budget with least-recently-used eviction.

In an engine the scheduler side's index decides what stays (core/index.py) and this
tier's budget is only a bound against runaway growth: whatever it evicts on its own is
passed to `on_evict` (set by the worker), so the index learns that the entry is gone."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from hybridkv.core.tiers.base import Tier, TierStats


class MemoryTier(Tier):
    name = "cpu"

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        # Called (under the tier's lock) with each key the budget evicts.
        self.on_evict: Callable[[bytes], None] | None = None
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._stats = TierStats(capacity_bytes=capacity_bytes)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return entry

    def put(self, key: bytes, entry: torch.Tensor) -> bool:
        size = entry.numel() * entry.element_size()
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            if size > self.capacity:
                self._stats.rejected_puts += 1
                return False
            while self._used + size > self.capacity:
                old_key, old = self._entries.popitem(last=False)
                self._used -= old.numel() * old.element_size()
                self._stats.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(old_key)
            self._entries[key] = entry
            self._used += size
            self._stats.puts += 1
            return True

    def knows(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: bytes) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is None:
                return False
            self._used -= old.numel() * old.element_size()
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.entries, s.bytes_used = len(self._entries), self._used
            return s
