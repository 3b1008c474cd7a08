"""The scheduler side's index of what the workers hold (core/index.py), and the disk
tier's change journal the workers report it from."""

from __future__ import annotations

import random
import time

import torch

from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import group_key
from hybridkv.core.tiers.disk import DiskTier


def k(i: int, g: int = 0) -> bytes:
    return group_key(i.to_bytes(16, "little"), g)


def test_lru_eviction_orders_the_workers_and_spares_pins():
    index = StoreIndex(cpu_capacity=300)
    for i in range(3):
        assert index.admit(k(i), 100)
    index.pin([k(0)])
    index.take_orders()
    assert index.admit(k(3), 100)
    # k(0) is the oldest but pinned: k(1) goes instead.
    assert index.take_orders().evict == [k(1)]
    assert index.in_cpu(k(0)) and not index.in_cpu(k(1))
    index.pin([k(2), k(3)])
    assert not index.admit(k(4), 100)  # everything pinned: refused, nothing evicted
    assert index.take_orders().evict == []
    assert index.stats.cpu_full == 1
    index.unpin([k(0), k(2), k(3)])
    assert index.pinned() == 0
    assert index.admit(k(4), 100)


def test_an_entry_evicted_then_stored_again_in_one_step_is_not_evicted():
    index = StoreIndex(cpu_capacity=200)
    index.admit(k(0), 100)
    index.admit(k(1), 100)
    index.take_orders()
    index.admit(k(2), 100)  # evicts k(0)
    index.admit(k(0), 100)  # evicts k(1); k(0) back
    orders = index.take_orders()
    assert orders.evict == [k(1)]
    assert index.in_cpu(k(0)) and index.in_cpu(k(2))


def test_per_rank_sizes_count_for_every_rank():
    index = StoreIndex(cpu_capacity=400, ranks=2)
    assert index.admit(k(0), 100) and index.admit(k(1), 100)
    assert index.gauges()["cpu_bytes"] == 400
    assert index.admit(k(2), 100)
    assert index.take_orders().evict == [k(0)]


def test_disk_entries_count_once_every_rank_has_reported_them():
    index = StoreIndex(cpu_capacity=1000, ranks=2)
    index.apply(0, WorkerReport(disk=[(k(0), True), (k(1), True)]))
    assert not index.known(k(0))
    index.apply(1, WorkerReport(disk=[(k(0), True)]))
    assert index.on_disk(k(0)) and not index.on_disk(k(1))
    index.apply(1, WorkerReport(disk=[(k(0), False)]))  # gone on one rank: gone
    assert not index.known(k(0))


def test_promotion_is_ready_when_every_rank_has_read_it():
    index = StoreIndex(cpu_capacity=1000, ranks=2)
    for rank in (0, 1):
        index.apply(rank, WorkerReport(disk=[(k(0), True), (k(1), True)]))
    assert index.promote(k(0), 100) and index.promote(k(1), 100)
    assert index.take_orders().promote == [(k(0), "disk"), (k(1), "disk")]
    assert index.promoting(k(0)) and not index.in_cpu(k(0))
    index.apply(0, WorkerReport(promoted=[(0, k(0), True), (0, k(1), True)]))
    assert index.promoting(k(0))
    index.apply(1, WorkerReport(promoted=[(0, k(0), True), (0, k(1), False)]))
    assert index.in_cpu(k(0))
    # One rank failed k(1): rank 0 must drop its copy, and the disk entry is not trusted.
    assert not index.known(k(1))
    assert index.take_orders().evict == [k(1)]
    assert index.stats.promotions == 1 and index.stats.failed_promotions == 1


def test_promoting_entries_are_never_evicted():
    index = StoreIndex(cpu_capacity=200)
    index.apply(0, WorkerReport(disk=[(k(0), True)]))
    assert index.promote(k(0), 100)
    index.admit(k(1), 100)
    index.take_orders()
    assert index.admit(k(2), 100)  # k(0) is the oldest, but on its way: k(1) goes
    assert index.take_orders().evict == [k(1)] and index.promoting(k(0))


def test_reports_from_before_a_clear_are_ignored():
    index = StoreIndex(cpu_capacity=1000)
    index.apply(0, WorkerReport(disk=[(k(0), True)]))
    index.promote(k(0), 100)
    index.clear()
    orders = index.take_orders()
    assert orders.clear and not index.known(k(0))
    index.apply(0, WorkerReport(epoch=0, promoted=[(0, k(0), True)], disk=[(k(1), True)]))
    assert not index.known(k(0)) and not index.known(k(1))
    index.apply(0, WorkerReport(epoch=1, disk=[(k(1), True)]))
    assert index.on_disk(k(1))


def test_a_lost_entry_leaves_the_index():
    index = StoreIndex(cpu_capacity=1000)
    index.admit(k(0), 100)
    index.apply(0, WorkerReport(lost=[k(0)]))
    assert not index.known(k(0)) and index.stats.lost == 1


def test_delete_spares_pinned_entries_and_evict_all_spares_them_too():
    index = StoreIndex(cpu_capacity=1000)
    for i in range(3):
        index.admit(k(i), 100)
    index.pin([k(0)])
    index.delete(k(0))
    index.delete(k(1))
    assert index.in_cpu(k(0)) and not index.known(k(1))
    assert index.evict_all() == 1  # k(2); k(0) is pinned
    orders = index.take_orders()
    assert orders.delete == [k(1)] and orders.evict == [k(2)]


def test_worker_reports_merge_in_order():
    a = WorkerReport(epoch=1, disk=[(k(0), True)], lost=[k(1)])
    b = WorkerReport(epoch=2, disk=[(k(0), False)])
    m = a.merge(b)
    assert m.epoch == 2 and m.disk == [(k(0), True), (k(0), False)] and m.lost == [k(1)]
    assert not WorkerReport() and m


def test_disk_journal_reports_every_change(tmp_path):
    disk = DiskTier(tmp_path, b"f" * 16, {}, 1 << 20)
    entry = torch.ones(1000, dtype=torch.int8)
    disk.put(k(0), entry)
    disk.flush()
    assert disk.take_changes() == [(k(0), True)]  # first call: everything held
    disk.put(k(1), entry)
    disk.flush()
    disk.delete(k(0))
    assert disk.take_changes() == [(k(1), True), (k(0), False)]
    # Another process adds a file; a rescan finds it and notes it.
    other = DiskTier(tmp_path, b"f" * 16, {}, 1 << 20)
    other.put(k(2), entry)
    other.flush()
    disk.rescan()
    assert disk.take_changes() == [(k(2), True)]
    assert sorted(disk.take_changes(everything=True)) == [(k(1), True), (k(2), True)]
    for tier in (disk, other):
        tier.close()


def test_disk_journal_reports_budget_evictions(tmp_path):
    entry = torch.ones(1000, dtype=torch.int8)
    disk = DiskTier(tmp_path, b"f" * 16, {}, 2500)
    disk.take_changes()
    for i in range(3):
        disk.put(k(i), entry)
        disk.flush()
    changes = disk.take_changes()
    assert (k(0), False) in changes and (k(2), True) in changes
    disk.close()


def test_a_stale_index_is_rescanned_in_the_background(tmp_path):
    entry = torch.ones(1000, dtype=torch.int8)
    disk = DiskTier(tmp_path, b"f" * 16, {}, 1 << 20, rescan_seconds=0.0)
    disk.take_changes()
    other = DiskTier(tmp_path, b"f" * 16, {}, 1 << 20)
    other.put(k(5), entry)
    other.flush()
    disk.rescan_if_stale()
    deadline = time.monotonic() + 10
    while (changes := disk.take_changes()) == [] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert changes == [(k(5), True)]
    for tier in (disk, other):
        tier.close()


def test_known_run_counts_the_keys_known_from_the_first():
    """`known_run` against `known_in` asked key by key, for CPU memory alone, the disk
    and a shared tier's hints, over seeded random placements."""
    seed = 2727
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(200):
        index = StoreIndex(1 << 30, disk=True)
        # Up to 120 keys with few unknown: runs that cross `first_found`'s blocks.
        keys = [group_key(rng.randbytes(16), 0) for _ in range(rng.randrange(0, 120))]
        disk, hinted = [], []
        for key in keys:
            place = rng.choices(("cpu", "disk", "redis", "none"), (30, 8, 8, 1))[0]
            if place == "cpu":
                index.admit(key, 8)
            elif place == "disk":
                disk.append((key, True))
            elif place == "redis":
                hinted.append(key)
        index.apply(0, WorkerReport(listed=True, disk=disk))
        index.hint("redis", hinted, time.monotonic() + 60)
        for tier in (None, "disk", "redis"):
            want = next((i for i, k in enumerate(keys) if not index.known_in(k, tier)), len(keys))
            assert index.known_run(keys, tier) == want
