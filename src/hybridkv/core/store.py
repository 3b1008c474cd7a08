"""The tiers of one engine, looked through in order (fastest first)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.core.config import HybridKVConfig
from hybridkv.core.tiers.base import Tier
from hybridkv.core.tiers.memory import MemoryTier


class TieredStore:
    def __init__(self, tiers: Sequence[Tier]):
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = list(tiers)

    @classmethod
    def from_config(cls, config: HybridKVConfig) -> TieredStore:
        return cls([MemoryTier(config.cpu_bytes)])

    def contains(self, key: bytes) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def get(self, key: bytes) -> torch.Tensor | None:
        for tier in self.tiers:
            entry = tier.get(key)
            if entry is not None:
                return entry
        return None

    def put(self, key: bytes, entry: torch.Tensor) -> bool:
        return self.tiers[0].put(key, entry)

    def delete(self, key: bytes) -> None:
        for t in self.tiers:
            t.delete(key)

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()
