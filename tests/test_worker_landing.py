"""Worker: stores whose bytes are still being copied out (a GPU side stream) reach the
tiers only once they have landed, serve loads meanwhile, and follow the orders given
while they were in flight; a finished request vLLM delayed is reported once its stores
have landed; a store whose block is handed to another request in flight holds the
compute stream back or is dropped; loads write at most `load_step_bytes` a step and are
reported only once every entry has landed in its blocks, failed ones once every copy
they queued has; promotions are reported a slice at a time.

On a CPU cache every store lands at once, so the GPU's pending state is made here by
holding the `Landing` the copy engine returns open (the one fault this file fakes: no
CPU copy can be still running)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest
import torch
from conftest import SEED

from hybridkv.core.copy_engine import Landing
from hybridkv.core.index import Orders
from hybridkv.core.layout import GroupKind, GroupSpec
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.store import TieredStore
from hybridkv.core.tiers.memory import MemoryTier
from hybridkv.vllm.metadata import (
    HybridKVMetadata,
    KeyedCopy,
    RequestLoad,
    RequestStore,
    TaggedCopy,
    TagName,
)
from hybridkv.vllm.worker_side import PROMOTE_SLICE_ENTRIES, TransferResults, WorkerSide

BLOCK_TOKENS, PAGE, BLOCKS = 16, 64, 8


class Held(Landing):
    """A copy still running until `land()`."""

    def __init__(self) -> None:
        super().__init__()
        self.landed = False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.landed = True

    def land(self) -> None:
        self.landed = True


@pytest.fixture
def worker(monkeypatch):
    group = GroupSpec(GroupKind.FULL, BLOCK_TOKENS, block_bytes=PAGE, layer_names=("l0",))
    planner = Planner([group])
    below = MemoryTier(1 << 20)
    below.name = "below"
    store = TieredStore([MemoryTier(1 << 20), below])
    ws = WorkerSide(planner, store)
    gen = torch.Generator().manual_seed(SEED)
    cache = torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=gen)
    ws.register({"l0": cache}, [[("l0", PAGE)]], BLOCKS)
    held: list[Held] = []
    gather_async = ws.copies.gather_async

    def slow_gather(copies):
        entries, _ = gather_async(copies)
        held.append(Held())
        return entries, held[-1]

    monkeypatch.setattr(ws.copies, "gather_async", slow_gather)
    return ws, cache, held


def store_meta(*keys_blocks: tuple[bytes, int], orders: Orders | None = None) -> HybridKVMetadata:
    copies = [KeyedCopy(k, EntryCopy(0, i, (0,), (b,))) for i, (k, b) in enumerate(keys_blocks)]
    return HybridKVMetadata(stores=[RequestStore("r", copies)], orders=orders or Orders())


def test_store_lands_only_when_its_copy_is_done_and_serves_loads_meanwhile(worker):
    ws, cache, held = worker
    ws.end_step(store_meta((b"a", 1)))
    assert not ws.store.cpu.contains(b"a"), "bytes still on their way reached a tier"
    # The next step loads the entry into block 5: it is read from the landing store.
    load = RequestLoad("q", [KeyedCopy(b"a", EntryCopy(0, 0, (0,), (5,)))])
    ws.begin_step(HybridKVMetadata(loads=[load]))
    assert ws.transfer_results().failed == set()
    assert torch.equal(cache[5], cache[1])
    held[0].land()
    ws.report()
    assert ws.store.cpu.contains(b"a") and ws.store.tiers[1].contains(b"a")
    assert ws.report().lost == []


def test_orders_given_while_landing_apply_when_it_lands(worker):
    ws, _, held = worker
    ws.end_step(store_meta((b"a", 1), (b"b", 2), (b"c", 3)))
    ws.end_step(HybridKVMetadata(orders=Orders(evict=[b"a"], delete=[b"b"])))
    held[0].land()
    ws.report()
    cpu, below = ws.store.tiers
    assert not cpu.contains(b"a") and below.contains(b"a")  # evicted: below CPU memory only
    assert not cpu.contains(b"b") and not below.contains(b"b")  # deleted everywhere
    assert cpu.contains(b"c") and below.contains(b"c")


def test_a_staged_state_stays_in_cpu_memory_until_its_request_finishes(worker):
    """A staged decode-time state goes into CPU memory only; `persist` (its request has
    finished) writes it below, also while its copy is still landing."""
    ws, _, held = worker
    staged = [
        KeyedCopy(b"s", EntryCopy(0, 0, (0,), (1,)), below=False),
        KeyedCopy(b"t", EntryCopy(0, 1, (0,), (2,)), below=False),
    ]
    ws.end_step(HybridKVMetadata(stores=[RequestStore("r", staged)]))
    ws.end_step(HybridKVMetadata(orders=Orders(persist=[b"s"])))  # finished while landing
    held[0].land()
    ws.report()
    cpu, below = ws.store.tiers
    assert cpu.contains(b"s") and below.contains(b"s")
    assert cpu.contains(b"t") and not below.contains(b"t")
    ws.end_step(HybridKVMetadata(orders=Orders(persist=[b"t"])))
    assert cpu.contains(b"t") and below.contains(b"t")


def test_clear_drops_stores_in_flight_but_holds_their_memory_until_they_land(worker):
    ws, _, held = worker
    ws.end_step(store_meta((b"a", 1)))
    entry = ws._landing[0].hold[0]
    ws.begin_step(HybridKVMetadata(epoch=1, orders=Orders(clear=True)))
    assert ws._landing and ws._landing[0].hold[0] is entry  # the copy may still write it
    held[0].land()
    ws.report()
    assert not ws._landing
    assert not any(t.contains(b"a") for t in ws.store.tiers)


def test_tagged_entry_named_before_its_copy_lands_waits_for_it(worker):
    ws, _, held = worker
    meta = HybridKVMetadata(
        stores=[RequestStore("r", [], [TaggedCopy(7, EntryCopy(0, 0, (0,), (4,)))])]
    )
    ws.end_step(meta)
    ws.begin_step(HybridKVMetadata(stores=[RequestStore("r", [], named=[TagName(7, b"t")])]))
    assert not ws.store.cpu.contains(b"t")
    held[0].land()
    ws.report()
    assert ws.store.cpu.contains(b"t") and ws.staged_entries == 0


def test_stores_land_in_order(worker):
    ws, _, held = worker
    ws.end_step(store_meta((b"a", 1)))
    ws.end_step(store_meta((b"b", 2)))
    held[1].land()  # the later copy is done first: it waits for the earlier one
    ws.report()
    assert not ws.store.cpu.contains(b"b")
    held[0].land()
    ws.report()
    assert ws.store.cpu.contains(b"a") and ws.store.cpu.contains(b"b")


def test_a_failed_copy_drops_its_stores_once_and_reports_them_lost(worker):
    ws, _, held = worker
    ws.end_step(store_meta((b"a", 1)))

    def broken() -> None:
        raise RuntimeError("device error")

    held[0].wait = broken
    held[0].land()
    report = ws.report()
    assert report.lost == [b"a"] and not ws._landing
    assert not ws.store.cpu.contains(b"a") and ws.stats.failed_stores == 1
    ws.end_step(store_meta((b"b", 2)))
    held[1].land()
    ws.report()
    assert ws.store.cpu.contains(b"b")  # later stores land as before


def put_entries(ws, cache, keys_blocks: list[tuple[bytes, int]]) -> None:
    """Store block `b` of the cache under each key (landed at once)."""
    for key, b in keys_blocks:
        ws.store.cpu.put(key, cache[b].clone().reshape(-1))


def load_meta(req_id: str, keys_blocks: list[tuple[bytes, int]]) -> HybridKVMetadata:
    copies = [KeyedCopy(k, EntryCopy(0, i, (0,), (b,))) for i, (k, b) in enumerate(keys_blocks)]
    return HybridKVMetadata(loads=[RequestLoad(req_id, copies)])


def test_loads_spread_over_steps_within_the_budget_oldest_first(worker):
    ws, cache, _ = worker
    ws.load_step_bytes = 2 * PAGE  # two one-block entries a step
    put_entries(ws, cache, [(b"a", 0), (b"b", 1), (b"c", 2), (b"d", 3)])
    expect = cache[:4].clone()
    cache[4:].zero_()
    ws.begin_step(load_meta("p", [(b"a", 4), (b"b", 5), (b"c", 6)]))
    assert ws.transfer_results().received == set()
    assert torch.equal(cache[4:6], expect[:2]) and not cache[6].any()
    # The entries the load holds stay readable after the tier lets them go.
    ws.store.cpu.clear()
    ws.begin_step(load_meta("q", [(b"d", 7)]))  # queued behind p; the tier lost d already
    done = ws.transfer_results()
    assert done.failed == {"q"} and done.received == {"q", "p"}
    assert torch.equal(cache[6], expect[2])
    assert ws.stats.loads == 1 and ws.stats.loaded_blocks == 3


def test_a_load_bigger_than_the_budget_still_moves_an_entry_a_step(worker):
    ws, cache, _ = worker
    ws.load_step_bytes = 1
    put_entries(ws, cache, [(b"a", 0), (b"b", 1)])
    ws.begin_step(load_meta("p", [(b"a", 4), (b"b", 5)]))
    assert ws.transfer_results().received == set()
    ws.begin_step(HybridKVMetadata(idle=True))
    assert ws.transfer_results().received == {"p"}
    assert torch.equal(cache[4:6], cache[0:2])


def loads_land_with(ws, monkeypatch, landing: Landing) -> None:
    """Loads write their blocks at once (CPU) but say they land when `landing` does."""
    scatter = ws.copies.scatter

    def scatter_until(loads, after=()):
        scatter(loads, after)
        return landing

    monkeypatch.setattr(ws.copies, "scatter", scatter_until)


def test_a_load_is_reported_only_once_its_copy_has_landed(worker, monkeypatch):
    ws, cache, _ = worker
    put_entries(ws, cache, [(b"a", 0)])
    copy_held = Held()
    loads_land_with(ws, monkeypatch, copy_held)
    ws.begin_step(load_meta("p", [(b"a", 4)]))
    assert ws.transfer_results().received == set(), "vLLM would read blocks still being written"
    copy_held.land()
    assert ws.transfer_results().received == {"p"}


def test_a_failed_load_copy_fails_every_request_it_touched_and_later_ones_load(worker, monkeypatch):
    ws, cache, _ = worker
    ws.load_step_bytes = 2 * PAGE
    put_entries(ws, cache, [(b"a", 0), (b"b", 1), (b"c", 2)])
    scatter = ws.copies.scatter
    calls = []

    def flaky_scatter(loads, after=()):
        calls.append(len(loads))
        if len(calls) == 1:
            raise RuntimeError("device error")
        return scatter(loads, after)

    monkeypatch.setattr(ws.copies, "scatter", flaky_scatter)
    meta = load_meta("p", [(b"a", 4)])
    meta.loads += load_meta("q", [(b"b", 5), (b"c", 6)]).loads
    ws.begin_step(meta)  # p and q's first entry: the copy fails, both are recomputed
    done = ws.transfer_results()
    assert done.failed == {"p", "q"} and done.received == {"p", "q"}
    ws.begin_step(load_meta("r", [(b"c", 6)]))  # nothing of q is left to write
    assert ws.transfer_results() == TransferResults({"r"}, set()) and calls == [2, 1]


def test_a_load_whose_copy_cannot_say_it_landed_fails_instead_of_waiting(worker, monkeypatch):
    ws, cache, _ = worker
    put_entries(ws, cache, [(b"a", 0)])
    broken = Held()

    def device_error() -> bool:
        raise RuntimeError("device error")

    broken.done = device_error
    loads_land_with(ws, monkeypatch, broken)
    ws.begin_step(load_meta("p", [(b"a", 4)]))
    assert ws.transfer_results() == TransferResults({"p"}, {"p"})
    assert ws.restoring == 0 and ws.transfer_results() == TransferResults(set(), set())


def test_a_load_with_a_bad_plan_fails_alone(worker):
    ws, cache, _ = worker
    ws.load_step_bytes = PAGE  # p's second entry waits for the next step
    put_entries(ws, cache, [(b"a", 0), (b"b", 1)])
    ws.begin_step(load_meta("p", [(b"a", 4), (b"b", 5)]))
    assert ws.transfer_results().received == set()
    bad = KeyedCopy(b"a", EntryCopy(7, 0, (0,), (6,)))  # no group 7
    ws.begin_step(HybridKVMetadata(loads=[RequestLoad("q", [bad])]))
    assert ws.transfer_results() == TransferResults({"p", "q"}, {"q"})
    assert torch.equal(cache[4:6], cache[0:2]) and ws.restoring == 0


def hold_second_slice(monkeypatch, tier, gate: threading.Event) -> list[int]:
    """Let `tier`'s real reads run, but hold the second slice a promotion reads until
    `gate` is set; the sizes of the slices read, as they start."""
    slices: list[int] = []
    get_many = tier.get_many

    def paced(ks):
        slices.append(len(ks))
        if len(slices) == 2:
            assert gate.wait(10)
        return get_many(ks)

    monkeypatch.setattr(tier, "get_many", paced)
    return slices


def test_a_promotion_is_reported_a_slice_at_a_time(worker, monkeypatch):
    """The first slice's entries reach the index (and can be loaded) while the next
    slice is still being read."""
    ws, _, _ = worker
    below = ws.store.tier("below")
    keys = [b"p%03d" % i for i in range(PROMOTE_SLICE_ENTRIES + 5)]
    for k in keys:
        below.put(k, torch.full((PAGE,), len(k), dtype=torch.int8))
    first_seen = threading.Event()
    slices = hold_second_slice(monkeypatch, below, first_seen)
    ws.begin_step(HybridKVMetadata(orders=Orders(promote=[(k, "below") for k in keys])))

    def promoted(n: int) -> list[tuple[bytes, bool]]:
        got: list[tuple[bytes, bool]] = []
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            got += [(k, ok) for _, k, ok in ws.report().promoted]
            time.sleep(0.001)
        return got

    first = promoted(PROMOTE_SLICE_ENTRIES)
    assert first == [(k, True) for k in keys[:PROMOTE_SLICE_ENTRIES]]
    assert slices == [PROMOTE_SLICE_ENTRIES, 5]  # the second is being read, paused
    assert ws.store.cpu.get(keys[0]) is not None
    first_seen.set()
    assert promoted(5) == [(k, True) for k in keys[PROMOTE_SLICE_ENTRIES:]]


def test_a_promotion_stops_reading_after_a_clear(worker, monkeypatch):
    """The slices left when the index's epoch moves on are never read: it has forgotten
    those promotions. They count as failed, like the slice read under the old epoch."""
    ws, _, _ = worker
    below = ws.store.tier("below")
    keys = [b"q%03d" % i for i in range(2 * PROMOTE_SLICE_ENTRIES + 5)]
    for k in keys:
        below.put(k, torch.full((PAGE,), 3, dtype=torch.int8))
    cleared = threading.Event()
    slices = hold_second_slice(monkeypatch, below, cleared)
    ws.begin_step(HybridKVMetadata(orders=Orders(promote=[(k, "below") for k in keys])))
    deadline = time.monotonic() + 10
    while len(slices) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    ws.begin_step(HybridKVMetadata(epoch=1))
    cleared.set()
    wait(ws._promotions, timeout=10)
    assert slices == [PROMOTE_SLICE_ENTRIES, PROMOTE_SLICE_ENTRIES]
    assert ws.stats.promoted_entries == PROMOTE_SLICE_ENTRIES
    assert ws.stats.failed_promotions == PROMOTE_SLICE_ENTRIES + 5


def test_a_delayed_request_is_reported_once_its_stores_have_landed_and_only_then(worker):
    """Only the requests the scheduler side delayed are reported (vLLM asserts on any
    other), each once: one whose stores are in flight when it is named waits for them,
    one with none in flight goes at once."""
    ws, _, held = worker
    ws.end_step(store_meta((b"a", 1)))  # request "r"
    ws.begin_step(HybridKVMetadata(delayed=["r", "idle"]))
    assert ws.transfer_results({"r", "idle", "not-delayed"}).sending == {"idle"}
    assert ws.transfer_results().sending == set()
    held[0].land()
    assert ws.transfer_results().sending == {"r"}
    assert ws.transfer_results().sending == set() and ws.sending.held == 0


def test_tags_never_named_are_released_when_their_request_ends(worker):
    """At the start of the step whose `finished` names the request (after its names)."""
    ws, _, held = worker
    tagged = [TaggedCopy(7, EntryCopy(0, 0, (0,), (4,)))]
    ws.end_step(HybridKVMetadata(stores=[RequestStore("r", [], tagged)]))
    held[0].land()
    ws.report()
    ws.begin_step(HybridKVMetadata(finished=["other"]))
    assert ws.staged_entries == 1
    ws.begin_step(HybridKVMetadata(finished=["r"]))
    assert ws.staged_entries == 0


def test_a_request_id_reused_in_the_step_after_its_end_keeps_the_new_requests_tags(worker):
    """vLLM allows a finished request's id again (with its id randomization off): the
    step that reports the old one finished may carry the new one's stores, and the end
    of the old one must not take them (`transfer_results` used to, at the step's end:
    the new request's tagged entries were dropped, its stores lost)."""
    ws, _, held = worker
    old = [TaggedCopy(7, EntryCopy(0, 0, (0,), (4,)))]
    ws.end_step(HybridKVMetadata(stores=[RequestStore("r", [], old)]))
    held[0].land()
    ws.report()
    ws.begin_step(HybridKVMetadata(finished=["r"]))
    assert ws.staged_entries == 0
    new = [TaggedCopy(8, EntryCopy(0, 0, (1,), (5,)))]
    ws.end_step(HybridKVMetadata(stores=[RequestStore("r", [], new)]))
    held[-1].land()
    ws.transfer_results({"r"})  # vLLM's finished ids of this same step
    assert ws.staged_entries == 1


def test_a_store_whose_block_is_handed_over_holds_the_compute_stream_behind_it(worker):
    """Model Runner V1: `handle_preemptions` comes before the step writes the blocks it
    hands over, so the engine's work waits for the store there (on a CPU cache the
    thread waits: the held copy lands); a store reading other blocks is not waited for."""
    ws, _, held = worker
    ws.end_step(store_meta((b"a", 1)))
    ws.end_step(store_meta((b"b", 2)))
    ws.guard(HybridKVMetadata(allocated_blocks=[1, 6]))
    assert held[0].landed and not held[1].landed
    assert ws.stats.held_compute == 1 and ws.stats.overtaken_entries == 0
    held[1].land()
    ws.report()
    assert ws.store.cpu.contains(b"a") and ws.store.cpu.contains(b"b")


def test_a_store_overtaken_by_the_new_owner_of_its_block_is_dropped_with_a_load_reading_it(
    worker, monkeypatch
):
    """Model Runner V2 calls `handle_preemptions` after its zeroing and state pre-copy:
    a store still copying a block handed over may have read the new owner's bytes. Its
    entry is never stored (the index learns it is lost) and a load that read it fails,
    reported once its own copy has landed."""
    ws, _, held = worker
    ws.hook_before_reuse = False
    ws.end_step(store_meta((b"a", 1), (b"b", 2)))
    load_held = Held()
    scatter = ws.copies.scatter

    def queued_behind_the_store(loads, after=()):
        """On a GPU the load waits for the store on its stream; neither has run yet."""
        scatter(loads)
        return load_held

    monkeypatch.setattr(ws.copies, "scatter", queued_behind_the_store)
    ws.begin_step(load_meta("q", [(b"a", 5)]))
    ws.guard(HybridKVMetadata(allocated_blocks=[1]))
    assert not held[0].landed and ws.stats.overtaken_entries == 1
    assert ws.transfer_results() == TransferResults(set(), set())
    load_held.land()
    assert ws.transfer_results() == TransferResults({"q"}, {"q"})
    held[0].land()
    report = ws.report()
    assert not ws.store.cpu.contains(b"a") and ws.store.cpu.contains(b"b")
    assert report.lost == [b"a"]


def test_a_block_going_to_another_connectors_load_drops_the_store_even_under_v1(worker):
    """Another connector (MultiConnector) may write by RDMA, which no wait on a stream
    orders."""
    ws, _, held = worker
    ws.end_step(store_meta((b"a", 1)))
    ws.guard(HybridKVMetadata(foreign_blocks=[1]))
    held[0].land()
    ws.report()
    assert not ws.store.cpu.contains(b"a") and ws.stats.overtaken_entries == 1


def test_a_failed_load_is_reported_only_once_the_copies_it_queued_have_landed(worker, monkeypatch):
    """vLLM frees a failed load's blocks as soon as it is reported (recompute), and
    hands them on; a copy of the load still running would then write them."""
    ws, cache, _ = worker
    ws.load_step_bytes = PAGE  # one entry a step
    put_entries(ws, cache, [(b"a", 0), (b"b", 1)])
    first = Held()
    scatter = ws.copies.scatter
    calls: list[int] = []

    def scatter_then_fault(loads, after=()):
        calls.append(len(loads))
        if len(calls) == 2:
            raise RuntimeError("device error")
        scatter(loads, after)
        return first

    monkeypatch.setattr(ws.copies, "scatter", scatter_then_fault)
    ws.begin_step(load_meta("p", [(b"a", 4), (b"b", 5)]))  # a's copy queued, in flight
    assert ws.transfer_results() == TransferResults(set(), set())
    ws.begin_step(HybridKVMetadata(idle=True))  # b's copy raises: p has failed
    assert ws.transfer_results() == TransferResults(set(), set()), "reported with a copy running"
    first.land()
    assert ws.transfer_results() == TransferResults({"p"}, {"p"}) and ws.restoring == 0


def test_the_newest_step_whose_stores_have_all_landed_is_reported(worker):
    """What the scheduler side delays finished requests by: a step counts once every
    store of it and of the steps before has landed."""
    ws, _, held = worker
    for step, block in ((1, 1), (2, 2), (3, 3)):
        meta = store_meta((b"k%d" % step, block))
        meta.step = step
        ws.begin_step(meta)
        ws.end_step(meta)
    assert ws.landed_through() == 0
    held[1].land()  # step 2's copy is done, step 1's not: neither counts yet
    ws.report()
    assert ws.landed_through() == 0
    held[0].land()
    ws.report()
    assert ws.landed_through() == 2
    held[2].land()
    ws.report()
    assert ws.landed_through() == 3


def test_a_step_reported_before_its_stores_are_queued_has_not_landed(worker):
    """With speculative decoding vLLM builds a step's worker report before it calls
    `wait_for_save` (its `defer_finalize`): that step's stores are not even queued, so
    a request they read must still be delayed."""
    ws, _, held = worker
    meta = store_meta((b"k1", 1))
    meta.step = 1
    ws.begin_step(meta)
    ws.end_step(meta)
    held[0].land()
    ws.report()
    assert ws.landed_through() == 1
    meta = store_meta((b"k2", 2))
    meta.step = 2
    ws.begin_step(meta)
    assert ws.landed_through() == 1  # reported here, before step 2's stores exist
    ws.end_step(meta)
    assert ws.landed_through() == 1  # queued, not landed
    held[1].land()
    ws.report()
    assert ws.landed_through() == 2


def _promotion_failed_on_another_rank():
    """Tensor parallelism, two ranks: a promotion whose read on rank 1 failed, so the
    index dropped the entry and ordered every rank to evict it, while rank 0's read is
    held (by an event, not by timing) until the test opens `gate`."""
    import threading
    import time

    from hybridkv.core.index import StoreIndex, WorkerReport

    key = b"k" * 18
    index = StoreIndex(1 << 20, ranks=2, disk=False)
    index.hint("below", [key], time.monotonic() + 60)
    assert index.promote(key, PAGE, "below")
    orders = index.take_orders()
    group = GroupSpec(GroupKind.FULL, BLOCK_TOKENS, block_bytes=PAGE, layer_names=("l0",))
    below = MemoryTier(1 << 20)
    below.name = "below"
    ws = WorkerSide(Planner([group]), TieredStore([MemoryTier(1 << 20), below]))
    ws.register({"l0": torch.zeros((BLOCKS, PAGE), dtype=torch.int8)}, [[("l0", PAGE)]], BLOCKS)
    below.put(key, torch.full((PAGE,), 7, dtype=torch.int8))
    gate = threading.Event()
    get_many = below.get_many

    def slow(keys):
        assert gate.wait(30)
        return get_many(keys)

    below.get_many = slow
    ws.begin_step(HybridKVMetadata(step=1, epoch=index.epoch, orders=orders))
    ws.end_step(HybridKVMetadata(step=1, epoch=index.epoch))
    index.apply(1, WorkerReport(epoch=index.epoch, promoted=[(index.epoch, key, False)]))
    evict = index.take_orders()
    assert evict.evict == [key]
    ws.begin_step(HybridKVMetadata(step=2, epoch=index.epoch, orders=evict))
    ws.end_step(HybridKVMetadata(step=2, epoch=index.epoch, orders=evict))
    return index, ws, gate, key


def test_a_promotion_read_after_its_evict_order_is_dropped():
    """Rank 0's read lands after the evict order: it must not put into CPU memory what
    the index no longer counts (over the budget, with nothing to reconcile it)."""
    from concurrent.futures import wait

    index, ws, gate, key = _promotion_failed_on_another_rank()
    gate.set()
    wait(ws._promotions, timeout=30)
    index.apply(0, ws.report())
    assert ws.store.cpu.get(key) is None
    assert not index.in_cpu(key) and not index.promoting(key) and index.ledger.used == 0


def test_a_read_whose_promotion_was_settled_fails_no_later_promotion_of_its_key():
    """The index promotes the key again (a probe found it) while rank 0's first read is
    still held. The index matches reports by key: the read that lands first serves the
    new promotion (the same bytes), and the one left over reports nothing; a failure
    reported for it failed the new promotion, and the entry was dropped again."""
    import time
    from concurrent.futures import wait

    from hybridkv.core.index import WorkerReport

    index, ws, gate, key = _promotion_failed_on_another_rank()
    index.hint("below", [key], time.monotonic() + 60)
    assert index.promote(key, PAGE, "below")
    again = index.take_orders()
    ws.begin_step(HybridKVMetadata(step=3, epoch=index.epoch, orders=again))
    ws.end_step(HybridKVMetadata(step=3, epoch=index.epoch))
    gate.set()
    wait(ws._promotions, timeout=30)
    report = ws.report()
    assert [ok for _, _, ok in report.promoted] == [True]
    index.apply(0, report)
    index.apply(1, WorkerReport(epoch=index.epoch, promoted=[(index.epoch, key, True)]))
    assert index.in_cpu(key) and ws.store.cpu.get(key) is not None


def test_close_stops_promoting_and_drains_the_disk_writes(tmp_path):
    """At shutdown the promotions still queued are not read (they serve nothing, and
    vLLM's executor gives a worker seconds before it kills it); the disk write queued
    behind them lands."""
    import threading
    import time

    from hybridkv.core.keys import group_key
    from hybridkv.core.tiers.disk import DiskTier

    page = 4096
    group = GroupSpec(GroupKind.FULL, BLOCK_TOKENS, block_bytes=page, layer_names=("l0",))
    disk = DiskTier(tmp_path, b"f" * 16, {}, 1 << 30, entry_bytes=[page])
    slow = MemoryTier(1 << 30)
    slow.name = "slow"
    keys = [group_key(b"%016d" % i, 0) for i in range(PROMOTE_SLICE_ENTRIES * 8)]
    for k in keys:
        slow.put(k, torch.ones(page, dtype=torch.int8))
    started, gate, reads = threading.Event(), threading.Event(), []
    get_many = slow.get_many

    def held(ks):  # the first read waits for the gate (ordered by events, not timing)
        reads.append(len(ks))
        started.set()
        assert gate.wait(30)
        return get_many(ks)

    slow.get_many = held
    ws = WorkerSide(Planner([group]), TieredStore([MemoryTier(1 << 30), disk, slow]))
    n = PROMOTE_SLICE_ENTRIES
    for i in range(8):
        orders = Orders(promote=[(k, "slow") for k in keys[n * i : n * (i + 1)]])
        ws.begin_step(HybridKVMetadata(step=i, orders=orders))
    written = group_key(b"w" * 16, 0)
    assert disk.put(written, torch.ones(page, dtype=torch.int8))
    assert started.wait(30)
    closing = threading.Thread(target=ws.close)
    closing.start()
    deadline = time.monotonic() + 30  # until close has cancelled the orders queued
    while not all(f.cancelled() for f in ws._promotions[1:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    closing.join(30)
    assert not closing.is_alive() and len(reads) == 1  # the read under way, no other
    assert DiskTier(tmp_path, b"f" * 16, {}, 1 << 30, entry_bytes=[page]).contains(written)
