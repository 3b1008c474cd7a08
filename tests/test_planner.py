"""Planner: chunk size, store/load copy plans and the hit rule, against brute-force oracles."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.layout import GroupKind, GroupSpec
from hybridkv.core.planner import NULL_BLOCK, EntryCopy, PlanError, Planner, choose_chunk_tokens

FULL, SLIDING, STATE = GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE


def spec(kind: GroupKind, bs: int, window: int | None = None, i: int = 0) -> GroupSpec:
    return GroupSpec(kind, bs, block_bytes=100 * bs, layer_names=(f"layer{i}",), window=window)


@st.composite
def planners(draw, max_groups: int = 4) -> Planner:
    """A planner over 1-4 groups whose block sizes all divide the chunk size."""
    C = draw(st.sampled_from([32, 64, 128, 256]))
    divisors = [d for d in (8, 16, 32, 64, 128, 256) if C % d == 0]
    n = draw(st.integers(1, max_groups))
    groups = []
    for i in range(n):
        kind = draw(st.sampled_from([FULL, SLIDING, STATE]))
        bs = draw(st.sampled_from(divisors))
        window = None
        if kind is SLIDING:  # often just around a block multiple, where rounding matters
            near = bs * draw(st.integers(1, 3 * C // bs)) + draw(st.sampled_from([-1, 0, 1]))
            window = draw(st.one_of(st.integers(1, 3 * C), st.just(max(near, 1))))
        groups.append(spec(kind, bs, window, i))
    # Usually let the planner pick the chunk size itself (needs a group at C).
    if draw(st.booleans()):
        groups[draw(st.integers(0, n - 1))] = spec(FULL, C, None, n)
        planner = Planner(groups)
    else:
        planner = Planner(groups, chunk_tokens=C)
    assert planner.chunk_tokens == C
    return planner


def n_blocks(p: Planner, g: int, n_chunks: int) -> int:
    return n_chunks * p.chunk_tokens // p.groups[g].block_tokens


@st.composite
def unique_ids(draw, p: Planner, n_chunks: int) -> list[list[int]]:
    """Distinct non-null engine block ids, a random permutation per group."""
    out = []
    for g in range(len(p.groups)):
        n = n_blocks(p, g, n_chunks)
        perm = draw(st.permutations(range(1, n + 1)))
        out.append([1000 * g + b for b in perm])
    return out


@st.composite
def ids_with_nulls(draw, p: Planner, n_chunks: int) -> list[list[int]]:
    """Block ids where some are the null block and the list may be cut short."""
    out = []
    for g in range(len(p.groups)):
        n = n_blocks(p, g, n_chunks)
        length = draw(st.integers(0, n))
        nulls = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        out.append([NULL_BLOCK if z else 1000 * g + i + 1 for i, z in enumerate(nulls)])
    return out


def bid_at(ids: list[int], i: int) -> int:
    return ids[i] if 0 <= i < len(ids) else NULL_BLOCK


def block_index(p: Planner, copy, slot: int) -> int:
    return copy.chunk * p.blocks_per_entry(copy.group) + slot


# ---- choose_chunk_tokens ----------------------------------------------------------------


@given(st.lists(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256, 512]), min_size=1))
def test_chunk_is_the_largest_block_when_all_divide_it(sizes):
    assert choose_chunk_tokens(sizes) == max(sizes)


@given(st.lists(st.integers(1, 96), min_size=1, max_size=4))
def test_chunk_is_the_smallest_common_tile_or_refused(sizes):
    top = max(sizes)
    # Brute force: the smallest multiple of the largest size that every size divides.
    tile = next((m for m in range(top, 16 * top + 1, top) if all(m % s == 0 for s in sizes)), None)
    if tile is None:
        with pytest.raises(PlanError, match=r"^chunk_tokens"):
            choose_chunk_tokens(sizes)
    else:
        assert choose_chunk_tokens(sizes) == tile


def test_chunk_refuses_a_huge_lcm():
    with pytest.raises(PlanError, match=r"^chunk_tokens"):
        choose_chunk_tokens([97, 101])
    with pytest.raises(PlanError, match=r"^chunk_tokens"):
        Planner([spec(FULL, 97), spec(STATE, 101)])
    # ...but an explicit multiple of both is accepted.
    assert Planner([spec(FULL, 97), spec(STATE, 101)], chunk_tokens=97 * 101).chunk_tokens == 9797


@given(
    st.lists(st.sampled_from([8, 16, 24, 32, 48, 64]), min_size=1, max_size=4),
    st.integers(1, 1024),
)
def test_chunk_override(sizes, override):
    if all(override % s == 0 for s in sizes):
        assert choose_chunk_tokens(sizes, override) == override
    else:
        with pytest.raises(PlanError, match=r"^chunk_tokens"):
            choose_chunk_tokens(sizes, override)


def test_no_groups_is_an_error():
    with pytest.raises(PlanError):
        choose_chunk_tokens([])


# ---- store_plan -------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(p=planners(), n_chunks=st.integers(1, 5), data=st.data())
def test_store_plan_covers_every_block_exactly_once(p, n_chunks, data):
    C = p.chunk_tokens
    ids = data.draw(unique_ids(p, n_chunks), label="ids")
    lo = data.draw(st.integers(0, n_chunks), label="lo")
    hi = data.draw(st.integers(lo, n_chunks), label="hi")
    plan = p.store_plan(range(lo, hi), ids)

    for g, s in enumerate(p.groups):
        copies = [c for c in plan if c.group == g]
        if s.kind is STATE:
            assert copies == []  # states come from the engine's hand-off, not the table
            continue
        per = p.blocks_per_entry(g)
        assert per == C // s.block_tokens
        seen = []
        for c in copies:
            assert lo <= c.chunk < hi
            assert len(c.slots) == len(c.block_ids) == per  # whole entries only
            for slot, bid in zip(c.slots, c.block_ids, strict=True):
                i = block_index(p, c, slot)
                assert ids[g][i] == bid
                seen.append(i)
        assert sorted(seen) == list(range(lo * per, hi * per))


@settings(max_examples=120, deadline=None)
@given(p=planners(), n_chunks=st.integers(1, 5), data=st.data())
def test_store_plan_skips_null_blocks_and_incomplete_chunks(p, n_chunks, data):
    ids = data.draw(ids_with_nulls(p, n_chunks), label="ids")
    plan = p.store_plan(range(n_chunks), ids)
    assert all(b != NULL_BLOCK for c in plan for b in c.block_ids)

    for g, s in enumerate(p.groups):
        stored = {c.chunk: c for c in plan if c.group == g}
        assert len(stored) == len([c for c in plan if c.group == g])  # one entry per chunk
        if s.kind is STATE:
            assert not stored
            continue
        per = p.blocks_per_entry(g)
        whole = {
            c
            for c in range(n_chunks)
            if all(bid_at(ids[g], i) != NULL_BLOCK for i in range(c * per, (c + 1) * per))
        }
        assert set(stored) == whole
        for c in stored.values():
            assert c.slots == tuple(range(per))
            assert c.block_ids == tuple(ids[g][c.chunk * per : (c.chunk + 1) * per])


def test_store_plan_example_sliding_chunk_with_released_block():
    # Chunk 64 tokens, sliding blocks of 16: chunk 0 lost its first block to the window.
    p = Planner([spec(FULL, 64), spec(SLIDING, 16, window=32, i=1), spec(STATE, 64, i=2)])
    ids = [[5, 6], [0, 11, 12, 13, 14, 15, 16, 17], [0, 21]]
    plan = p.store_plan(range(2), ids) + [p.state_copy(2, 128, 21)]
    assert sorted((c.group, c.chunk, c.slots, c.block_ids) for c in plan) == [
        (0, 0, (0,), (5,)),
        (0, 1, (0,), (6,)),
        (1, 1, (0, 1, 2, 3), (14, 15, 16, 17)),
        (2, 1, (0,), (21,)),
    ]


# ---- load_plan --------------------------------------------------------------------------


@st.composite
def load_case(draw):
    p = draw(planners())
    C = p.chunk_tokens
    n_chunks = draw(st.integers(1, 5))
    boundary = C * draw(st.integers(1, n_chunks))
    local = draw(st.integers(0, boundary - 1))
    ids = draw(ids_with_nulls(p, n_chunks))
    # The engine always holds the block that receives a restored state.
    for g, s in enumerate(p.groups):
        if s.kind is STATE:
            n = n_blocks(p, g, n_chunks)
            ids[g] = ids[g] + [1000 * g + i + 1 for i in range(len(ids[g]), n)]
            ids[g][boundary // s.block_tokens - 1] = 999_999
    return p, local, boundary, ids


@settings(max_examples=150, deadline=None)
@given(load_case())
def test_load_plan_loads_exactly_the_needed_blocks(case):
    p, local, boundary, ids = case
    C = p.chunk_tokens
    plan = p.load_plan(local, boundary, ids)
    assert all(b != NULL_BLOCK for c in plan for b in c.block_ids)
    for g, s in enumerate(p.groups):
        copies = [c for c in plan if c.group == g]
        bs = s.block_tokens
        if s.kind is STATE:
            assert [(c.chunk, c.slots, c.block_ids) for c in copies] == [
                (boundary // C - 1, (0,), (999_999,))
            ]
            continue
        first = local // bs
        if s.kind is SLIDING:
            first = max(first, (boundary - s.window) // bs)
        expect = {i for i in range(first, boundary // bs) if bid_at(ids[g], i) != NULL_BLOCK}
        got = []
        for c in copies:
            assert len(c.slots) == len(c.block_ids) >= 1
            for slot, bid in zip(c.slots, c.block_ids, strict=True):
                assert 0 <= slot < p.blocks_per_entry(g)
                i = block_index(p, c, slot)
                assert ids[g][i] == bid
                got.append(i)
        assert sorted(got) == sorted(expect)  # each once, nothing below the local hit
        assert len({c.chunk for c in copies}) == len(copies)


def test_load_plan_state_without_a_block_is_an_error():
    p = Planner([spec(FULL, 64), spec(STATE, 64, i=1)])
    with pytest.raises(PlanError):
        p.load_plan(0, 128, [[1, 2], [3, NULL_BLOCK]])


def test_load_plan_example():
    # local hit 32 tokens; resume at 128: full blocks 2..7, sliding window 33 -> token 95
    # on, i.e. from block 5.
    p = Planner([spec(FULL, 16), spec(SLIDING, 16, window=33, i=1), spec(STATE, 64, i=2)])
    assert p.chunk_tokens == 64
    ids = [list(range(1, 9)), [0, 0, 0, 0, 0, 15, 16, 17], [30, 31]]
    plan = p.load_plan(32, 128, ids)
    assert sorted((c.group, c.chunk, c.slots, c.block_ids) for c in plan) == [
        (0, 0, (2, 3), (3, 4)),
        (0, 1, (0, 1, 2, 3), (5, 6, 7, 8)),
        (1, 1, (1, 2, 3), (15, 16, 17)),
        (2, 1, (0,), (31,)),
    ]


# ---- find_hit ---------------------------------------------------------------------------


def oracle_needed_chunks(p: Planner, g: int, local: int, end: int) -> set[int]:
    """Independent statement of which entries a restore at boundary `end` reads."""
    s, C = p.groups[g], p.chunk_tokens
    bs = s.block_tokens
    if end <= local:
        return set()
    if s.kind is STATE:
        return {end // C - 1}
    first = local if s.kind is FULL else max(local, end - s.window)
    return {i * bs // C for i in range(first // bs, end // bs)}


def oracle_hit(p: Planner, L: int, local: int, present) -> int:
    C = p.chunk_tokens
    best = 0
    for end in range(C, L, C):  # end <= L - 1: at least one prompt token is left to compute
        if end > local and all(
            present(g, c)
            for g in range(len(p.groups))
            for c in oracle_needed_chunks(p, g, local, end)
        ):
            best = end
    return best


@st.composite
def hit_case(draw):
    p = draw(planners())
    C = p.chunk_tokens
    L = draw(st.integers(0, 7 * C))
    local = draw(st.integers(0, max(L, 0)))
    n_chunks = L // C + 1
    present_sets = [
        draw(st.sets(st.integers(0, n_chunks), max_size=n_chunks + 1)) for _ in p.groups
    ]
    return p, L, local, present_sets


@settings(max_examples=120, deadline=None)
@given(hit_case())
def test_find_hit_is_the_largest_restorable_boundary(case):
    p, L, local, sets = case
    C = p.chunk_tokens

    def present(g, c):
        assert c >= 0
        return c in sets[g]

    def run(g, start, stop):  # as a caller answering many chunks at once would
        return next((c - start for c in range(start, stop) if c not in sets[g]), stop - start)

    hit = p.find_hit(L, local, present)
    assert hit == oracle_hit(p, L, local, present)
    assert p.find_hit(L, local, present, run) == hit
    assert hit == 0 or (hit % C == 0 and local < hit <= L - 1)
    if hit:
        for g in range(len(p.groups)):
            assert set(p.needed_chunks(g, local, hit)) == oracle_needed_chunks(p, g, local, hit)


@settings(max_examples=120, deadline=None)
@given(p=planners(), data=st.data())
def test_find_hit_with_everything_stored(p, data):
    C = p.chunk_tokens
    L = data.draw(st.integers(0, 9 * C), label="L")
    local = data.draw(st.integers(0, L), label="local")
    best = max(L - 1, 0) // C * C
    hit = p.find_hit(L, local, lambda g, c: True)
    assert hit == (best if best > local else 0)
    assert hit < max(L, 1)  # never the whole prompt


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_missing_state_drops_the_hit_to_an_earlier_stored_state(data):
    C = data.draw(st.sampled_from([32, 64]), label="C")
    p = Planner([spec(FULL, C // 2), spec(STATE, C, i=1), spec(SLIDING, C // 4, window=C, i=2)])
    L = data.draw(st.integers(1, 8 * C), label="L")
    local = data.draw(st.integers(0, L), label="local")
    k_max = (L - 1) // C
    states = data.draw(st.sets(st.integers(0, k_max)), label="states")

    hit = p.find_hit(L, local, lambda g, c: g != 1 or c in states)
    expect = max(
        (k * C for k in range(1, k_max + 1) if k * C > local and k - 1 in states), default=0
    )
    assert hit == expect


def test_find_hit_examples():
    p = Planner([spec(FULL, 16), spec(STATE, 64, i=1)])
    everything = lambda g, c: True  # noqa: E731
    assert p.find_hit(257, 0, everything) == 256
    assert p.find_hit(256, 0, everything) == 192  # the last token is always computed
    assert p.find_hit(64, 0, everything) == 0
    assert p.find_hit(257, 256, everything) == 0  # nothing beyond the local hit
    assert p.find_hit(257, 200, everything) == 256
    # A gap in the full group at chunk 2 caps the hit at 128, even with later states.
    assert p.find_hit(400, 0, lambda g, c: not (g == 0 and c == 2)) == 128
    # The gap is irrelevant when it lies below the local hit.
    assert p.find_hit(400, 192, lambda g, c: not (g == 0 and c == 2)) == 384
    # The state at 384 is missing: fall back to 320.
    assert p.find_hit(400, 0, lambda g, c: not (g == 1 and c == 5)) == 320


@dataclass
class FakeEngine:
    """Block contents by engine block id; a block 'holds' (group, token block index)."""

    blocks: dict[int, tuple[int, int]]


@settings(max_examples=120, deadline=None)
@given(p=planners(), n_chunks=st.integers(1, 5), data=st.data())
def test_store_find_load_round_trip(p, n_chunks, data):
    """Store everything engine A computed, then restore engine B from it."""
    C = p.chunk_tokens
    ids_a = data.draw(unique_ids(p, n_chunks), label="ids_a")
    a = FakeEngine(
        {ids_a[g][i]: (g, i) for g in range(len(p.groups)) for i in range(len(ids_a[g]))}
    )
    store: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    # The engine reports each state's block; here, the one at index B / block - 1.
    plan = p.store_plan(range(n_chunks), ids_a) + [
        p.state_copy(g, B, ids_a[g][B // s.block_tokens - 1])
        for g, s in enumerate(p.groups)
        if s.kind is STATE
        for B in range(C, n_chunks * C + 1, C)
    ]
    for c in plan:
        entry = store.setdefault((c.group, c.chunk), {})
        for slot, bid in zip(c.slots, c.block_ids, strict=True):
            entry[slot] = a.blocks[bid]

    L = data.draw(st.integers(1, n_chunks * C + 1), label="L")
    local = data.draw(st.integers(0, L), label="local")
    hit = p.find_hit(L, local, lambda g, c: (g, c) in store)
    assert hit == (max(L - 1, 0) // C * C if max(L - 1, 0) // C * C > local else 0)
    if not hit:
        return
    ids_b = data.draw(unique_ids(p, n_chunks), label="ids_b")
    b = FakeEngine({})
    for c in p.load_plan(local, hit, ids_b):
        for slot, bid in zip(c.slots, c.block_ids, strict=True):
            b.blocks[bid] = store[(c.group, c.chunk)][slot]
    for g in range(len(p.groups)):
        # Every block B needs now holds what A's block at the same index held (for a
        # state group: A's state at the hit boundary).
        needed = p.needed_blocks(g, local, hit)
        assert needed
        for i in needed:
            assert b.blocks[ids_b[g][i]] == (g, i)


def test_state_copy_refuses_what_is_no_state_boundary():
    p = Planner([spec(FULL, 64), spec(STATE, 64, i=1)])
    assert p.state_copy(1, 128, 7) == EntryCopy(1, 1, (0,), (7,))
    for g, boundary in [(0, 64), (1, 0), (1, 96)]:
        with pytest.raises(PlanError):
            p.state_copy(g, boundary, 7)


def test_planner_sizes():
    p = Planner([spec(FULL, 16), spec(SLIDING, 32, window=100, i=1), spec(STATE, 64, i=2)])
    assert p.chunk_tokens == 64
    assert [p.blocks_per_entry(g) for g in range(3)] == [4, 2, 1]
    assert [p.entry_bytes(g) for g in range(3)] == [4 * 1600, 2 * 3200, 6400]
    assert [p.max_hit_chunks(n) for n in (0, 1, 64, 65, 128, 129)] == [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("extra", [0, 2, 15])
def test_a_hit_loads_every_sliding_block_vllm_allocates_for_it(extra):
    """vLLM's own manager (KVCacheManager) allocates a sliding group's blocks for an
    external hit from its window's trailing edge, extended by the tokens speculative
    decoding's drafters retain (`extra_retained_tokens`); every block it allocates is
    loaded, or it would keep another request's bytes under this prefix's hash."""
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    from hybridkv.vllm.layout import _kind

    bs, window, boundary = 16, 64, 160
    full = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(
        block_size=bs,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.bfloat16,
        sliding_window=window,
        extra_retained_tokens=extra,
    )
    config = KVCacheConfig(
        num_blocks=200,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["s"], swa)],
    )
    manager = KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=bs,
        hash_block_size=bs,
        use_eagle=extra > 0,
        num_prefill_lookahead=extra + 1,
    )
    sha256 = get_hash_fn_by_name("sha256")
    init_none_hash(sha256)
    req = Request(
        "r",
        list(range(200)),
        SamplingParams(max_tokens=4),
        None,
        None,
        block_hasher=get_request_block_hasher(bs, sha256),
    )
    manager.allocate_slots(req, 0, num_external_computed_tokens=boundary, delay_cache_blocks=True)
    block_ids = manager.get_block_ids("r")
    kind, w = _kind(swa)
    planner = Planner([spec(FULL, bs), GroupSpec(kind, bs, 100 * bs, ("s",), window=w)])
    plan = planner.load_plan(0, boundary, block_ids)
    loaded = {
        (c.group, c.chunk * planner.blocks_per_entry(c.group) + s) for c in plan for s in c.slots
    }
    for g, ids in enumerate(block_ids):
        allocated = {i for i, b in enumerate(ids[: boundary // bs]) if b != NULL_BLOCK}
        assert allocated <= {i for gg, i in loaded if gg == g}, (g, sorted(allocated))
