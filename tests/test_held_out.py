"""Held-out trace families (hybridkv.benchmarks.held_out, families): deterministic for a
seed, and with the published statistics their docstrings cite, within stated tolerances
(several standard errors at these sample sizes, so a failure means the generator is off,
not bad luck). Drawn with the run's HYBRIDKV_TEST_SEED (printed in the header)."""

from __future__ import annotations

import statistics

import pytest
from conftest import SEED

from hybridkv.benchmarks import held_out
from hybridkv.benchmarks.families import FAMILIES, HELD_OUT, TUNING, make_trace

SMALL = {
    "sharegpt-like": "conversations=6",
    "mooncake-like": "requests=40",
    "coding-agent": "tasks=2",
    "rag": "documents=60,requests=12",
    "mixture": "conversations=3,mooncake_requests=8,tasks=1,rag_requests=4",
    "issue29": "",
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_held_out_families_are_deterministic_for_a_seed(name):
    spec = f"{name}:{SMALL[name]},seed={SEED}"
    a, b = make_trace(spec, vocab=500), make_trace(spec, vocab=500)
    assert a.requests == b.requests and len(a) > 0
    other = make_trace(f"{name}:{SMALL[name]},seed={SEED + 1}", vocab=500)
    assert other.requests != a.requests
    assert [r.arrival for r in a] == list(range(len(a)))
    assert all(1 <= t < 500 for r in a for t in r.prompt)
    assert a.params["group"] == HELD_OUT


def test_every_family_has_a_group_and_the_tuning_ones_are_the_original_three():
    assert {n for n, f in FAMILIES.items() if f.group == TUNING} == {"chat", "agentic", "docqa"}
    assert {f.group for f in FAMILIES.values()} == {TUNING, HELD_OUT}
    assert make_trace("chat:sessions=2,turns=2").params["group"] == TUNING


def test_a_saved_trace_keeps_its_group(tmp_path):
    trace = make_trace("issue29")
    trace.save(tmp_path / "t.jsonl")
    assert make_trace(f"file:{tmp_path / 't.jsonl'}").params["group"] == HELD_OUT


def within(value: float, target: float, tolerance: float) -> bool:
    return abs(value - target) <= tolerance * target


def test_sharegpt_like_has_sharegpts_published_means():
    """3.51 turns, 94.46 user and 348.45 answer tokens (LMSYS-Chat-1M, Table 1): within
    3 % over 20,000 conversations (standard errors 0.6 %, 0.4 %, 0.4 %)."""
    plan = held_out.sharegpt_plan(20_000, SEED)
    turns = [len(c) for c in plan]
    assert within(statistics.mean(turns), 3.51, 0.03)
    assert within(statistics.mean(u for c in plan for u, _ in c), 94.46, 0.03)
    assert within(statistics.mean(a for c in plan for _, a in c), 348.45, 0.03)
    # The trace is built from the plan: each turn extends the previous prompt.
    trace = held_out.sharegpt_chat(conversations=20, seed=SEED)
    by_conv: dict[str, list] = {}
    for r in trace:
        by_conv.setdefault(r.session, []).append(r.prompt)
    for prompts in by_conv.values():
        for prev, nxt in zip(prompts, prompts[1:], strict=False):
            assert nxt[: len(prev)] == prev and len(nxt) > len(prev)


def test_mooncake_like_has_the_conversation_traces_statistics():
    """Mean input 12,035 and output 343 tokens (Mooncake's README) within 10 % and 5 %;
    an unlimited cache of 512-token blocks hits 0.366 of them (computed from the
    released trace) within 0.04; arrivals at 3.40/s for the full hour, scaled by the
    share of requests, within 5 %. 4,000 requests."""
    m = held_out.MOONCAKE
    records = held_out.mooncake_records(4000, SEED)
    assert within(statistics.mean(r["input_length"] for r in records), m.mean_input, 0.10)
    assert within(statistics.mean(r["output_length"] for r in records), m.mean_output, 0.05)
    seen: set[int] = set()
    hit = total = 0
    for r in records:
        ids = r["hash_ids"]
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hit, total = hit + n, total + len(ids)
        seen.update(ids)
        assert len(ids) == -(-r["input_length"] // m.block) and ids[0] == 0
    assert abs(hit / total - m.block_hit_ratio) <= 0.04
    rate = len(records) / (records[-1]["timestamp"] / 1e3)
    assert within(rate, m.rate_per_s * 4000 / m.requests_per_hour, 0.05)
    # As a trace: shared hash ids are shared tokens, lengths scaled, timestamps kept.
    trace = held_out.mooncake_like(requests=60, scale=1 / 16, seed=SEED)
    assert all(len(r.prompt) <= 4096 for r in trace)
    assert [r.timestamp for r in trace] == sorted(r.timestamp for r in trace)
    assert all(r.prompt[:32] == trace.requests[0].prompt[:32] for r in trace)


def test_coding_agent_has_the_published_loop_statistics():
    """30.2 turns per task (SWE-smith trajectories), issues of 195.1 words (SWE-bench),
    182-token actions (Mooncake tool-and-agent) and 83.9 % of tokens in tool output
    (The Complexity Trap): within 3 %, 3 %, 3 % and 0.01 over 10,000 tasks."""
    plan = held_out.agent_plan(10_000, SEED)
    assert within(statistics.mean(1 + len(steps) for _, steps in plan), 30.2, 0.03)
    assert within(statistics.mean(issue for issue, _ in plan), 195.1 * 4 / 3, 0.03)
    steps = [s for _, task in plan for s in task]
    assert within(statistics.mean(a for a, _ in steps), 182, 0.03)
    observed = sum(o for _, o in steps) / sum(a + o for a, o in steps)
    assert abs(observed - 0.839) <= 0.01
    trace = held_out.coding_agent(tasks=3, seed=SEED)
    for task in {r.session for r in trace}:
        prompts = [r.prompt for r in trace if r.session == task]
        assert all(b[: len(a)] == a for a, b in zip(prompts, prompts[1:], strict=False))


def test_rag_has_ragcaches_popularity_skew():
    """The most relevant passage comes from the top 3 % of documents in 60 % of the
    requests (RAGCache), within 0.03 over 3,000 requests; 10 distinct passages each."""
    plan = held_out.rag_plan(400, 3000, SEED)
    assert abs(sum(p[0] < 12 for p in plan) / len(plan) - 0.60) <= 0.03
    assert all(len(set(p)) == len(p) == 10 for p in plan)
    trace = held_out.rag_passages(documents=50, requests=5, seed=SEED)
    assert all(len(r.prompt) >= 10 * round(100 * 4 / 3) for r in trace)


def test_issue29_is_the_issues_case():
    trace = held_out.issue29(seed=SEED)
    assert len(trace) == 12 * 4 + 6 * 6
    heads = {tuple(r.prompt[:800]) for r in trace}
    assert len(heads) == 3
    forks = {r.session for r in trace if "/branch1/" in r.tag}
    assert len(forks) == 6
    for conv in forks:
        reqs = [r for r in trace if r.session == conv]
        turn1 = next(r for r in reqs if r.tag.endswith("/turn1")).prompt
        assert len(turn1) == 800 + 300 + 24 + 300
        third = [r.prompt for r in reqs if r.tag.endswith("/turn2")]
        assert len(third) == 2 and third[0][: len(turn1) + 24] == third[1][: len(turn1) + 24]
        assert third[0] != third[1] and len(third[0]) == len(turn1) + 24 + 300


def test_mixture_interleaves_every_family_in_its_own_order():
    trace = make_trace(f"mixture:{SMALL['mixture']},seed={SEED}")
    parts = {r.session.split("/")[0] for r in trace}
    assert parts == {"sharegpt-like", "mooncake-like", "coding-agent", "rag"}
    agent = [r.prompt for r in trace if r.session.startswith("coding-agent/")]
    assert all(b[: len(a)] == a for a, b in zip(agent, agent[1:], strict=False))
