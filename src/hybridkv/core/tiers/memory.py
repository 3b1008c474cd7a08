"""CPU-memory tier: a byte budget with least-recently-used eviction."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from hybridkv.core.tiers.base import Tier, TierStats


class MemoryTier(Tier):
    name = "cpu"

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
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
                _, old = self._entries.popitem(last=False)
                self._used -= old.numel() * old.element_size()
                self._stats.evictions += 1
            self._entries[key] = entry
            self._used += size
            self._stats.puts += 1
            return True

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
