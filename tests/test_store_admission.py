"""A request's store is admitted to a full CPU tier with one eviction choice for all its
entries, and evicts what admitting them one at a time would. Model-free: hybridkv's
scheduler side on real vLLM `Request`s, with a budget that only holds a few prompts, so
every store evicts (by construction, not timing)."""

from __future__ import annotations

import random

from conftest import SEED

from hybridkv.core.index import StoreIndex
from hybridkv.core.keys import group_key
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.vllm.metadata import KeyedCopy
from hybridkv.vllm.scheduler_side import SchedulerSide

BLOCK, ATTN, STATE = 16, 64, 32
STATES = (1, 2)


def side() -> SchedulerSide:
    full = GroupSpec(GroupKind.FULL, BLOCK, ATTN, ("attn",))
    states = [GroupSpec(GroupKind.STATE, BLOCK, STATE, (f"gdn.{g}",)) for g in STATES]
    layout = Layout("test/store-admission", (full, *states))
    planner = Planner(layout.groups)
    index = StoreIndex(40 * ATTN, recurrent=True)  # about four prompts of 8 chunks
    policy = CheckpointPolicy("prompt_and_end", planner.chunk_tokens)
    return SchedulerSide(layout, planner, policy, index, enabled=True, below=False)


def copies(s: SchedulerSide, req) -> tuple[list[bytes], list[KeyedCopy]]:
    """What a cold prefill of `req` stores: its chunks and its checkpoint's states."""
    st = s._state(req)
    ckpt = s.policy.prompt_checkpoint(req.num_prompt_tokens) // BLOCK
    keys = s._keys(st, ckpt * BLOCK)
    plan = [EntryCopy(0, c, (0,), (0,)) for c in range(ckpt)]
    plan += [EntryCopy(g, ckpt - 1, (0,), (0,)) for g in STATES]
    return keys, [KeyedCopy(group_key(keys[c.chunk], c.group), c) for c in plan]


def test_a_store_evicts_once_and_what_one_entry_at_a_time_would():
    from vllm import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(SEED)
    print(f"seed {SEED}")
    batched, single = side(), side()
    choices = 0
    victims = batched.index.policy.victims

    def counted(needed):
        nonlocal choices
        choices += 1
        return victims(needed)

    batched.index.policy.victims = counted
    evicted = 0
    for i in range(12):
        prompt = [rng.randrange(1, 5000) for _ in range(rng.randint(5, 9) * BLOCK + 1)]
        params = SamplingParams(max_tokens=1)
        req_a = Request(f"a{i}", prompt, sampling_params=params, pooling_params=None)
        req_b = Request(f"b{i}", prompt, sampling_params=params, pooling_params=None)
        keys, planned = copies(batched, req_a)
        choices = 0
        stored = batched._admit(batched._state(req_a), keys, planned)
        assert choices <= 1
        # The same store, one entry at a time (the chunks, then the boundary's states).
        keys_b, planned_b = copies(single, req_b)
        st = single._state(req_b)
        for kc in planned_b:
            if kc.copy.group == 0:
                assert single.index.admit(kc.key, ATTN)
                single.index.pin([kc.key])
                st.owned.append(kc.key)
        end = len(keys_b) * BLOCK
        states = [(kc.key, kc.copy.group) for kc in planned_b[-len(STATES) :]]
        single._admit_boundary(keys_b, end, states, single._needs(keys_b, end))
        assert [kc.key for kc in stored] == [kc.key for kc in planned]
        orders_a, orders_b = batched.index.take_orders(), single.index.take_orders()
        assert set(orders_a.evict) == set(orders_b.evict)
        evicted += len(orders_a.evict)
        assert batched.index.gauges() == single.index.gauges()
        batched.request_finished(req_a)
        single.request_finished(req_b)
    assert evicted > 0


def test_a_boundary_with_one_state_left_is_admitted_whole():
    """A boundary one state of which was lost (its store failed on a worker) leaves the
    other state in CPU memory as an orphan, which eviction takes first. When a request
    stores that boundary again into a full tier, the boundary is admitted with both
    states: the lost one is copied, the one CPU memory holds is kept (pinned while room
    is made) and not copied again, and the graph records both."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(SEED)
    print(f"seed {SEED}")
    s = side()
    index = s.index

    def request(name: str, prompt: list[int]) -> Request:
        params = SamplingParams(max_tokens=1)
        return Request(name, prompt, sampling_params=params, pooling_params=None)

    def store(req: Request) -> list[bytes]:
        keys, planned = copies(s, req)
        stored = [kc.key for kc in s._admit(s._state(req), keys, planned)]
        s.request_finished(req)
        return stored

    for i in range(3):
        store(request(f"other{i}", [rng.randrange(1, 5000) for _ in range(5 * BLOCK + 1)]))
    target = [rng.randrange(1, 5000) for _ in range(6 * BLOCK + 1)]
    assert store(request("first", target))
    _, planned = copies(s, request("keys", target))
    lost, kept = (kc.key for kc in planned[-len(STATES) :])
    index.take_orders()
    index.lost(index.epoch, lost)
    assert index.graph.boundary(kept) is None and index.graph.is_orphan(kept)
    index.take_orders()
    index.capacity = index.ledger.used  # full: the next store evicts

    assert store(request("restore", target)) == [lost]
    assert kept not in index.take_orders().evict
    b = index.graph.boundary(kept)
    assert b is not None and set(index.graph.rows.state_keys(b)) == {lost, kept}
    assert index.in_cpu(lost) and index.in_cpu(kept)
    assert index.stats.cpu_evictions > 0


def test_a_longer_turn_keeps_the_chunks_it_needs_when_its_store_evicts():
    """A conversation's second turn stores its new chunks and a boundary at its end into
    a tier that must evict for them; the only candidate is the first turn's boundary,
    whose chunks the new one reads. Only that boundary's states go: the chunks stay, and
    a third request repeating the second turn hits all of it. (They used to go with
    their boundary, leaving the new one admitted with nothing to serve.)"""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(SEED)
    print(f"seed {SEED}")
    s = side()
    index = s.index
    params = SamplingParams(max_tokens=1)
    first = [rng.randrange(1, 5000) for _ in range(rng.randint(10, 20) * BLOCK)]
    second = first + [rng.randrange(1, 5000) for _ in range(rng.randint(4, 10) * BLOCK + 1)]
    turns = [Request(f"turn{i}", p, params, None) for i, p in enumerate((first + [7], second))]
    keys, planned = copies(s, turns[0])
    assert s._admit(s._state(turns[0]), keys, planned)
    s.request_finished(turns[0])
    first_states = {group_key(keys[-1], g) for g in STATES}
    index.take_orders()
    keys, planned = copies(s, turns[1])
    new = [kc for kc in planned if kc.key in set(index.unknown(kc.key for kc in planned))]
    # Room for all but one state: the first turn's states (two) must go, nothing more.
    index.capacity = index.ledger.used + sum(s.planner.entry_bytes(kc.copy.group) for kc in new)
    index.capacity -= STATE
    assert s._admit(s._state(turns[1]), keys, planned) == new
    s.request_finished(turns[1])
    assert set(index.take_orders().evict) == first_states
    assert index.stats.unservable == 0
    again = Request("again", second, params, None)
    assert s.num_new_matched_tokens(again, 0) == len(keys) * BLOCK
