"""Host memory for entries: slabs carved into entry-sized slots, recycled, and pinned
when the engine's cache is on a GPU.

Entries come in a handful of sizes (one per KV cache group), and a full CPU tier evicts
one for each it stores. Fresh memory for every entry costs a page fault per 4 KiB on
first touch: a store into new memory ran at a fifth of memcpy speed (bench/copy_path.py),
and a disk read likewise. So each size is carved from large slabs and a slot is reused
as soon as its entry is dropped, whatever held it (a tier, a hit held for a load, a
queued disk write). Slabs are kept: the pool grows to the peak of live entries.

On a GPU engine the slabs are pinned: copies run at full PCIe speed only from pinned
memory, pinning is slow (a driver call per allocation), and torch's own pinned allocator
rounds every request up to a power of two, which would let a CPU tier of entries of, say,
36 layers take almost twice its budget. A slab is sized to a power of two and filled.

The slot follows the tensor object `empty` returned, not views made from it: whoever
keeps an entry keeps that tensor (tiers hold entries whole; copies view them only while
they run, and the copy engine holds an entry until a GPU transfer from it is done).
"""

from __future__ import annotations

import threading
import weakref

import torch

# A size's first slab holds this many entries; each next one twice as many, up to
# SLAB_BYTES (so sizes seen rarely reserve little).
_MIN_ENTRIES_PER_SLAB = 8
SLAB_BYTES = 64 << 20


class HostPool:
    def __init__(self, pin: bool, slab_bytes: int = SLAB_BYTES):
        self.pin = pin
        self.slab_bytes = slab_bytes
        # Re-entrant: a slot's release may run from a finalizer inside `empty`.
        self._lock = threading.RLock()
        self._free: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._slabs_of: dict[int, int] = {}  # slabs made for each entry size
        self.slab_count = 0
        self.reserved_bytes = 0  # bytes of all slabs
        # Slots handed out now, and at most, by entry size. A free slot goes back on top of
        # its size's list and is handed out first, so a slot never used was never touched:
        # the slots touched are the most ever in use at once.
        self._in_use: dict[int, int] = {}
        self._peak: dict[int, int] = {}
        self.touched_bytes = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        """A 1-D int8 host tensor of `nbytes` (pinned when the pool pins)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.int8)
        with self._lock:
            free = self._free.setdefault(nbytes, [])
            if not free:
                self._grow(nbytes, free)
            slab, offset = free.pop()
            n = self._in_use[nbytes] = self._in_use.get(nbytes, 0) + 1
            if n > self._peak.get(nbytes, 0):
                self._peak[nbytes] = n
                self.touched_bytes += nbytes
        view = slab[offset : offset + nbytes]
        weakref.finalize(view, self._release, nbytes, slab, offset)
        return view

    def _grow(self, nbytes: int, free: list[tuple[torch.Tensor, int]]) -> None:
        first = _MIN_ENTRIES_PER_SLAB * nbytes
        made = self._slabs_of.get(nbytes, 0)
        self._slabs_of[nbytes] = made + 1
        want = min(first << made, max(self.slab_bytes, first))
        # torch rounds a pinned allocation up to a power of two: ask for one, and fill it.
        size = 1 << (want - 1).bit_length()
        slab = torch.empty(size, dtype=torch.int8, pin_memory=self.pin)
        free.extend((slab, i * nbytes) for i in reversed(range(size // nbytes)))
        self.slab_count += 1
        self.reserved_bytes += size

    def _release(self, nbytes: int, slab: torch.Tensor, offset: int) -> None:
        with self._lock:
            self._free[nbytes].append((slab, offset))
            self._in_use[nbytes] -= 1

    @property
    def resident_bytes(self) -> int:
        """Host memory the pool keeps resident: every slab when pinned (pinning locks a
        slab's pages as it is made), else the slots entries have touched."""
        return self.reserved_bytes if self.pin else self.touched_bytes

    def free_slots(self, nbytes: int) -> int:
        with self._lock:
            return len(self._free.get(nbytes, ()))
