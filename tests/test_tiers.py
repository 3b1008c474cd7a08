"""CPU memory tier (byte budget, LRU) and the tiered store, against a reference model."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.config import HybridKVConfig
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.store import TieredStore
from hybridkv.core.tiers import MemoryTier, TierStats

DTYPES = [torch.int8, torch.bfloat16, torch.float32]
LAYOUT = Layout("m", (GroupSpec(GroupKind.FULL, 16, 1024, ("l0",)),))


def entry(nbytes: int, dtype: torch.dtype = torch.int8, fill: int = 0) -> torch.Tensor:
    size = torch.tensor([], dtype=dtype).element_size()
    assert nbytes % size == 0
    return torch.full((nbytes // size,), fill, dtype=dtype)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


class ModelLRU:
    """Reference: an LRU dict of sizes with the tier's accounting."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.stats = TierStats(capacity_bytes=capacity)

    def put(self, k: bytes, size: int) -> bool:
        if k in self.entries:
            self.entries.move_to_end(k)
            return True
        if size > self.capacity:
            self.stats.rejected_puts += 1
            return False
        while sum(self.entries.values()) + size > self.capacity:
            self.entries.popitem(last=False)
            self.stats.evictions += 1
        self.entries[k] = size
        self.stats.puts += 1
        return True

    def get(self, k: bytes) -> bool:
        if k not in self.entries:
            self.stats.misses += 1
            return False
        self.entries.move_to_end(k)
        self.stats.hits += 1
        return True

    def delete(self, k: bytes) -> bool:
        return self.entries.pop(k, None) is not None


OPS = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 12), st.integers(0, 160), st.sampled_from(range(3))),
    st.tuples(st.just("get"), st.integers(0, 12)),
    st.tuples(st.just("delete"), st.integers(0, 12)),
    st.tuples(st.just("contains"), st.integers(0, 12)),
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 300), ops=st.lists(OPS, max_size=40))
def test_memory_tier_matches_reference_lru(capacity, ops):
    tier = MemoryTier(capacity)
    model = ModelLRU(capacity)
    stored: dict[bytes, torch.Tensor] = {}
    for op in ops:
        k = key(op[1])
        if op[0] == "put":
            dtype = DTYPES[op[3]]
            nbytes = op[2] - op[2] % torch.tensor([], dtype=dtype).element_size()
            e = entry(nbytes, dtype, fill=op[1])
            ok = tier.put(k, e)
            assert ok == model.put(k, nbytes)
            if ok and k not in stored:
                stored[k] = e
        elif op[0] == "get":
            got = tier.get(k)
            assert (got is not None) == model.get(k)
            if got is not None:
                assert got is stored[k]  # the very tensor handed over, not a copy
        elif op[0] == "delete":
            assert tier.delete(k) == model.delete(k)
        else:
            assert tier.contains(k) == (k in model.entries)
        for gone in set(stored) - set(model.entries):
            del stored[gone]

        s = tier.stats()
        assert s.bytes_used <= capacity
        assert s.bytes_used == sum(model.entries.values())
        assert s.entries == len(model.entries)
        assert (s.hits, s.misses, s.puts, s.rejected_puts, s.evictions) == (
            model.stats.hits,
            model.stats.misses,
            model.stats.puts,
            model.stats.rejected_puts,
            model.stats.evictions,
        )
        assert s.capacity_bytes == capacity
    assert [k for k in model.entries if tier.contains(k)] == list(model.entries)


def test_lru_order_get_refreshes_recency():
    tier = MemoryTier(300)
    for i in range(3):
        assert tier.put(key(i), entry(100))
    assert tier.get(key(0)) is not None  # 0 is now the most recent; 1 the oldest
    assert tier.put(key(3), entry(100))
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    # Re-putting an existing key refreshes it too (and does not store twice).
    assert tier.put(key(2), entry(100))
    assert tier.put(key(4), entry(150))  # must evict 0 then 3, keeping 2
    assert [tier.contains(key(i)) for i in range(5)] == [False, False, True, False, True]
    s = tier.stats()
    assert (s.entries, s.bytes_used, s.puts, s.evictions) == (2, 250, 5, 3)


def test_oversized_entry_is_rejected_and_counted():
    tier = MemoryTier(100)
    assert tier.put(key(0), entry(60))
    assert not tier.put(key(1), entry(101))
    assert not tier.put(key(2), entry(104, torch.float32))  # 26 elements, 104 bytes
    s = tier.stats()
    assert (s.rejected_puts, s.puts, s.evictions, s.entries, s.bytes_used) == (2, 1, 0, 1, 60)
    assert tier.contains(key(0))  # a rejected put evicts nothing
    assert tier.put(key(3), entry(100))  # exactly the capacity fits
    assert tier.stats().bytes_used == 100


def test_budget_boundary_is_exact():
    tier = MemoryTier(100)
    tier.put(key(0), entry(60))
    tier.put(key(1), entry(40))  # 100 of 100: fits without eviction
    assert tier.stats().evictions == 0
    tier.put(key(2), entry(1))  # one byte over: the oldest goes
    assert not tier.contains(key(0)) and tier.contains(key(1)) and tier.contains(key(2))
    assert tier.stats().bytes_used == 41
    tier.put(key(3), entry(60))  # 101 again: evicts key 1
    assert [tier.contains(key(i)) for i in range(4)] == [False, False, True, True]
    assert tier.stats().bytes_used == 61


def test_stats_counters():
    tier = MemoryTier(1000)
    assert tier.get(key(0)) is None
    tier.put(key(0), entry(10))
    tier.get(key(0))
    tier.get(key(0))
    tier.get(key(1))
    s = tier.stats()
    assert (s.hits, s.misses, s.puts) == (2, 2, 1)
    # stats() is a snapshot, not a live view.
    s.hits = 99
    assert tier.stats().hits == 2


def test_delete_and_clear():
    tier = MemoryTier(1000)
    for i in range(4):
        tier.put(key(i), entry(100))
    assert tier.delete(key(1))
    assert not tier.delete(key(1))
    assert not tier.contains(key(1))
    assert tier.get(key(1)) is None
    assert tier.stats().bytes_used == 300
    tier.clear()
    s = tier.stats()
    assert (s.entries, s.bytes_used) == (0, 0)
    assert not any(tier.contains(key(i)) for i in range(4))
    # The budget is whole again after clear: ten 100-byte entries fit without eviction.
    for i in range(10):
        assert tier.put(key(10 + i), entry(100))
    assert tier.stats().evictions == 0


def test_tiered_store_falls_through_tiers_in_order():
    fast, slow = MemoryTier(1000), MemoryTier(1000)
    store = TieredStore([fast, slow])
    a_fast, a_slow, b_slow = entry(10, fill=1), entry(10, fill=2), entry(10, fill=3)
    fast.put(key(0), a_fast)
    slow.put(key(0), a_slow)
    slow.put(key(1), b_slow)

    assert store.get(key(0)) is a_fast
    assert slow.stats().hits == 0  # not consulted once the fast tier hit
    assert store.get(key(1)) is b_slow
    assert fast.stats().misses == 1
    assert slow.stats().hits == 1
    assert fast.contains(key(1))  # a lower-tier hit is copied up
    assert store.get(key(1)) is b_slow and slow.stats().hits == 1
    assert store.get(key(2)) is None
    assert (fast.stats().misses, slow.stats().misses) == (2, 1)

    assert store.contains(key(1)) and not store.contains(key(2))
    assert store.put(key(5), entry(10))
    assert fast.contains(key(5)) and slow.contains(key(5))  # puts write through
    staged = entry(10, fill=4)
    assert store.put(key(6), staged, below=False)  # a staged state: CPU memory only
    assert fast.contains(key(6)) and not slow.contains(key(6))
    store.persist(key(6), staged)  # its request finished: written down
    assert slow.get(key(6)) is staged
    store.clear()
    assert fast.stats().entries == slow.stats().entries == 0


def test_stored_bytes_count_what_a_tier_took_to_write(tmp_path):
    """A put of an entry a tier holds already (a lower tier's hit copied up, a store
    planned twice) writes nothing there, and is not counted as written."""
    from hybridkv.core.keys import group_key
    from hybridkv.core.tiers.disk import DiskTier

    cpu = MemoryTier(1000)
    disk = DiskTier(tmp_path, bytes(16), {"model": "m"}, 1 << 20)
    store = TieredStore([cpu, disk])
    k = group_key(key(1), 0)
    try:
        assert store.put(k, entry(10))
        assert store.put(k, entry(10))
        disk.flush()
        cpu.delete(k)
        assert store.get(k) is not None  # read from disk, put into CPU memory again
        assert store.stored_bytes == {cpu.name: 20, disk.name: 10}
    finally:
        store.close()


def test_tiered_store_needs_a_tier():
    with pytest.raises(ValueError):
        TieredStore([])


def test_tiered_store_from_config():
    store = TieredStore.from_config(
        HybridKVConfig.from_dict({"cpu_bytes": "1KiB"}), LAYOUT, pin=False
    )
    assert not store.put(key(0), entry(1025))
    assert store.put(key(0), entry(1024))
