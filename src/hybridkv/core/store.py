"""The tiers of one worker (one tensor-parallel rank), looked through in order (fastest
first).

Each tier below CPU memory has a store policy: `always` (stores write through to it:
the disk and Redis tiers queue their writes, so what CPU memory evicts, or loses on a
restart, is still found below), `on_evict` (written when CPU memory evicts the entry, or
at once for a store CPU memory had no room for), or `never` (read only: a shared cache
other replicas fill). An entry promoted from a lower tier goes into CPU memory and the
`always` tiers above its source. What stays in CPU memory is decided by the scheduler
side's index (core/index.py); the worker follows its orders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridkv.core.config import HybridKVConfig, RedisTierConfig
from hybridkv.core.host_pool import HostPool
from hybridkv.core.layout import Layout
from hybridkv.core.planner import Planner
from hybridkv.core.tiers.base import Tier, TierStats
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.core.tiers.memory import MemoryTier
from hybridkv.core.tiers.redis import RedisTier


def redis_tier(
    config: HybridKVConfig,
    t: RedisTierConfig,
    fingerprint: bytes,
    entry_bytes: Sequence[int] | None = None,
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> RedisTier:
    """The Redis tier a config names (the scheduler side builds one to probe it)."""
    return RedisTier(
        t.url,
        fingerprint,
        cluster=t.cluster,
        ttl_s=t.ttl_s,
        key_prefix=t.key_prefix,
        timeout_ms=t.timeout_ms,
        max_entry_bytes=t.max_entry_bytes,
        entry_bytes=entry_bytes,
        integrity_key=config.integrity_key,
        queue_bytes=t.queue_bytes,
        alloc=alloc,
    )


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        pool: HostPool | None = None,
        policies: dict[str, str] | None = None,
    ):
        """`policies`: store policy by tier name (default `always`)."""
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = list(tiers)
        self.policies = {t.name: (policies or {}).get(t.name, "always") for t in self.tiers[1:]}
        # Host memory of the entries this engine makes (stores, disk reads).
        self.pool = pool or HostPool(pin=False)
        # Bytes of the entries each tier accepted (`_put`), for the metrics.
        self.stored_bytes: dict[str, int] = {t.name: 0 for t in self.tiers}

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
        planner = Planner(layout.groups, config.chunk_tokens)
        entry_bytes = [planner.entry_bytes(g) for g in range(len(layout.groups))]
        tiers: list[Tier] = [MemoryTier(cpu_bytes or config.cpu_bytes)]
        for t in config.tiers[1:]:
            if t.kind == "disk":
                tiers.append(
                    DiskTier(
                        t.path,
                        layout.fingerprint,
                        layout.describe(),
                        t.bytes,
                        entry_bytes=entry_bytes,
                        file_mode=t.mode,
                        integrity_key=config.integrity_key,
                        queue_bytes=t.queue_bytes,
                        fsync=t.fsync,
                        direct_io=t.direct_io,
                        alloc=pool.empty,
                    )
                )
            elif t.kind == "redis":
                tiers.append(redis_tier(config, t, layout.fingerprint, entry_bytes, pool.empty))
        return cls(tiers, pool, {t.kind: t.store for t in config.tiers[1:]})

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
                    self._put(upper, key, entry)
            missing = still
        return found

    @property
    def cpu(self) -> Tier:
        return self.tiers[0]

    @property
    def disk(self) -> DiskTier | None:
        return next((t for t in self.tiers if isinstance(t, DiskTier)), None)

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def _put(self, tier: Tier, key: bytes, entry: torch.Tensor) -> bool:
        """`tier.put`, counting the bytes the tier accepted to write (not a put of what it
        held already; callers serialize: the worker calls its store under its lock)."""
        held = tier.knows(key)
        stored = tier.put(key, entry)
        if stored and not held:
            self.stored_bytes[tier.name] += entry.numel() * entry.element_size()
        return stored

    def _below(self, *policies: str) -> list[Tier]:
        return [t for t in self.tiers[1:] if self.policies[t.name] in policies]

    def put(self, key: bytes, entry: torch.Tensor, cpu: bool = True, below: bool = True) -> bool:
        """Store in CPU memory and the `always` tiers; without `cpu` (no room there), in
        the `on_evict` tiers as well, as if evicted at once; without `below`, in CPU
        memory only (a staged decode-time state: `persist` writes it down later). True
        if any took it."""
        lower = self._below("always") if cpu else self._below("always", "on_evict")
        tiers = ([self.cpu] if cpu else []) + (lower if below else [])
        return any([self._put(t, key, entry) for t in tiers])

    def persist(self, key: bytes, entry: torch.Tensor) -> None:
        """An entry CPU memory alone held so far: the `always` tiers take it now, as a
        store would have (the `on_evict` ones take it when CPU memory evicts it)."""
        for t in self._below("always"):
            self._put(t, key, entry)

    @property
    def evicts_below(self) -> bool:
        """Some tier takes what CPU memory evicts."""
        return bool(self._below("on_evict"))

    def evicted(self, key: bytes, entry: torch.Tensor) -> None:
        """CPU memory dropped the entry: the `on_evict` tiers take it now."""
        for t in self._below("on_evict"):
            self._put(t, key, entry)

    def promoted(self, key: bytes, entry: torch.Tensor, source: str) -> bool:
        """An entry read from tier `source`: into CPU memory and the `always` tiers above
        it. Whether CPU memory took it."""
        for t in self.tiers[1:]:
            if t.name == source:
                break
            if self.policies[t.name] == "always":
                self._put(t, key, entry)
        return self._put(self.cpu, key, entry)

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
