"""The copy engine's CUDA branch on a real GPU: side streams (one for stores, one for
loads), pinned host entries, the compute stream held behind a store only when asked.
Skipped where torch sees no CUDA device (CI); run on a lent GPU.

The fake cache is `test_canonical`'s (every group's layer j overlays one region, a state
page smaller than the block stride), built once on the CPU and once on the GPU from the
same bytes: whatever the CUDA branch does must leave both byte-identical.

Ordering is checked by making the compute stream busy (a chain of large matrix products)
before it writes: a side-stream copy that did not wait for it would read or be
overwritten by stale bytes.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_canonical import GROUPS, LAYERS, NB, PAGE, make_cache

from hybridkv.core import copy_engine
from hybridkv.core.canonical import build_canonical
from hybridkv.core.copy_engine import CopyEngine, Landing
from hybridkv.core.host_pool import HostPool
from hybridkv.core.planner import EntryCopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def _warm():
    """Launch every kernel the tests use once first: the first launch of a kernel loads
    its module, which can wait for the device and so drain the busy stream early."""
    if not torch.cuda.is_available():
        return
    _, gpu, _, engine = pair(0)
    for g in range(3):
        (entry,) = engine.gather([EntryCopy(g, 0, (0,), (1,))])
        engine.scatter([(EntryCopy(g, 0, (0,), (2,)), entry)])
    gpu.buf.fill_(5)
    gpu.buf.zero_()
    busy()
    torch.cuda.synchronize()


def busy() -> None:
    """Queue about half a second of work on the current stream (fp32 products of 8192^2
    matrices, ~20 ms each on an H100): far longer than the host takes to enqueue the
    copies under test."""
    a = torch.randn(8192, 8192, device="cuda")
    b = torch.empty_like(a)
    torch.cuda.synchronize()
    for _ in range(25):
        torch.mm(a, a, out=b)


def pair(seed: int):
    """The same fake cache on the CPU and on the GPU, with a copy engine for each."""
    cpu, gpu = make_cache(seed), make_cache(seed, device="cuda")
    kv_cpu = build_canonical(cpu.kv_caches, cpu.group_layers, NB)
    kv_gpu = build_canonical(gpu.kv_caches, gpu.group_layers, NB)
    return cpu, gpu, CopyEngine(kv_cpu), CopyEngine(kv_gpu, HostPool(pin=True))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_a_batch_moves_the_same_bytes_as_the_host_copy(data, seed):
    cpu, gpu, e_cpu, e_gpu = pair(seed)
    groups = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4), label="groups")
    stores = []
    for i, g in enumerate(groups):
        ids = data.draw(st.lists(st.integers(0, NB - 1), min_size=1, max_size=6, unique=True))
        stores.append(EntryCopy(g, i, tuple(range(len(ids))), tuple(ids)))
    got = e_gpu.gather(stores)
    want = e_cpu.gather(stores)
    for c, a, b in zip(stores, got, want, strict=True):
        assert a.is_pinned() and a.device.type == "cpu"
        assert a.numel() == len(c.block_ids) * LAYERS * PAGE[GROUPS[c.group]]
        assert torch.equal(a, b)
    # A step's loads write distinct blocks (a block id belongs to one request and group).
    free = data.draw(st.permutations(range(NB)), label="free blocks")
    loads = []
    for c, entry in zip(stores, want, strict=True):
        n = len(c.block_ids)
        slots = data.draw(st.permutations(range(n)).map(lambda p: p[: max(1, len(p) // 2)]))
        dst, free = free[: len(slots)], free[len(slots) :]
        loads.append((EntryCopy(c.group, c.chunk, tuple(slots), tuple(dst)), entry))
    e_cpu.scatter(loads)
    e_gpu.scatter([(c, e.pin_memory()) for c, e in loads])
    torch.cuda.synchronize()
    assert torch.equal(gpu.buf.cpu(), cpu.buf)


def test_a_store_sees_what_the_compute_stream_wrote_before_it():
    _, gpu, _, engine = pair(1)
    compute = torch.cuda.current_stream()
    busy()  # the side stream must wait this out
    gpu.buf.fill_(5)
    assert not compute.query(), "the compute stream finished too soon for the test to mean much"
    (entry,) = engine.gather([EntryCopy(0, 0, (0, 1, 2), (3, 7, 11))])
    assert bool((entry == 5).all())


def test_a_store_returns_before_it_lands_and_holds_the_compute_stream_only_when_asked():
    """A store blocks neither the host nor the engine's later work; where a block it
    reads is about to be reused, `hold_compute` queues the engine's later writes behind
    its copy."""
    _, gpu, _, engine = pair(6)
    compute = torch.cuda.current_stream()
    busy()
    gpu.buf.fill_(5)  # what the step's forward wrote, still queued behind the products
    (entry,), landing = engine.gather_async([EntryCopy(0, 0, (0, 1, 2), (3, 7, 11))])
    assert not landing.done(), "the store waited for the GPU before returning"
    engine.hold_compute(landing)
    gpu.buf.fill_(9)  # the next step reuses the blocks: queued after the store's copy
    assert not compute.query()
    landing.wait()
    assert landing.done()
    assert bool((entry == 5).all()), "a later write of the engine overtook the store's copy"
    torch.cuda.synchronize()
    assert bool((gpu.buf == 9).all())


def test_a_store_lands_while_a_load_queued_before_it_still_waits():
    """Loads and stores run on streams of their own: a store never queues behind a load
    (here one held back by the stores it reads from, `after`)."""
    _, _, reference, engine = pair(7)
    entry = engine.pool.empty(LAYERS * PAGE["full"])
    entry.fill_(3)
    elsewhere = torch.cuda.Stream()
    with torch.cuda.stream(elsewhere):
        busy()
        held_back = torch.cuda.Event()
        held_back.record(elsewhere)
    load = engine.scatter([(EntryCopy(0, 0, (0,), (10,)), entry)], after=[Landing(held_back)])
    (stored,), landing = engine.gather_async([EntryCopy(0, 0, (0,), (4,))])
    landing.wait()
    assert not load.done(), "the load ran before what it waits for"
    assert torch.equal(stored, reference.gather([EntryCopy(0, 0, (0,), (4,))])[0])
    torch.cuda.synchronize()
    assert load.done()


def test_a_load_lands_after_the_compute_stream_zeroes_and_before_it_reads():
    """vLLM zeroes a newly allocated block on the compute stream, then the connector
    loads into it, then (once the load is reported landed) the forward reads it: the
    load must land between the two."""
    _, gpu, _, engine = pair(2)
    ids = (2, 5, 9)
    entry = engine.pool.empty(len(ids) * LAYERS * PAGE["full"])
    entry.copy_(torch.randint(-128, 128, entry.shape, dtype=torch.int8))
    compute = torch.cuda.current_stream()
    busy()
    gpu.buf.zero_()  # vLLM's zeroing of new blocks, still queued behind the sleep
    landing = engine.scatter([(EntryCopy(0, 0, (0, 1, 2), ids), entry)])
    assert not compute.query(), "scatter blocked the host until the GPU was idle"
    assert not landing.done(), "a load reported landed while the GPU is still busy"
    landing.wait()  # the worker reports the load only now; vLLM's forward comes after
    seen = gpu.kv_caches["full.0"].view(torch.int8).reshape(NB, -1)[list(ids)].clone()  # forward
    torch.cuda.synchronize()
    expect = entry.view(LAYERS, len(ids), PAGE["full"])[0]
    assert torch.equal(seen.cpu(), expect)
    # Every other block stays zero: nothing but the load touched the cache after zeroing.
    others = [b for b in range(NB) if b not in ids]
    assert not gpu.kv_caches["full.1"].view(torch.int8).reshape(NB, -1)[others].any()


def test_a_loaded_entry_keeps_its_slot_until_the_transfer_ends():
    """The tier may drop an entry the moment it is handed to a load; its pinned slot must
    not be handed out (and written by a disk read) while the GPU still reads it."""
    _, gpu, _, engine = pair(3)
    nbytes = 4 * LAYERS * PAGE["full"]
    entries = [engine.pool.empty(nbytes) for _ in range(3)]
    for i, e in enumerate(entries):
        e.fill_(i + 1)
    ptrs = {e.data_ptr() for e in entries}
    loads = [
        (EntryCopy(0, i, (0, 1, 2, 3), tuple(range(4 * i, 4 * i + 4))), e)
        for i, e in enumerate(entries)
    ]
    busy()
    engine.scatter(loads)
    del loads, entries, e
    gc.collect()
    reused = [engine.pool.empty(nbytes) for _ in range(3)]
    assert not ptrs & {r.data_ptr() for r in reused}, "an in-flight entry's slot was reused"
    for r in reused:
        r.fill_(-1)  # what a disk read into a recycled slot would do
    torch.cuda.synchronize()
    for i in range(3):
        block = gpu.kv_caches["full.0"].view(torch.int8).reshape(NB, -1)[4 * i : 4 * i + 4]
        assert bool((block == i + 1).all())
    # Once the transfer is over, the next load call lets those slots go back to the pool.
    engine.scatter([])
    gc.collect()
    free = engine.pool.free_slots(nbytes)
    del reused, r
    gc.collect()
    assert engine.pool.free_slots(nbytes) == free + 3


def test_an_unpinned_entry_loads_too():
    cpu, gpu, e_cpu, e_gpu = pair(4)
    entry = torch.randint(-128, 128, (2 * LAYERS * PAGE["state"],), dtype=torch.int8)
    assert not entry.is_pinned()
    copy = EntryCopy(2, 0, (1, 0), (6, 8))
    e_gpu.scatter([(copy, entry)])
    e_cpu.scatter([(copy, entry)])
    torch.cuda.synchronize()
    assert torch.equal(gpu.buf.cpu(), cpu.buf)


def test_the_pinned_pool_gives_pinned_distinct_slots():
    pool = HostPool(pin=True, slab_bytes=1 << 16)
    entries = [pool.empty(3000) for _ in range(30)]
    assert all(e.is_pinned() for e in entries)
    assert len({e.data_ptr() for e in entries}) == 30
    # Slabs of 8 then 16 entries, each rounded up to a power of two and filled.
    assert pool.slab_count == 2 and pool.reserved_bytes == (32 << 10) + (64 << 10)


def test_out_of_range_ids_are_refused_on_the_host_and_the_gpu_stays_usable():
    """A bad plan must not reach the GPU: a kernel that wrote out of bounds would fault and
    poison the CUDA context, and every later step of the engine with it."""
    _, gpu, _, engine = pair(5)
    before = gpu.buf.clone()
    good = engine.gather([EntryCopy(0, 0, (0, 1), (1, 2))])[0]
    with pytest.raises(IndexError):
        engine.gather([EntryCopy(0, 0, (0, 1), (1, 2)), EntryCopy(1, 1, (0,), (NB,))])
    for slots, ids in (((0, 1), (3, NB)), ((0, 1), (-1, 3)), ((0, 2), (3, 4))):
        with pytest.raises(IndexError):
            bad = EntryCopy(0, 1, slots, ids)
            engine.scatter([(EntryCopy(0, 0, (0, 1), (5, 6)), good), (bad, good)])
    with pytest.raises(ValueError):
        engine.scatter([(EntryCopy(0, 0, (0,), (5,)), good[:-1])])
    torch.cuda.synchronize()  # raises if a device assert fired
    assert torch.equal(gpu.buf, before)


def test_a_batch_cut_into_many_launches_moves_the_same_bytes(monkeypatch):
    """One kernel a copy (`LAUNCH_BYTES` below any copy): the GPU runs the first while
    the host builds the next tables, and every byte still lands as on the host."""
    monkeypatch.setattr(copy_engine, "LAUNCH_BYTES", 1)
    cpu, gpu, e_cpu, e_gpu = pair(7)
    stores = [EntryCopy(g, g, (0, 1), (g + 1, g + 4)) for g in (0, 1, 2, 0)]
    got, want = e_gpu.gather(stores), e_cpu.gather(stores)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    loads = [
        (EntryCopy(c.group, c.chunk, (1, 0), (8 + i, 3 + 4 * i)), e)
        for i, (c, e) in enumerate(zip(stores[:2], want, strict=False))
    ]
    e_cpu.scatter(loads)
    e_gpu.scatter([(c, e.pin_memory()) for c, e in loads]).wait()
    assert torch.equal(gpu.buf.cpu(), cpu.buf)


def test_a_refused_copy_after_launched_ones_returns_once_they_have_run(monkeypatch):
    """The table of a later launch fails its checks: the call raises only after the
    launches before it have run, so the caller may drop their entries at once."""
    monkeypatch.setattr(copy_engine, "LAUNCH_BYTES", 1)
    _, gpu, _, engine = pair(8)
    good = engine.gather([EntryCopy(0, 0, (0, 1), (1, 2))])[0]
    busy()  # the launched copy waits for this, so it has not run when the check fails
    with pytest.raises(IndexError):
        engine.scatter(
            [(EntryCopy(0, 0, (0, 1), (5, 6)), good), (EntryCopy(0, 1, (0,), (NB,)), good)]
        )
    assert engine._loads.query()
    torch.cuda.synchronize()
