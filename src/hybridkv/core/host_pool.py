"""Pinned host memory for the entries of a GPU engine, carved from large slabs.

Copies between a GPU and host memory run at full PCIe speed only from pinned (page-locked)
memory, and pinning is slow (a driver call per allocation). torch's own pinned allocator
caches blocks but rounds every request up to a power of two, which would let a CPU tier
of entries of, say, 36 layers take almost twice its budget. Entries come in a handful of
sizes (one per KV cache group), so this pool carves each size from large pinned slabs
and hands out views; a view's slot returns to its size's free list when the last
reference to the view is gone, whatever held it (a tier, a hit held for a load, a queued
disk write). Slabs are kept for reuse: the pool grows to the peak of live entries.

The slot follows the tensor object `empty` returned, not views made from it: whoever
keeps an entry keeps that tensor (tiers hold entries whole; copies view them only while
they run).

A slot freed while a GPU copy from it is still running is safe as long as every copy
through the pool runs on one stream (the copy engine's): the next copy into the slot is
ordered after it on that stream.
"""

from __future__ import annotations

import threading
import weakref

import torch

# A slab holds at least this many entries of its size, and is at least SLAB_BYTES.
_MIN_ENTRIES_PER_SLAB = 8
SLAB_BYTES = 64 << 20


class HostPool:
    def __init__(self, pin: bool, slab_bytes: int = SLAB_BYTES):
        self.pin = pin
        self.slab_bytes = slab_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.slab_count = 0
        self.reserved_bytes = 0  # bytes of all slabs

    def empty(self, nbytes: int) -> torch.Tensor:
        """A 1-D int8 host tensor of `nbytes` (pinned when the pool pins)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.int8)
        with self._lock:
            free = self._free.setdefault(nbytes, [])
            if not free:
                self._grow(nbytes, free)
            slab, offset = free.pop()
        view = slab[offset : offset + nbytes]
        weakref.finalize(view, self._release, nbytes, slab, offset)
        return view

    def _grow(self, nbytes: int, free: list[tuple[torch.Tensor, int]]) -> None:
        # torch rounds a pinned allocation up to a power of two: ask for one, and fill it.
        size = 1 << (max(self.slab_bytes, _MIN_ENTRIES_PER_SLAB * nbytes) - 1).bit_length()
        slab = torch.empty(size, dtype=torch.int8, pin_memory=self.pin)
        free.extend((slab, i * nbytes) for i in reversed(range(size // nbytes)))
        self.slab_count += 1
        self.reserved_bytes += size

    def _release(self, nbytes: int, slab: torch.Tensor, offset: int) -> None:
        with self._lock:
            self._free[nbytes].append((slab, offset))

    def free_slots(self, nbytes: int) -> int:
        with self._lock:
            return len(self._free.get(nbytes, ()))
