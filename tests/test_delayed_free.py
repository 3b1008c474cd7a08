"""Blocks a store still reads stay intact, by vLLM's own contract, driven through vLLM's
real `Scheduler` / `AsyncScheduler` without a model (test_async_scheduling's `Engine`).

On a GPU a store's copy lands after its step, and a load's after the step that queued
it. On a CPU cache every copy lands at once, so here the copy engine's copies are held
in flight (tests/slow_copies.py: each runs only when it lands, which the test decides or
hybridkv waits for). A block vLLM rewrote before the copy ran then shows in the bytes:
every stored entry is checked against the tokens its key names, every restored block
before the forward reads it.

- A request that finishes (or is aborted) while its stores are in flight keeps its
  blocks (vLLM's delayed free: `request_finished_all_groups` returns True) until every
  rank reports it in `finished_sending`, which it does once they have landed.
- Blocks vLLM frees while their request runs (a preempted request's, superseded states)
  and hands on while a store still reads them: Model Runner V1's order holds the compute
  stream behind the store; V2's drops what the store read.
- A load that fails with a copy still in flight is reported only once it has landed:
  vLLM frees a failed load's blocks as soon as it is reported. A request aborted while
  its load is in flight is left to vLLM's own wait for the load (never also delayed).
"""

from __future__ import annotations

import pytest
from conftest import SEED
from slow_copies import SlowCopies
from test_async_scheduling import ATTN_PAGE, MODES, C, Engine, _prompt, config_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return config_dir(tmp_path_factory)


def held_blocks(eng: Engine, req_id: str) -> list[int]:
    """The blocks vLLM still holds for a request (none once it is gone)."""
    if req_id not in eng.sched.requests:
        return []
    blocks = eng.sched.kv_cache_manager.get_blocks(req_id).blocks
    return [b.block_id for group in blocks for b in group if not b.is_null and b.ref_cnt > 0]


def finish(eng: Engine, abort: bool) -> None:
    """Run request "a" until it finishes: its last token, or an abort just after a
    boundary's step was scheduled (stores in its last step either way)."""
    from vllm.v1.request import RequestStatus

    a = eng.add("a", _prompt(40, 31), max_tokens=25)
    if abort:
        eng.interrupts = [
            (
                lambda: a.num_computed_tokens >= 48,
                lambda: eng.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED),
            )
        ]
    eng.run(until=a.is_finished)


@pytest.mark.parametrize("abort", [False, True], ids=["finished", "aborted"])
@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_finished_request_keeps_its_blocks_until_its_stores_land(
    model_dir, async_scheduling, abort
):
    """The request finishes (its last token, or an abort just after a boundary's step
    was scheduled) with stores in flight: vLLM keeps it and its blocks through any
    number of steps, until the copies land; then the workers report it once (vLLM
    asserts on a second report) and vLLM frees the blocks. Nothing needed a wait on the
    compute stream or a dropped store."""
    eng = Engine(model_dir, async_scheduling, seed=5)
    sched = eng.sched
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps)
    finish(eng, abort)
    assert slow.in_flight() > 0
    for _ in range(4):
        eng.step()
    assert "a" in sched.requests and held_blocks(eng, "a"), "freed with its stores in flight"
    slow.land()
    eng.run()
    assert "a" not in sched.requests
    assert eng.worker.stats.held_compute == 0 and eng.worker.stats.overtaken_entries == 0
    eng.check_entries()
    eng.check_settled()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_running_request_waits_for_blocks_held_for_stores_instead_of_being_preempted(
    model_dir, async_scheduling
):
    """A finished request's blocks are held for its stores in flight when a running one
    needs a block and the pool has none free. vLLM asks the connector
    (`has_pending_block_frees`) before it preempts: those blocks come back within a step
    or two, so the running request waits for them rather than being preempted (its whole
    context computed again: what happened here before hybridkv answered). Once the
    copies land it gets its block and runs on."""
    from vllm.v1.request import RequestStatus

    from hybridkv.vllm.scheduler_side import FREE_WAIT_STEPS

    eng = Engine(model_dir, async_scheduling, seed=5)
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps)
    b = eng.add("b", _prompt(22, 32), max_tokens=200)
    finish(eng, abort=False)
    assert held_blocks(eng, "a") and slow.in_flight() > 0
    pool = eng.sched.kv_cache_manager.block_pool
    others = pool.get_new_blocks(pool.get_num_free_blocks())  # the pool's other users
    asked = []
    pending = eng.sched.connector.has_pending_block_frees
    eng.sched.connector.has_pending_block_frees = lambda: asked.append(pending()) or asked[-1]
    computed = b.num_computed_tokens
    for _ in range(FREE_WAIT_STEPS // 2):  # b is a token or two short of a new block
        eng.step()
    assert True in asked, "b never needed a block"
    assert b.num_preemptions == 0 and b.status == RequestStatus.RUNNING
    assert b.num_computed_tokens - computed < C, "b ran past a block it did not get"
    slow.land()
    eng.copies_land = lambda step: slow.land()
    eng.run(until=lambda: b.num_computed_tokens >= computed + 2 * C)
    assert b.num_preemptions == 0 and "a" not in eng.sched.requests
    pool.free_blocks(others)
    eng.run()
    eng.check_entries()
    eng.check_settled()


def test_a_hold_never_reported_stops_counting_as_frees_to_come(model_dir):
    """A delayed request whose report never comes (a lost report) counts as frees to
    come for `FREE_WAIT_STEPS` steps, then no more: vLLM preempts as without a connector."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from hybridkv.vllm.scheduler_side import FREE_WAIT_STEPS

    eng = Engine(model_dir, False, seed=5)
    side = eng.side
    req = Request("x", _prompt(20, 33), SamplingParams(max_tokens=4), None)
    side._state(req).stored_at = (0, side._step + 1)  # a store not landed yet
    assert side.request_finished(req) and side.frees_pending()
    for _ in range(FREE_WAIT_STEPS):
        eng.sched.schedule()  # builds the step's metadata
        assert side.frees_pending()
    eng.sched.schedule()
    assert not side.frees_pending() and not side._freeing


@pytest.mark.parametrize("abort", [False, True], ids=["finished", "aborted"])
def test_on_a_cpu_cache_a_finished_request_frees_its_blocks_at_once(model_dir, abort):
    """A CPU cache without async scheduling: every store lands within its step (the
    connector sees it from vLLM's config), so a request that finishes, or is aborted,
    with stores in its last step gives its blocks back in that step, as with no
    connector: held a step longer, they would make vLLM's prefix cache evict other
    blocks in their place. What it stored arrives intact."""
    # Under async scheduling a step is scheduled before the last one's stores land.
    assert not Engine(model_dir, True, copies_in_flight=False).side.stores_land_in_step
    eng = Engine(model_dir, False, seed=5, copies_in_flight=False)
    assert eng.side.stores_land_in_step
    sched = eng.sched
    finish(eng, abort)
    assert "a" not in sched.requests and not held_blocks(eng, "a")
    assert eng.side.index.gauges()["cpu_entries"] > 0
    eng.run()
    eng.check_entries()
    eng.check_settled()


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("async_scheduling", MODES)
def test_blocks_handed_on_while_a_store_reads_them_never_reach_an_entry(
    model_dir, async_scheduling, runner
):
    """A pool too small for the requests in flight: vLLM preempts, frees superseded
    states and hands the blocks to others at once, while stores still read them (each
    copy lands three steps after the step that queued it). V1's order holds the compute
    stream behind such a store before the step's zeroing and forward, so every store
    arrives; V2 zeroes before the first hook, so what such a store read is dropped.
    Either way every entry stored holds exactly the bytes of its key's tokens."""
    eng = Engine(model_dir, async_scheduling, seed=9, runner=runner, num_blocks=40)
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps)
    eng.copies_land = lambda step: slow.land(queued_before=step - 2)
    reqs = [eng.add(f"r{i}", _prompt(40 + 7 * i, 40 + i), max_tokens=30) for i in range(5)]
    eng.run(limit=800)
    assert sum(r.num_preemptions for r in reqs) > 0
    eng.check_entries()
    eng.check_settled(lossy=runner == "v2")
    stats = eng.worker.stats
    if runner == "v1":
        assert stats.held_compute > 0 and stats.overtaken_entries == 0
    else:
        assert stats.overtaken_entries > 0


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_fault_listing_the_blocks_handed_over_reaches_no_scheduler(
    model_dir, monkeypatch, runner
):
    """A fault while a step's metadata is built (injected in every third listing of the
    blocks handed over; no input makes the real one fail) used to raise out of vLLM's
    `schedule()` and kill the engine. Now the step's loads still go out and the workers
    take every block for handed over: with copies landing two steps late, the stores
    in flight then hold the compute stream (V1's hook order) or are dropped (V2's),
    and no entry holds a reused block's bytes."""
    from hybridkv.vllm.handover import Handover

    take = Handover.take
    calls = 0

    def failing(self, out):
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise RuntimeError("injected handover fault")
        return take(self, out)

    print(f"seed {SEED}")
    eng = Engine(model_dir, False, seed=SEED, runner=runner)
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps)
    eng.copies_land = lambda step: slow.land(queued_before=step - 2)
    monkeypatch.setattr(Handover, "take", failing)
    for i in range(3):
        eng.add(f"r{i}", _prompt(40 + 9 * i, SEED + i), max_tokens=25)
    eng.run()
    assert eng.side.stats.hook_errors == calls // 3 > 0
    stats = eng.worker.stats
    if runner == "v1":
        assert stats.held_compute > 0 and stats.overtaken_entries == 0
    else:
        assert stats.overtaken_entries > 0
    slow.land()
    eng.check_entries()
    eng.side.stats.hook_errors = 0
    eng.check_settled(lossy=runner == "v2")


@pytest.mark.parametrize(("runner", "fault"), [("v2", "_overtaken"), ("v1", "hold_compute")])
def test_a_fault_in_the_workers_guard_drops_what_is_in_flight(
    model_dir, monkeypatch, runner, fault
):
    """The pool-pressure stream above (blocks handed on while stores read them, copies
    landing two steps late), with the worker's guard failing every time (no input makes
    the real one fail, so the fault is injected): dropping the overtaken entries, or
    ordering the compute stream behind them. Both hooks that run the guard caught it,
    so its stores used to copy blocks already zeroed or rewritten, saved under their
    keys (10 of 54 entries held other tokens' KV, restored three times). Now a failed
    guard drops every entry in flight: hits are lost, no entry holds wrong bytes and no
    restore computes on one."""
    from hybridkv.vllm.worker_side import WorkerSide

    eng = Engine(model_dir, False, seed=9, runner=runner, num_blocks=40)
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps)
    eng.copies_land = lambda step: slow.land(queued_before=step - 2)
    faults = 0

    def boom(*args, **kwargs):
        nonlocal faults
        faults += 1
        raise RuntimeError("injected guard fault")

    if fault == "_overtaken":
        monkeypatch.setattr(WorkerSide, "_overtaken", boom)
    else:
        monkeypatch.setattr(eng.worker.copies, "hold_compute", boom)
    reqs = [eng.add(f"r{i}", _prompt(40 + 7 * i, 40 + i), max_tokens=30) for i in range(5)]
    eng.run(limit=800)  # every restore's blocks checked as its request computes
    assert faults > 0 and sum(r.num_preemptions for r in reqs) > 0
    slow.land()
    eng.worker._land()
    eng.check_entries()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_failed_load_is_reported_only_after_its_copies_in_flight_land(
    model_dir, async_scheduling
):
    """A hit loads one entry a step; the first copy is in flight when the second raises.
    The request is failed, but stays waiting for its load (vLLM would free its blocks
    with the first copy still writing them) until that copy lands; then vLLM recomputes
    it from the start."""
    from vllm.v1.request import RequestStatus

    eng = Engine(model_dir, async_scheduling, seed=13)
    a = eng.add("a", _prompt(40, 51), max_tokens=2)
    eng.run()
    assert eng.sched.reset_prefix_cache()
    eng.worker.load_step_bytes = ATTN_PAGE  # one entry a step
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps, failing_load=2)
    b = eng.add("b", list(a.prompt_token_ids), max_tokens=3)
    eng.run(until=lambda: slow.queued > 0)  # the first copy is in flight
    for _ in range(5):
        eng.step()
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "reported with a copy running"
    assert eng.worker.restoring == 1 and slow.in_flight() == 1
    slow.land()
    eng.run()
    assert eng.first_start["b"] == 0 and b.num_output_tokens == 3
    assert eng.worker.stats.failed_loads == 1
    eng.check_entries()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_request_aborted_while_its_load_is_in_flight_is_freed_by_the_load_alone(
    model_dir, async_scheduling
):
    """vLLM keeps an aborted request's blocks while its load is in flight and frees them
    when the load is reported; hybridkv planned no store on those blocks, so it does not
    delay the request too (a `finished_sending` for it would find it gone: vLLM asserts)."""
    from vllm.v1.request import RequestStatus

    eng = Engine(model_dir, async_scheduling, seed=17)
    a = eng.add("a", _prompt(40, 61), max_tokens=2)
    eng.run()
    assert eng.sched.reset_prefix_cache()
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps)
    b = eng.add("b", list(a.prompt_token_ids), max_tokens=3)
    eng.run(until=lambda: slow.queued > 0)  # the load's copy is in flight
    eng.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        eng.step()
    assert "b" in eng.sched.requests and held_blocks(eng, "b"), "freed under a load"
    slow.land()
    eng.run()
    assert "b" not in eng.sched.requests and b.num_output_tokens == 0
    eng.check_entries()
    eng.check_settled()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_an_aborted_requests_load_stops_writing_and_frees_its_blocks(model_dir, async_scheduling):
    """A load writes one entry a step (`load_step_bytes`); its request is aborted after
    the first. vLLM keeps the blocks until the load is reported, so a load that went on
    writing (up to 64 MiB a step, a long prompt's restore for dozens of steps) held them,
    and every load queued behind it, for nothing. Now the rest is not written and the
    load is reported at once: received, neither a load served nor a failed one."""
    from vllm.v1.request import RequestStatus

    eng = Engine(model_dir, async_scheduling, seed=19)
    a = eng.add("a", _prompt(40, 71), max_tokens=2)
    eng.run()
    assert eng.sched.reset_prefix_cache()
    eng.worker.load_step_bytes = ATTN_PAGE  # one entry a step
    stats = eng.worker.stats
    loads, failed = stats.loads, stats.failed_loads
    b = eng.add("b", list(a.prompt_token_ids), max_tokens=3)
    eng.run(until=lambda: stats.loaded_blocks > 0)
    written, left = stats.loaded_blocks, len(eng.worker._restores[0].pending)
    assert left >= 3, "too few entries left to tell"
    eng.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    for _ in range(2):
        eng.step()
    assert "b" not in eng.sched.requests and not held_blocks(eng, "b")
    assert stats.loaded_blocks == written and eng.worker.restoring == 0
    assert (stats.loads, stats.failed_loads) == (loads, failed)
    assert b.num_output_tokens == 0
    eng.run()
    eng.check_entries()
