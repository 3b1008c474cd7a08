"""The host pool's account of its resident memory (core/host_pool.py): what the
`host_memory_bytes` gauge reports, to tell a worker's memory for entries from the rest."""

from __future__ import annotations

import random

from hybridkv.core.host_pool import HostPool


def test_touched_bytes_are_the_slots_ever_handed_out():
    """Seeded allocations and releases of a few entry sizes (the seed printed): the bytes
    the pool counts as touched are exactly those of the distinct slots it ever handed
    out, which stays below what it reserved, and releasing everything keeps them."""
    seed = random.randrange(2**32)
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
