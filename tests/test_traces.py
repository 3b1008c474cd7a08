"""Synthetic traces and trace readers (hybridkv.benchmarks.traces): determinism, shapes and the
sharing structure each workload is meant to have."""

from __future__ import annotations

import json

import pytest

from hybridkv.benchmarks.families import make_trace
from hybridkv.benchmarks.traces import (
    SYNTHETIC,
    Request,
    Trace,
    agentic_branching,
    document_qa,
    multi_turn_chat,
    read_mooncake,
    read_sharegpt,
    reuse_bound,
    with_max_tokens,
    word_token,
)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_deterministic_and_in_vocab(name):
    a, b = SYNTHETIC[name](seed=3, vocab=500), SYNTHETIC[name](seed=3, vocab=500)
    assert a.requests == b.requests
    assert SYNTHETIC[name](seed=4, vocab=500).requests != a.requests
    assert [r.arrival for r in a] == list(range(len(a)))
    assert all(1 <= t < 500 for r in a for t in r.prompt)
    assert all(r.max_tokens == 1 for r in a)


def test_trace_save_load_roundtrip(tmp_path):
    trace = agentic_branching(trees=2, branches=2, vocab=300)
    trace.save(tmp_path / "t.jsonl")
    back = Trace.load(tmp_path / "t.jsonl")
    assert back.requests == trace.requests
    assert (back.name, back.vocab) == (trace.name, trace.vocab)
    assert make_trace(f"file:{tmp_path / 't.jsonl'}").requests == trace.requests


def test_chat_turns_extend_previous_turn_and_share_system_prompts():
    trace = multi_turn_chat(sessions=5, turns=4, system_prompts=2, system_tokens=64, vocab=1000)
    assert len(trace) == 5 * 4
    by_session: dict[str, list] = {}
    for r in trace:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 5
    for reqs in by_session.values():
        assert [r.tag.split("/")[1] for r in reqs] == [f"turn{t}" for t in range(4)]
        for prev, nxt in zip(reqs, reqs[1:], strict=False):
            assert nxt.prompt[: len(prev.prompt)] == prev.prompt  # previous turn is a prefix
            assert len(nxt.prompt) > len(prev.prompt) + 1  # plus answer and user tokens
    systems = {r.tag.split("/")[0] for r in trace}
    firsts = [reqs[0].prompt[:64] for reqs in by_session.values()]
    assert len({tuple(p) for p in firsts}) == len(systems) <= 2
    # Sessions are interleaved: not all of one session before the next.
    sessions_in_order = [r.session for r in trace]
    assert sessions_in_order != sorted(sessions_in_order, key=sessions_in_order.index)


def test_agentic_branches_share_the_trunk():
    trace = agentic_branching(trees=2, trunk_steps=2, branches=3, branch_steps=2, vocab=1000)
    assert len(trace) == 2 * (2 + 3 * 2)
    for tree in ("tree0", "tree1"):
        reqs = [r for r in trace if r.session == tree]
        trunk = [r for r in reqs if r.tag.startswith("trunk")]
        first_steps = [r for r in reqs if r.tag.endswith("/step0") and r.tag.startswith("branch")]
        assert len(trunk) == 2 and len(first_steps) == 3
        last = trunk[-1].prompt
        for r in reqs:
            if r.tag.startswith("branch"):
                assert r.prompt[: len(last)] == last  # the trunk's last prompt is shared
        # Branches diverge right after the trunk's last prompt + its answer (the fork).
        forks = {_lcp(a.prompt, b.prompt) for a in first_steps for b in first_steps if a is not b}
        assert len(forks) == 1 and forks.pop() > len(last)
        # Each branch's steps extend its own previous step.
        for b in range(3):
            steps = [r.prompt for r in reqs if r.tag.startswith(f"branch{b}/")]
            assert steps[1][: len(steps[0])] == steps[0]
    # Trees share only the system prompt.
    t0 = next(r for r in trace if r.session == "tree0").prompt
    t1 = next(r for r in trace if r.session == "tree1").prompt
    assert _lcp(t0, t1) == 512


def test_docqa_documents_come_back_after_others():
    trace = document_qa(documents=4, questions=3, doc_tokens=200, system_tokens=32, vocab=1000)
    assert len(trace) == 12
    docs = [r.session for r in trace]
    for q in range(3):
        assert sorted(docs[4 * q : 4 * q + 4]) == [f"doc{d}" for d in range(4)]
    same = [r for r in trace if r.session == "doc2"]
    assert _lcp(same[0].prompt, same[1].prompt) >= 32 + 160  # system + the document
    other = next(r for r in trace if r.session == "doc1")
    assert _lcp(same[0].prompt, other.prompt) == 32


def test_reuse_bound_counts_shared_full_blocks():
    a = list(range(1, 41))
    b = a[:25] + [99] * 15
    trace = Trace("t", [Request(0, a), Request(1, b), Request(2, a)], 100)
    assert reuse_bound(trace, 10) == [0, 20, 30]  # full blocks only, never the last token
    assert trace.summary(10)["reusable_tokens"] == 50


def test_with_max_tokens_and_head():
    trace = with_max_tokens(document_qa(documents=2, questions=2, max_tokens=50), 4)
    assert {r.max_tokens for r in trace} == {4}
    assert len(trace.head(3)) == 3


def _mooncake(tmp_path, rows):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_mooncake_hash_ids_become_shared_tokens(tmp_path):
    path = _mooncake(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 1500, "output_length": 7, "hash_ids": [1, 2, 4]},
            {"timestamp": 9, "input_length": 300, "output_length": 3, "hash_ids": [5]},
        ],
    )
    trace = read_mooncake(path, vocab=1000)
    a, b, c = trace.requests
    assert [len(r.prompt) for r in trace] == [1200, 1500, 300]
    assert a.prompt[:1024] == b.prompt[:1024]  # hash ids 1, 2 shared
    assert a.prompt[1024:1030] != b.prompt[1024:1030]
    assert _lcp(a.prompt, c.prompt) < 5
    assert [r.max_tokens for r in trace] == [10, 7, 3]
    assert [r.timestamp for r in trace] == [0.0, 0.005, 0.009]
    assert read_mooncake(path, vocab=1000).requests == trace.requests
    # Scaled down: 64 tokens per hash id, lengths scaled alike, sharing kept.
    small = read_mooncake(path, vocab=1000, tokens_per_block=64, max_tokens=2)
    sa, sb, _ = small.requests
    assert [len(r.prompt) for r in small] == [150, 188, 38]
    assert sa.prompt[:128] == sb.prompt[:128] and sa.prompt[128:134] != sb.prompt[128:134]
    assert {r.max_tokens for r in small} == {2}
    assert len(read_mooncake(path, limit=2)) == 2
    spec = make_trace(f"mooncake:{path}:64", vocab=1000)
    assert [r.prompt for r in spec] == [r.prompt for r in small]


def test_sharegpt_turns_accumulate(tmp_path):
    data = [
        {
            "id": "x",
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hello there"},
                {"from": "gpt", "value": "hi how can I help"},
                {"from": "human", "value": "tell me more"},
                {"from": "gpt", "value": "ok"},
            ],
        },
        {
            "conversations": [
                {"from": "human", "value": "hello world"},
                {"from": "gpt", "value": "yes"},
            ]
        },
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    trace = read_sharegpt(path, vocab=100, concurrency=None)
    assert [(r.session, r.tag) for r in trace] == [("x", "turn0"), ("x", "turn1"), ("1", "turn0")]
    first, second, other = trace.requests
    ids = lambda text: [word_token(w, 100) for w in text.split()]  # noqa: E731
    assert first.prompt == ids("be brief hello there")
    assert second.prompt == ids("be brief hello there hi how can I help tell me more")
    assert other.prompt[:1] == ids("hello")
    assert [r.max_tokens for r in trace] == [5, 1, 1]
    assert all(1 <= t < 100 for r in trace for t in r.prompt)
    assert len(read_sharegpt(path, vocab=100, max_prompt_tokens=5)) == 2  # turn1 is too long
    assert read_sharegpt(path, vocab=100).requests[0].prompt  # interleaved by default


def test_make_trace_parameters():
    t = make_trace(
        "chat:sessions=2,turns=2,jitter=0.0,user_tokens=10,answer_tokens=5,system_tokens=8"
    )
    assert len(t) == 4
    assert sorted(len(r.prompt) for r in t) == [18, 18, 33, 33]
    with pytest.raises(ValueError):
        make_trace("nope")
