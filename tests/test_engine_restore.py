"""End to end on vLLM's CPU engine: real hybrid architectures restored through hybridkv.

Reference outputs come from vLLM's own prefix cache serving the same prefix from the same
KV bytes; a restore must match it exactly. (Recomputing the prefix is not a bit-exact
reference everywhere: on some CPUs the kernels round differently with the batch shape.)
"""

from __future__ import annotations

import pytest
from conftest import recomputed, tokens
from serving import real_difference

from hybridkv.core.keys import group_key
from hybridkv.core.layout import GroupKind
from hybridkv.engine import (
    generate,
    make_llm,
    scheduler_connector,
    shutdown,
    worker_connector,
)

pytestmark = pytest.mark.engine

ARCHS = ["qwen3-next", "gemma3", "qwen3", "gpt-oss"]


@pytest.fixture(scope="module", params=ARCHS)
def engine(request, model_dirs):
    llm = make_llm(model_dirs[request.param], {"cpu_bytes": "256MiB"})
    yield request.param, llm
    shutdown(llm)


def _chunk(llm) -> int:
    return scheduler_connector(llm).planner.chunk_tokens


def _native_then_restored(llm, prompt, max_tokens=8, salt=None):
    """Cold run (stores), native prefix hit (reference), then a restore by hybridkv."""
    cold = generate(llm, [prompt], max_tokens, salt=salt)[0]
    native = generate(llm, [prompt], max_tokens, salt=salt)[0]
    llm.reset_prefix_cache()
    restored = generate(llm, [prompt], max_tokens, salt=salt)[0]
    llm.reset_prefix_cache()
    return cold, native, restored


def test_restore_matches_native_prefix_hit(engine):
    arch, llm = engine
    prompt = tokens(700, seed=1)
    C = _chunk(llm)
    stats = worker_connector().worker_side.stats
    loaded_before, read_before = stats.loaded_bytes, sum(stats.read_bytes.values())
    loaded_blocks_before = stats.loaded_blocks
    cold, native, restored = _native_then_restored(llm, prompt)
    assert native.num_cached_tokens > 0, "vLLM's own prefix cache should hit"
    assert restored.num_cached_tokens >= len(prompt) - C
    assert restored.num_cached_tokens < len(prompt)
    # Exactly what resuming there needs: every full-attention block, a sliding group's
    # window behind the hit (not its whole prefix), one state per recurrent group.
    hit = restored.num_cached_tokens
    needed = {
        GroupKind.FULL: lambda s: hit // s.block_tokens,
        GroupKind.SLIDING: lambda s: (
            hit // s.block_tokens - max(hit - s.window, 0) // s.block_tokens
        ),
        GroupKind.STATE: lambda s: 1,
    }
    groups = scheduler_connector(llm).layout.groups
    loaded = stats.loaded_blocks - loaded_blocks_before
    assert loaded == sum(needed[s.kind](s) for s in groups), (arch, hit, groups)
    # and read from the tier no more than it wrote into the cache
    read = sum(stats.read_bytes.values()) - read_before
    assert read == stats.loaded_bytes - loaded_before > 0
    assert restored.token_ids == native.token_ids
    assert restored.logprobs == native.logprobs
    assert restored.token_ids == cold.token_ids
    assert restored.logprobs == pytest.approx(cold.logprobs, abs=0.05)


def test_shared_prefix_hits_only_shared_part(engine):
    arch, llm = engine
    C = _chunk(llm)
    first = tokens(560, seed=2)  # its prompt checkpoint is 512 for every tiny model here
    generate(llm, [first])
    llm.reset_prefix_cache()
    shared = 540
    second = first[:shared] + tokens(300, seed=3)
    restored = generate(llm, [second])[0]
    assert restored.num_cached_tokens == shared // C * C
    # The restored run computed the 300-odd tokens past its hit, the reference all of
    # them: other batch shapes, so the CPU kernels' rounding (on an AMD EPYC without
    # AVX-512, gpt-oss's first logprob moved by 3e-5 between two such runs).
    reference = recomputed(llm, second)
    assert real_difference(restored, reference) is None, (restored, reference)
    llm.reset_prefix_cache()


def test_branch_point_gets_a_state_and_serves_the_next_sibling(engine):
    """Prompts forking from one prefix inside an earlier prompt's chunk: no request has
    left a recurrent state at the fork, so the first sibling finds the shared attention
    chunks but no boundary. hybridkv has vLLM checkpoint the fork during that sibling's
    prefill (its shared-prefix junction), stores the state, and the next sibling resumes
    there, with vLLM's own prefix cache emptied between them."""
    arch, llm = engine
    side = scheduler_connector(llm).scheduler_side
    if not side._state_groups:
        pytest.skip("no recurrent groups: a hit needs no state at the fork")
    C = _chunk(llm)
    first = tokens(4 * C + 40, seed=41)  # its prompt checkpoint is at 4 chunks
    generate(llm, [first])
    llm.reset_prefix_cache()
    shared = 2 * C + 30
    asked = side.stats.junctions
    sibling = generate(llm, [first[:shared] + tokens(2 * C, seed=42)])[0]
    assert sibling.num_cached_tokens == 0, "no state at the fork before this sibling"
    assert side.stats.junctions == asked + 1
    llm.reset_prefix_cache()
    nxt = first[:shared] + tokens(2 * C, seed=43)
    restored = generate(llm, [nxt])[0]
    assert restored.num_cached_tokens == 2 * C
    reference = recomputed(llm, nxt)
    assert real_difference(restored, reference) is None, (restored, reference)
    llm.reset_prefix_cache()


def test_cache_salt_separates(engine):
    arch, llm = engine
    prompt = tokens(600, seed=4)
    generate(llm, [prompt], salt="tenant-a")
    llm.reset_prefix_cache()
    other = generate(llm, [prompt], salt="tenant-b")[0]
    assert other.num_cached_tokens == 0
    llm.reset_prefix_cache()
    same = generate(llm, [prompt], salt="tenant-a")[0]
    assert same.num_cached_tokens > 0
    llm.reset_prefix_cache()


def test_missing_state_gives_shorter_hit_not_wrong_answer(engine):
    """Delete the recurrent state at the best boundary: attention KV alone must never be
    reported as a hit (that is the garbled-output bug); the hit falls back to an earlier
    boundary whose state exists."""
    arch, llm = engine
    if arch != "qwen3-next":
        pytest.skip("needs recurrent-state groups")
    sched = scheduler_connector(llm).scheduler_side
    C = sched.planner.chunk_tokens
    base = tokens(900, seed=5)
    generate(llm, [base[:600]])  # stores the state at 512
    generate(llm, [base])  # stores the state at 768
    llm.reset_prefix_cache()
    state_groups = [g for g, s in enumerate(sched.layout.groups) if s.kind is GroupKind.STATE]
    from hybridkv.core.keys import chain_seed, chunk_keys

    keys = chunk_keys(chain_seed(sched.layout.fingerprint, None), base, C)
    best = (len(base) - 1) // C  # chunks in the best hit
    assert sched.index.in_cpu(group_key(keys[best - 1], state_groups[0]))
    # Drop one group's state only: the other groups' states and all attention KV remain.
    sched.index.delete(group_key(keys[best - 1], state_groups[0]))
    restored = generate(llm, [base])[0]
    assert restored.num_cached_tokens == 512
    reference = recomputed(llm, base)
    assert real_difference(restored, reference) is None, (restored, reference)
    llm.reset_prefix_cache()


def test_load_failing_after_the_hit_is_recomputed(engine, monkeypatch):
    """Entries vanish from the worker's memory between the reported hit and the load (a
    fault only injection can cause: the index pins what a hit needs). The worker reports
    the request's load as failed and vLLM, with kv_load_failure_policy="recompute",
    recomputes it: still the right answer, for hybrid models too."""
    arch, llm = engine
    side = scheduler_connector(llm).scheduler_side
    prompt = tokens(700, seed=6)
    # All restored blocks fail, so vLLM recomputes the prompt from its first token: the
    # same computation as the cold run (a prefix hit rounds differently on some CPUs).
    cold = generate(llm, [prompt])[0]
    llm.reset_prefix_cache()
    after_alloc = side.after_alloc

    def vanish(request, blocks, num_external):
        after_alloc(request, blocks, num_external)
        for job in side._loads:
            for kc in job.copies:
                worker_connector().worker_side.store.cpu.delete(kc.key)

    monkeypatch.setattr(side, "after_alloc", vanish)
    failed = worker_connector().worker_side.stats.failed_loads
    restored = generate(llm, [prompt])[0]
    assert worker_connector().worker_side.stats.failed_loads == failed + 1
    assert (restored.token_ids, restored.logprobs) == (cold.token_ids, cold.logprobs)
    llm.reset_prefix_cache()
