"""The hit-rate oracle (hybridkv.benchmarks.oracle) against an exhaustive search of its
model on tiny traces, drawn by hypothesis from the run's HYBRIDKV_TEST_SEED (printed in
the header).

The exhaustive search plays the model itself, independently of the oracle's reduction:
before each request the caches hold a set of items; the request hits what the real hit
rule (`Planner.find_hit`) finds in it; afterwards every admission and eviction choice is
tried (every subset of what was held plus the request's own items that can be placed
between the CPU's bytes and vLLM's blocks, with the items kept through the request
placed beside its own running blocks). Only maximal subsets are tried, which loses
nothing: a hit only grows with what is held, and from a larger set every choice of a
smaller one is still open. Placements are checked exactly, by trying every split of
each kind's items between the two.

Checked: the packing the oracle reduces the model to has exactly the exhaustive optimum
(so the reduction is exact); the oracle's value is a bound, at least that optimum, and
its schedule (the kind of answer a Belady-style oracle gives) is feasible, at most that
optimum. The bound's test can fail: a deliberately weaker oracle, one that leaves out
vLLM's own block pool, falls below the optimum on some tiny trace, which the same
assertion rejects.
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
from conftest import SEED
from hypothesis import HealthCheck, Phase, find, given, seed, settings
from hypothesis import strategies as st

from hybridkv.benchmarks.oracle import Capacity, Geometry, bound, packing
from hybridkv.benchmarks.traces import Request, Trace, block_chain

CHUNK = 2


def placeable(counts: tuple[int, ...], kinds: list[tuple[int, float]], cap, gpu) -> bool:
    """Whether `counts[i]` items of each kind split between the CPU and the pool."""
    for on_gpu in itertools.product(*(range(c + 1) for c in counts)):
        blocks = sum(n * b for n, (_, b) in zip(on_gpu, kinds, strict=True))
        cpu = sum((c - n) * s for c, n, (s, _) in zip(counts, on_gpu, kinds, strict=True))
        if blocks <= gpu + 1e-9 and cpu <= cap.cpu_bytes:
            return True
    return False


def exhaustive(trace: Trace, geometry: Geometry, cap: Capacity) -> int:
    """The best total of hit tokens over every admission and eviction policy of the
    oracle's model (module docstring of hybridkv.benchmarks.oracle)."""
    planner = geometry.planner()
    kinds = geometry.kinds()
    state = len(kinds) - 1 if geometry.state_bytes else None
    attention = [i for i in range(len(kinds)) if i != state]
    prompts = [r.prompt for r in trace]

    def own(t: int) -> frozenset[tuple[int, bytes]]:
        keys = block_chain(prompts[t], CHUNK)
        items = {(g, key) for g in attention for key in keys}
        if state is not None:
            items |= {(state, key) for key in keys}
        return frozenset(items)

    owns = [own(t) for t in range(len(prompts))]
    later = [frozenset().union(*owns[t + 1 :]) for t in range(len(prompts))]
    free = [max(cap.gpu_blocks - geometry.running_blocks(len(p)), 0) for p in prompts]

    @cache
    def fits(items: frozenset, gpu: float) -> bool:
        counts = tuple(sum(1 for g, _ in items if g == i) for i in range(len(kinds)))
        return placeable(counts, kinds, cap, gpu)

    def hit(t: int, held: frozenset) -> int:
        keys = block_chain(prompts[t], CHUNK)
        return planner.find_hit(len(prompts[t]), 0, lambda g, c: (g, keys[c]) in held)

    @cache
    def best(t: int, held: frozenset) -> int:
        if t == len(prompts):
            return 0
        pool = sorted((held | owns[t]) & later[t])  # what no later request has is useless

        def allowed(kept: frozenset) -> bool:
            return fits(kept, cap.gpu_blocks) and fits((held & kept) - owns[t], free[t])

        choices = [
            frozenset(c)
            for n in range(len(pool) + 1)
            for c in itertools.combinations(pool, n)
            if allowed(frozenset(c))
        ]
        # `allowed` holds for every subset of an allowed set (fewer items place as
        # easily), so a choice is maximal when adding any one more item is not allowed.
        allowed_sets = set(choices)
        maximal = [
            s for s in choices if not any(s | {x} in allowed_sets for x in pool if x not in s)
        ]
        return hit(t, held) + max(best(t + 1, s) for s in maximal)

    return best(0, frozenset())


def packed(trace: Trace, geometry: Geometry, cap: Capacity) -> int:
    """The packing problem's optimum by trying every choice of options, each moment's
    placement checked exactly."""
    p = packing(trace, geometry)
    kinds = geometry.kinds()
    free = np.maximum(cap.gpu_blocks - p.running, 0)
    per_request = [[-1] for _ in range(p.requests)]
    for option, r in enumerate(p.opt_req):
        per_request[r].append(option)
    best = 0
    for choice in itertools.product(*per_request):
        chosen = np.array(choice, dtype=np.int64)
        gaps, runs = p.cover(chosen)
        ok = all(
            placeable(tuple(int(c) for c in gaps[:, t]), kinds, cap, cap.gpu_blocks)
            and placeable(tuple(int(c) for c in runs[:, t]), kinds, cap, free[t])
            for t in range(p.requests)
        )
        if ok:
            hits = chosen >= 0
            best = max(best, int((p.opt_k[chosen[hits]] * CHUNK).sum()))
    return best


@st.composite
def tiny_traces(draw: st.DrawFn) -> Trace:
    """3 to 5 prompts of up to 8 tokens over a 2-token alphabet, most of them an earlier
    prompt (a next turn) or its first 2 to 4 tokens (a fork) with a new tail, so chunks
    and boundaries are shared and forked."""
    token = st.integers(1, 2)
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(3, 5))):
        if prompts and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(prompts))
            head = base[: draw(st.sampled_from([len(base), len(base), 2, 3, 4]))]
            prompt = head + draw(st.lists(token, min_size=1, max_size=max(1, 8 - len(head))))
        else:
            prompt = draw(st.lists(token, min_size=3, max_size=8))
        prompts.append(prompt[:8])
    return Trace("tiny", [Request(i, p) for i, p in enumerate(prompts)], 3)


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    state = draw(st.integers(0, 4))
    windows = draw(st.sampled_from([(), ((2, 1),), ((4, 2),)]))
    return Geometry(
        chunk_tokens=CHUNK,
        full_bytes=draw(st.integers(1, 3)),
        state_bytes=state,
        windows=windows,
        full_blocks=draw(st.sampled_from([0.5, 1.0, 2.0])),
        state_blocks=draw(st.integers(1, 3)) if state else 0,
        window_blocks=tuple(1.0 for _ in windows),
    )


capacities = st.builds(
    Capacity, cpu_bytes=st.integers(0, 12), gpu_blocks=st.sampled_from([0, 2, 4, 6, 9])
)


@seed(SEED)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=tiny_traces(), geometry=geometries(), cap=capacities)
def test_packing_is_exact_and_the_oracle_bounds_every_policy(trace, geometry, cap):
    optimum = exhaustive(trace, geometry, cap)
    assert packed(trace, geometry, cap) == optimum
    b = bound(packing(trace, geometry), cap)
    assert b.upper >= optimum - 1e-6
    assert b.schedule <= optimum
    assert b.upper <= b.unlimited + 1e-6


def test_a_bound_that_ignores_vllms_own_cache_is_rejected():
    """The assertion above can fail: an oracle that leaves out vLLM's block pool (a bound
    of the connector's CPU store alone) falls below the optimum on some tiny trace."""

    def cpu_only_below_optimum(case: tuple[Trace, Geometry, Capacity]) -> bool:
        trace, geometry, cap = case
        weaker = bound(packing(trace, geometry), Capacity(cap.cpu_bytes, 0))
        return weaker.upper < exhaustive(trace, geometry, cap) - 1e-6

    trace, geometry, cap = find(
        st.tuples(tiny_traces(), geometries(), capacities),
        cpu_only_below_optimum,
        settings=settings(
            max_examples=500,
            database=None,
            derandomize=True,
            deadline=None,
            phases=[Phase.generate],  # the first example found, unshrunk
        ),
    )
    print(f"seed {SEED}: CPU-only bound below the optimum on", [r.prompt for r in trace], cap)
