"""A lookup whose hit is on disk only answers "ask again" while its promotions run, then
the hit once every entry is in CPU memory; one failed promotion turns it into what the
rest can serve. Repeated polls while nothing changed start nothing new, and a poll with
another local hit from vLLM runs the hit rule again. Model-free: hybridkv's scheduler
side on a real vLLM `Request`, with the workers' reports written by hand."""

from __future__ import annotations

import pytest

from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import group_key
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.vllm.scheduler_side import SchedulerSide

BLOCK, CHUNKS = 16, 4
STATES = (1, 2)


@pytest.fixture
def waiting():
    """A scheduler side whose disk holds a prompt's chunks and checkpoint states, a
    request for it, and the entries its hit needs."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    full = GroupSpec(GroupKind.FULL, BLOCK, 64, ("attn",))
    states = [GroupSpec(GroupKind.STATE, BLOCK, 32, (f"gdn.{g}",)) for g in STATES]
    layout = Layout("test/promotion-wait", (full, *states))
    planner = Planner(layout.groups)
    index = StoreIndex(1 << 20, disk=True, recurrent=True)
    policy = CheckpointPolicy("prompt_and_end", planner.chunk_tokens)
    side = SchedulerSide(
        layout, planner, policy, index, enabled=True, below=True, tiers=[("disk", 1.0)]
    )
    prompt = list(range(1, CHUNKS * BLOCK + 2))
    params = SamplingParams(max_tokens=1)
    req = Request("r", prompt, sampling_params=params, pooling_params=None)
    keys = side._keys(side._state(req), len(prompt))
    needed = [group_key(k, 0) for k in keys[:CHUNKS]]
    needed += [group_key(keys[CHUNKS - 1], g) for g in STATES]
    index.apply(0, WorkerReport(listed=True, disk=[(k, True) for k in needed]))
    return side, req, needed


def promoted(side: SchedulerSide, keys: list[bytes], ok: bool = True) -> None:
    side.index.apply(0, WorkerReport(promoted=[(side.index.epoch, k, ok) for k in keys]))


def _blocks(side: SchedulerSide):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    groups = len(side.layout.groups)
    return KVCacheBlocks(tuple([KVCacheBlock(i) for i in range(CHUNKS)] for _ in range(groups)))


def test_a_disk_hit_waits_for_every_promotion_and_polls_start_nothing_new(waiting):
    side, req, needed = waiting
    assert side.num_new_matched_tokens(req, 0) is None
    assert sorted(k for k, _ in side.index.take_orders().promote) == sorted(needed)
    promoted(side, needed[:-1])
    for _ in range(3):
        assert side.num_new_matched_tokens(req, 0) is None
    assert not side.index.take_orders().promote
    assert side.stats.waits == 4
    promoted(side, needed[-1:])
    assert side.num_new_matched_tokens(req, 0) == CHUNKS * BLOCK


def test_a_failed_promotion_ends_the_wait_with_what_the_rest_can_serve(waiting):
    side, req, needed = waiting
    assert side.num_new_matched_tokens(req, 0) is None
    promoted(side, needed[-1:], ok=False)  # a checkpoint state is damaged on disk
    assert side.num_new_matched_tokens(req, 0) is None  # the rest are still being read
    promoted(side, needed[:-1])
    assert side.num_new_matched_tokens(req, 0) == 0  # no boundary is whole
    assert side.index.pinned() == 0


def test_a_poll_with_another_local_hit_runs_the_rule_again(waiting):
    side, req, needed = waiting
    assert side.num_new_matched_tokens(req, 0) is None
    promoted(side, needed[:1])
    side.index.take_orders()
    # vLLM now serves the first chunk itself: the wait no longer needs it pinned.
    assert side.num_new_matched_tokens(req, BLOCK) is None
    assert needed[0] not in side._state(req).pins
    promoted(side, needed[1:])
    assert side.num_new_matched_tokens(req, BLOCK) == (CHUNKS - 1) * BLOCK


def test_promotions_that_never_finish_end_the_wait_after_the_bound(waiting, monkeypatch):
    """Promotions no worker ever reports (a stuck disk): the lookup asks again while
    they are under `PROMOTE_WAIT_SECONDS` old, then answers with what CPU memory holds
    (nothing here) and releases its pins, so the request is prefilled, not held for
    good. The scheduler side's clock is moved by the test, not waited for."""
    from conftest import Clock

    from hybridkv.vllm import scheduler_side

    clock = Clock()
    monkeypatch.setattr(scheduler_side, "time", clock)
    side, req, needed = waiting
    assert side.num_new_matched_tokens(req, 0) is None
    promoted(side, needed[:1])
    clock.now += scheduler_side.PROMOTE_WAIT_SECONDS - 1
    assert side.num_new_matched_tokens(req, 0) is None  # still within the bound
    clock.now += 2
    assert side.num_new_matched_tokens(req, 0) == 0  # overdue: no boundary is in CPU memory
    assert side.index.pinned() == 0


def test_a_hit_in_cpu_memory_after_a_failed_wait_is_counted_as_cpu(waiting):
    """The hit's tier (metrics, vLLM's cached-by-source) is where what it reads came
    from: a wait for disk promotions that failed, followed by a shorter hit CPU memory
    held all along, is a CPU hit, not a disk one. Then its load fails: its tokens are
    counted as failed too."""
    side, req, needed = waiting
    keys = side._keys(side._state(req), len(req.prompt_token_ids))
    # CPU memory holds the first two chunks and the states at their end.
    head = [group_key(k, 0) for k in keys[:2]]
    for k in head:
        assert side.index.admit(k, 64)
    states = [(group_key(keys[1], g), 32) for g in STATES]
    assert side.index.admit_boundary(states, head, 2 * BLOCK, 64 + 128)
    assert side.num_new_matched_tokens(req, 0) is None  # waits for the disk's longer hit
    promoted(side, needed[-1:], ok=False)  # a state at the end is damaged on disk
    promoted(side, needed[:-1])
    assert side.num_new_matched_tokens(req, 0) == 2 * BLOCK
    assert side.hit_source(req) == "cpu"

    side.after_alloc(req, _blocks(side), 2 * BLOCK)
    side.loads_failed([req.request_id])
    counters, _ = side.metrics()
    assert counters["hit_tokens"] == {"cpu": 2 * BLOCK}
    assert counters["failed_load_tokens"] == {"cpu": 2 * BLOCK}
    assert counters["failed_promotions"] == {"disk": 1}


def test_a_failed_disk_read_says_nothing_of_the_shared_tier(waiting):
    """A promotion from disk that fails (a damaged file) is no answer about the shared
    tier's copy of the key: the probe still asks about it. One from the shared tier
    that fails is taken for its absence there a while."""
    from hybridkv.core.probe import Probe

    side, req, needed = waiting
    side.probe = Probe("redis", lambda keys: [False] * len(keys), ttl_s=60)
    assert side.num_new_matched_tokens(req, 0) is None  # promoting from disk
    epoch = side.index.epoch
    side.worker_reports({0: WorkerReport(promoted=[(epoch, needed[0], False)])})
    assert side.probe.held([needed[0]]) == ([], True)
    assert side.index.promote(needed[1] + b"x", 32, "redis")
    side.worker_reports({0: WorkerReport(promoted=[(epoch, needed[1] + b"x", False)])})
    assert side.probe.held([needed[1] + b"x"]) == ([], False)
    side.probe.close()


def test_a_boundary_restored_from_disk_is_counted_in_as_a_boundary(waiting):
    """The states of a hit from disk come into CPU memory as promotions, one plain entry
    each: once the hit's load is planned they are counted in as the boundary they are
    (the eviction policy keeps a boundary as one; plain entries no boundary needs are
    evicted first, and a document restored from disk would not stay the branch point
    of the questions after it)."""
    side, req, needed = waiting
    assert side.num_new_matched_tokens(req, 0) is None
    promoted(side, needed)
    assert side.num_new_matched_tokens(req, 0) == CHUNKS * BLOCK
    state = needed[-1]
    assert side.index.boundary_id(state) is None  # a plain entry so far
    side.after_alloc(req, _blocks(side), CHUNKS * BLOCK)
    assert side.index.boundary_id(state) is not None
    assert side.index.graph.count == 1


def test_promoted_states_another_request_hits_in_cpu_memory_become_a_boundary(waiting):
    """The request that waited for the promotions is aborted before they land; another
    with the same prompt then hits them in CPU memory (a CPU hit): they are counted in as
    the boundary they are all the same."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    side, req, needed = waiting
    assert side.num_new_matched_tokens(req, 0) is None
    side.request_finished(req)  # aborted while waiting
    promoted(side, needed)  # the reads land anyway
    params = SamplingParams(max_tokens=1)
    again = Request("r2", list(req.prompt_token_ids), sampling_params=params, pooling_params=None)
    assert side.num_new_matched_tokens(again, 0) == CHUNKS * BLOCK
    assert side.hit_source(again) == "cpu"
    side.after_alloc(again, _blocks(side), CHUNKS * BLOCK)
    assert side.index.boundary_id(needed[-1]) is not None


def test_a_load_reported_failed_later_counts_only_a_load_still_out(waiting):
    """A request's load succeeded; a failure reported for it later (MultiConnector hands
    each connector the other's failed loads) counts no failed tokens of hybridkv's."""
    side, req, needed = waiting
    assert side.num_new_matched_tokens(req, 0) is None
    promoted(side, needed)
    assert side.num_new_matched_tokens(req, 0) == CHUNKS * BLOCK
    side.after_alloc(req, _blocks(side), CHUNKS * BLOCK)  # planned; it succeeds
    side.after_alloc(req, _blocks(side), 0)  # vLLM's second call, once loaded
    side.loads_failed([req.request_id])
    counters, _ = side.metrics()
    assert counters["hit_tokens"] == {"disk": CHUNKS * BLOCK}
    assert sum(counters["failed_load_tokens"].values()) == 0
