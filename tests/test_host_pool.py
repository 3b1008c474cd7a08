"""The pinned-slab pool for GPU engines. Pinning needs CUDA, but the pool's logic is the
same on plain memory, which is what these tests run on. Also its account of the memory it
keeps resident (the `host_memory_bytes` gauge)."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from conftest import SEED

from hybridkv.core.host_pool import HostPool


def fill(t: torch.Tensor, value: int) -> None:
    t.fill_(value)


def test_slots_are_distinct_and_slabs_sized_to_a_power_of_two():
    pool = HostPool(pin=False, slab_bytes=1 << 12)
    entries = [pool.empty(1000) for _ in range(20)]
    for i, e in enumerate(entries):
        assert e.dtype == torch.int8 and e.shape == (1000,) and e.is_contiguous()
        fill(e, i)
    for i, e in enumerate(entries):
        assert bool((e == i).all()), "two live entries share bytes"
    # A slab holds at least 8 entries and is a power of two: 8000 -> 8192 bytes, 8 slots.
    assert pool.slab_count == 3 and pool.reserved_bytes == 3 * 8192
    assert pool.free_slots(1000) == 3 * 8 - 20


def test_a_dropped_entry_returns_its_slot_and_it_is_reused():
    pool = HostPool(pin=False, slab_bytes=1 << 12)
    keep = pool.empty(512)
    gone = pool.empty(512)
    ptr = gone.data_ptr()
    free = pool.free_slots(512)
    del gone
    gc.collect()
    assert pool.free_slots(512) == free + 1
    again = pool.empty(512)
    assert again.data_ptr() == ptr and keep.data_ptr() != ptr
    assert pool.slab_count == 1


def test_an_entry_held_elsewhere_keeps_its_slot():
    """A tier holding the tensor keeps the slot, whatever else let go of it."""
    pool = HostPool(pin=False, slab_bytes=1 << 12)
    tier = {"k": pool.empty(256)}
    fill(tier["k"], 7)
    others = [pool.empty(256) for _ in range(40)]  # more than one slab's worth
    for o in others:
        fill(o, 1)
    assert bool((tier["k"] == 7).all())


@pytest.mark.parametrize("sizes", [[1, 3, 4096], [5000, 70, 5000]])
def test_sizes_have_their_own_slots(sizes):
    pool = HostPool(pin=False, slab_bytes=1 << 12)
    entries = [pool.empty(n) for n in sizes]
    for i, e in enumerate(entries):
        fill(e, i + 1)
    for i, (n, e) in enumerate(zip(sizes, entries, strict=True)):
        assert e.numel() == n and bool((e == i + 1).all())
    assert pool.empty(0).numel() == 0


def test_touched_bytes_are_the_slots_ever_handed_out():
    """Seeded allocations and releases of a few entry sizes (the seed printed): the bytes
    the pool counts as touched are exactly those of the distinct slots it ever handed
    out, which stays below what it reserved, and releasing everything keeps them."""
    seed = SEED
    print(f"seed {seed}")
    rng = random.Random(seed)
    pool = HostPool(pin=False, slab_bytes=64 << 10)
    sizes = [512, 1536, 4096]
    live: list = []
    seen: set[tuple[int, int]] = set()
    for _ in range(3000):
        if live and rng.random() < 0.5:
            live.pop(rng.randrange(len(live)))
        else:
            nbytes = rng.choice(sizes)
            t = pool.empty(nbytes)
            seen.add((t.untyped_storage().data_ptr() + t.storage_offset(), nbytes))
            live.append(t)
        assert pool.touched_bytes == sum(n for _, n in seen) <= pool.reserved_bytes
    touched = pool.touched_bytes
    live.clear()
    assert pool.touched_bytes == pool.resident_bytes == touched > 0
    assert HostPool(pin=True).resident_bytes == HostPool(pin=True).reserved_bytes == 0
