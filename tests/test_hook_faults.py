"""A fault caught at one of vLLM's hooks leaves the engine consistent, not only alive:
no request waits forever for a load never sent, no hit is offered again and again after
its load failed, no pin outlives its request, no promotion stays "under way" for good,
and no router keeps believing in entries the events stopped telling about.

Driven through vLLM's real `Scheduler` without a model (test_async_scheduling's
`Engine`). No input makes these parts fail, so each fault is injected (monkeypatched to
raise) at the worst point a review found: the accepted use of a stand-in, a fault that
cannot be caused any other way.
"""

from __future__ import annotations

import pytest
from test_async_scheduling import C, Engine, _prompt, config_dir, stored_on_disk

import hybridkv.vllm.scheduler_side as scheduler_side
from hybridkv.core.index import StoreIndex
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.vllm.handover import Handover
from hybridkv.vllm.scheduler_side import SchedulerSide
from hybridkv.vllm.worker_side import WorkerSide


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return config_dir(tmp_path_factory)


def injected(monkeypatch, owner, name: str, when=lambda *a: True, limit: int = 10**9) -> dict:
    """Make `owner.name` raise whenever `when(*args)` holds, `limit` times at most;
    counts the faults."""
    real = getattr(owner, name)
    count = {"faults": 0}

    def failing(*args, **kwargs):
        if count["faults"] < limit and when(*args):
            count["faults"] += 1
            raise RuntimeError(f"injected fault in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return count


def test_a_fault_before_a_hits_load_is_queued_fails_the_load(model_dir, monkeypatch):
    """update_state_after_alloc failing before the load is queued: vLLM already keeps the
    request waiting for it, so it used to wait forever (and, aborted, keep its blocks).
    Now the load goes out failed: vLLM recomputes, the request finishes, no pin stays."""
    eng = Engine(model_dir, False, seed=13)
    a = eng.add("a", _prompt(40, 51), max_tokens=2)
    eng.run()
    assert eng.sched.reset_prefix_cache()  # b's prefix is hybridkv's hit
    fault = injected(
        monkeypatch, Handover, "admitted", lambda self, req_id, blocks, ours: req_id == "b" and ours
    )
    b = eng.add("b", list(a.prompt_token_ids), max_tokens=3)
    eng.run(limit=300)
    assert fault["faults"] == 1 and b.is_finished() and eng.first_start["b"] == 0
    assert eng.side.stats.hook_errors == 1 and eng.worker.stats.failed_loads == 1
    eng.side.stats.hook_errors = 0
    eng.check_settled(lossy=True)


def test_a_fault_applying_a_report_still_marks_the_failed_load(model_dir, monkeypatch):
    """An entry lost behind the index's back fails a hit; applying the report that says
    so fails every time. The failed load used to be marked after the reports, so it was
    skipped too, and the request was offered the same hit after each recompute (2,000
    failed loads in 2,000 steps). Now failed loads come first: one failed load, then the
    request computes and finishes."""
    from hybridkv.core.keys import chunk_keys, group_key
    from hybridkv.vllm.request_identity import key_context

    eng = Engine(model_dir, False, seed=13)
    a = eng.add("a", _prompt(40, 51), max_tokens=2)
    eng.run()
    prompt = list(a.prompt_token_ids)
    seed = key_context(a, eng.side.layout.fingerprint).seed
    eng.worker.store.cpu.delete(group_key(chunk_keys(seed, prompt, C)[0], 0))
    assert eng.sched.reset_prefix_cache()
    fault = injected(monkeypatch, StoreIndex, "apply", lambda self, rank, report: report.lost)
    b = eng.add("b", prompt, max_tokens=2)
    eng.run(limit=300)
    assert b.is_finished() and fault["faults"] >= 1
    assert eng.worker.stats.failed_loads == 1 and eng.first_start["b"] == 0


def test_a_fault_finishing_a_request_releases_its_pins(model_dir, monkeypatch):
    """A fault storing a finished request's last chunks (after its state was dropped)
    used to leave its pins for good: 77 % of CPU memory unevictable, later stores
    refused. Now it costs those stores alone."""
    eng = Engine(model_dir, False, seed=1)
    fault = injected(monkeypatch, SchedulerSide, "_finish_tagged", limit=1)
    eng.add("a", _prompt(40, 1), max_tokens=25)
    eng.run()
    assert fault["faults"] == 1 and eng.side.stats.hook_errors == 1
    assert eng.side.index.pinned() == 0 and eng.side.index.ledger.held_bytes == 0


def test_a_fault_building_events_retracts_rather_than_goes_quiet(model_dir, monkeypatch):
    """A fault building a step's KV events has consumed the tracker's changes: the
    retraction of a's entries after a reset was lost, and a router went on believing
    this replica held them. Now the events stop and retract everything they announced:
    a router believes in nothing this replica does not hold."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    import hybridkv.vllm.kv_events as kv_events

    eng = Engine(model_dir, False, kv_events=True)
    published: list = []
    eng.sched.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    eng.add("a", _prompt(40, 1), max_tokens=25)
    eng.run()
    fault = injected(
        monkeypatch, kv_events, "_removed", lambda payloads, medium, as_ints: bool(payloads), 1
    )
    assert eng.sched.reset_prefix_cache()  # a's entries leave CPU memory
    eng.add("b", _prompt(40, 2), max_tokens=25)
    eng.run()
    assert fault["faults"] >= 1 and eng.side.events.broken
    cut = max(i for i, e in enumerate(published) if isinstance(e, AllBlocksCleared))
    believed: set = set()
    for e in published[cut + 1 :]:
        if isinstance(e, BlockStored) and e.medium == "CPU":
            believed |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved) and e.medium == "CPU":
            believed -= set(e.block_hashes)
    assert not believed, believed


@pytest.mark.parametrize("where", ["start of step", "report", "promotion thread"])
def test_a_fault_around_a_promotion_leaves_no_key_promoting(
    model_dir, monkeypatch, tmp_path, where
):
    """A restarted engine promotes a prompt's entries from disk for its hit. A fault at
    the start of that step (before the promotions went out), while the report carrying
    their results was built, or in the reading thread used to lose the results: the
    index kept the keys "promoting" for good (their bytes unevictable) and every later
    request for the prefix waited the whole promotion wait, then computed from token 0.
    Now the results reach the index (failed where the read failed) and the next
    requests hit."""
    monkeypatch.setattr(scheduler_side, "PROMOTE_WAIT_SECONDS", 2.0)  # a regression's cost
    disk = {"disk_path": str(tmp_path / "kv")}
    prompt = stored_on_disk(model_dir, disk)

    eng = Engine(model_dir, False, seed=13, extra=disk)
    if where == "start of step":
        begin = WorkerSide.begin_step
        promoting = {"now": False}

        def begin_step(self, meta):
            promoting["now"] = bool(meta.orders.promote)
            return begin(self, meta)

        monkeypatch.setattr(WorkerSide, "begin_step", begin_step)
        fault = injected(monkeypatch, WorkerSide, "_land", lambda *a: promoting["now"], 1)
    elif where == "report":
        fault = injected(
            monkeypatch, DiskTier, "rescan_if_stale", lambda *a: eng.worker._report.promoted, 1
        )
    else:
        fault = injected(
            monkeypatch, WorkerSide, "_count_read", lambda self, tier, e: tier == "disk", 1
        )

    starts = []
    for req_id in ("b", "c", "d"):
        assert eng.sched.reset_prefix_cache()
        r = eng.add(req_id, prompt, max_tokens=2)
        eng.run(limit=100_000)
        assert r.is_finished()
        starts.append(eng.first_start[req_id])
    assert fault["faults"] == 1
    assert eng.side.index.gauges()["promoting"] == 0
    assert eng.side.index.ledger.held_bytes == 0
    assert starts[-1] > 0, starts  # the last request hit


def test_a_fault_in_the_step_that_clears_still_clears(model_dir, monkeypatch, tmp_path):
    """A reset orders the workers to clear once, in one step's metadata. A fault landing
    stores at the start of that step skipped the clear for good while the new epoch's
    work went on: the index and the workers' CPU memory disagreed (5 entries counted,
    10 held) and the reset left this engine's stores in memory."""
    eng = Engine(model_dir, False, seed=13, extra={"disk_path": str(tmp_path / "kv")})
    eng.add("a", _prompt(40, 51), max_tokens=2)
    eng.run()
    held_before = set(eng.worker.store.cpu._entries)
    assert held_before
    begin = WorkerSide.begin_step
    clearing = {"now": False}

    def begin_step(self, meta):
        clearing["now"] = meta.orders.clear
        return begin(self, meta)

    monkeypatch.setattr(WorkerSide, "begin_step", begin_step)
    fault = injected(monkeypatch, WorkerSide, "_land", lambda *a: clearing["now"], 1)
    assert eng.sched.connector.reset_cache()
    eng.add("b", _prompt(40, 99), max_tokens=2)
    eng.run()
    assert fault["faults"] == 1
    held = set(eng.worker.store.cpu._entries)
    assert not held & held_before
    assert len(held) == eng.side.index.gauges()["cpu_entries"]
