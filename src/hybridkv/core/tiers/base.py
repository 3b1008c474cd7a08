"""The storage-tier interface every tier implements (CPU memory, local disk; shared later).

An entry is an opaque 1-D int8 tensor named by a key (bytes). Tiers never interpret
entries; validation of content belongs to tiers that can damage it (disk, network).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TierStats:
    entries: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected_puts: int = 0  # too large for the tier, or the tier cannot store
    dropped_puts: int = 0  # write queue full: dropped rather than stall the engine
    write_errors: int = 0
    # Unusable entry files found and counted as misses (damaged ones are also removed).
    corrupt: int = 0
    evictions: int = 0
    # Faults caught rather than raised to the engine (I/O errors, anything unexpected);
    # the call that met one answered a miss or False.
    errors: int = 0


class Tier(ABC):
    name: str

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def get(self, key: bytes) -> torch.Tensor | None:
        """The entry, or None on a miss. Callers must not modify it."""

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """`get` of each key; tiers that can read in parallel override it."""
        return [self.get(k) for k in keys]

    @abstractmethod
    def put(self, key: bytes, entry: torch.Tensor) -> bool:
        """Store an entry the caller hands over; False if it was not stored."""

    def knows(self, key: bytes) -> bool:
        """Whether a `put` of `key` would find it held already and write nothing, as far
        as the tier knows without I/O (False where it always writes)."""
        return False

    @abstractmethod
    def delete(self, key: bytes) -> bool: ...

    @abstractmethod
    def stats(self) -> TierStats: ...

    @property
    def up(self) -> bool:
        """Whether the tier serves now; tiers that can go down (Redis) override it."""
        return True

    def clear(self) -> None:  # noqa: B027 - optional
        """Drop every entry (used by `reset_cache`)."""

    def flush(self) -> None:  # noqa: B027 - optional
        """Wait for writes still queued (tiers that write asynchronously)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Finish queued writes and stop background work."""
