"""The tiers of one engine, looked through in order (fastest first).

Stores write through to every tier (the disk tier queues its write), so what the CPU tier
evicts, or loses on a restart, is still found below it. An entry found in a lower tier
is copied into the tiers above it. Entries fetched for a load that is planned but not yet
run are *held*: no eviction or damage can take them away before the load reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.core.config import HybridKVConfig
from hybridkv.core.host_pool import HostPool
from hybridkv.core.layout import Layout
from hybridkv.core.planner import Planner
from hybridkv.core.tiers.base import Tier, TierStats
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.core.tiers.memory import MemoryTier


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], pool: HostPool | None = None):
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = list(tiers)
        # Host memory of the entries this engine makes (stores, disk reads).
        self.pool = pool or HostPool(pin=False)
        self._held: dict[str, dict[bytes, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, config: HybridKVConfig, layout: Layout, pin: bool) -> TieredStore:
        """`pin`: the engine's cache is on a GPU, so entries live in pinned memory."""
        pool = HostPool(pin)
        tiers: list[Tier] = [MemoryTier(config.cpu_bytes)]
        if config.disk_path is not None:
            planner = Planner(layout.groups, config.chunk_tokens)
            tiers.append(
                DiskTier(
                    config.disk_path,
                    layout.fingerprint,
                    layout.describe(),
                    config.disk_bytes,
                    entry_bytes=[planner.entry_bytes(g) for g in range(len(layout.groups))],
                    file_mode=config.disk_mode,
                    integrity_key=config.integrity_key,
                    queue_bytes=config.disk_queue_bytes,
                    fsync=config.disk_fsync,
                    alloc=pool.empty,
                )
            )
        return cls(tiers, pool)

    def contains(self, key: bytes) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def get(self, key: bytes) -> torch.Tensor | None:
        return self.get_many([key]).get(key)

    def get_many(self, keys: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        """The entries found, each from the fastest tier holding it; what a lower tier
        served is copied into the tiers above it."""
        found: dict[bytes, torch.Tensor] = {}
        missing = list(keys)
        for i, tier in enumerate(self.tiers):
            if not missing:
                break
            still = []
            for key, entry in zip(missing, tier.get_many(missing), strict=True):
                if entry is None:
                    still.append(key)
                    continue
                found[key] = entry
                for upper in self.tiers[:i]:
                    upper.put(key, entry)
            missing = still
        return found

    def put(self, key: bytes, entry: torch.Tensor) -> bool:
        """Store in every tier; True if any took it."""
        stored = [t.put(key, entry) for t in self.tiers]
        return any(stored)

    def delete(self, key: bytes) -> None:
        for t in self.tiers:
            t.delete(key)

    def clear(self) -> None:
        self._held.clear()
        for t in self.tiers:
            t.clear()

    # ---- entries held for planned loads ------------------------------------------------
    def hold(self, owner: str, entries: dict[bytes, torch.Tensor]) -> None:
        """Keep `entries` for `owner` (a request) until it takes them; replaces any held."""
        self._held[owner] = entries

    def release(self, owner: str) -> dict[bytes, torch.Tensor]:
        return self._held.pop(owner, {})

    def is_held(self, owner: str) -> bool:
        return owner in self._held

    def held_entries(self) -> int:
        """Entries held for planned loads: 0 whenever no request is between lookup and
        load (a leak shows here)."""
        return sum(len(entries) for entries in self._held.values())

    # ---- lifecycle -----------------------------------------------------------------------
    def flush(self) -> None:
        for t in self.tiers:
            t.flush()

    def close(self) -> None:
        self._held.clear()
        for t in self.tiers:
            t.close()

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats() for t in self.tiers}
