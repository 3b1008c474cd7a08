"""The tiers of one worker (one tensor-parallel rank), looked through in order (fastest
first).

Stores write through to every tier (the disk tier queues its write), so what the CPU tier
evicts, or loses on a restart, is still found below it. An entry found in a lower tier
is copied into the tiers above it. What stays in the CPU tier is decided by the scheduler
side's index (core/index.py); the worker follows its orders.
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

    @classmethod
    def from_config(
        cls,
        config: HybridKVConfig,
        layout: Layout,
        pin: bool,
        cpu_bytes: int | None = None,
    ) -> TieredStore:
        """`pin`: the engine's cache is on a GPU, so entries live in pinned memory.
        `cpu_bytes` (default `config.cpu_bytes`) bounds the CPU tier. The disk tier's
        directory is named by the layout's fingerprint, which differs between
        tensor-parallel ranks."""
        pool = HostPool(pin)
        tiers: list[Tier] = [MemoryTier(cpu_bytes or config.cpu_bytes)]
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

    @property
    def cpu(self) -> Tier:
        return self.tiers[0]

    @property
    def disk(self) -> DiskTier | None:
        return next((t for t in self.tiers if isinstance(t, DiskTier)), None)

    def put(self, key: bytes, entry: torch.Tensor, cpu: bool = True) -> bool:
        """Store in every tier (every tier below the CPU one, without `cpu`); True if
        any took it."""
        stored = [t.put(key, entry) for t in self.tiers[0 if cpu else 1 :]]
        return any(stored)

    def delete(self, key: bytes) -> None:
        for t in self.tiers:
            t.delete(key)

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    # ---- lifecycle -----------------------------------------------------------------------
    def flush(self) -> None:
        for t in self.tiers:
            t.flush()

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats() for t in self.tiers}
