"""Checkpoint policy: which recurrent-state boundaries exist and which are kept."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.policy import CheckpointPolicy, StateAction


@st.composite
def policies(draw, name: str | None = None) -> CheckpointPolicy:
    """Chunk sizes are multiples of the engine's state block size (the planner's rule)."""
    sbs = draw(st.sampled_from([1, 4, 16, 64]))
    chunk = sbs * draw(st.sampled_from([1, 1, 2, 4]))
    name = name or draw(st.sampled_from(["prompt_and_end", "every_chunk"]))
    return CheckpointPolicy(name, chunk, sbs)


@given(pol=policies(), n=st.integers(0, 5000))
def test_prompt_checkpoint_is_the_last_boundary_before_the_prompt_end(pol, n):
    ck = pol.prompt_checkpoint(n)
    C = pol.chunk_tokens
    assert ck % C == 0
    assert 0 <= ck < max(n, 1)  # never the whole prompt: one token is left to compute
    assert ck + C >= n  # and no later boundary would leave one
    if n > 0:
        assert ck <= n - 1


@settings(max_examples=200)
@given(pol=policies(), data=st.data())
def test_materialized_boundaries(pol, data):
    C, sbs = pol.chunk_tokens, pol.state_block_tokens
    n = data.draw(st.integers(0, 40 * C), label="prompt")
    start = data.draw(st.integers(0, 40 * C), label="start")
    end = data.draw(st.integers(start, start + 10 * C), label="end")
    got = pol.materialized(start, end, n)

    assert got == sorted(set(got))
    assert all(b % C == 0 and start < b <= end for b in got)
    engine_ckpt = max(n - 1, 0) // sbs * sbs
    expect = set()
    if start < engine_ckpt <= end and engine_ckpt % C == 0:
        expect.add(engine_ckpt)
    if end > start and end % sbs == 0 and end % C == 0 and end > 0:
        expect.add(end)
    assert set(got) == expect


def test_materialized_examples():
    pol = CheckpointPolicy("prompt_and_end", 64, 64)
    # Whole 300-token prompt in one step: the engine checkpoints at 256 only.
    assert pol.materialized(0, 300, 300) == [256]
    # A step that stops on a boundary materializes it, plus the checkpoint it crosses.
    assert pol.materialized(0, 128, 300) == [128]
    assert pol.materialized(128, 299, 300) == [256]
    assert pol.materialized(200, 320, 300) == [256, 320]
    assert pol.materialized(256, 300, 300) == []  # the checkpoint is not in (256, 300]
    assert pol.materialized(100, 100, 300) == []  # an empty step writes nothing
    assert pol.materialized(0, 0, 0) == []
    # A state block finer than the chunk: only chunk boundaries count.
    fine = CheckpointPolicy("prompt_and_end", 64, 16)
    assert fine.materialized(0, 80, 1000) == []
    assert fine.materialized(0, 128, 1000) == [128]
    assert fine.materialized(0, 1000, 1000) == []  # engine checkpoint 992 is no chunk boundary
    assert fine.materialized(0, 1100, 1025) == [1024]  # engine checkpoint 1024 is one


@settings(max_examples=200)
@given(
    chunk=st.sampled_from([4, 16, 64]),
    n=st.integers(1, 2000),
    cuts=st.lists(st.integers(1, 2000), max_size=8),
)
def test_chunked_prefill_always_materializes_the_prompt_checkpoint(chunk, n, cuts):
    """With state blocks the size of a chunk, some prefill step always writes the state
    the default policy wants to keep, however the scheduler cuts the prompt."""
    pol = CheckpointPolicy("prompt_and_end", chunk, chunk)
    steps = sorted({c for c in cuts if c < n} | {0, n})
    found = [b for s, e in pairwise(steps) for b in pol.materialized(s, e, n)]
    assert len(found) == len(set(found))  # no boundary is written by two steps
    ck = pol.prompt_checkpoint(n)
    if ck:
        assert ck in found
        assert pol.decide(ck, n) is StateAction.STORE
    assert set(found) == {b for b in steps if b and b % chunk == 0} | ({ck} - {0})


@given(pol=policies("prompt_and_end"), n=st.integers(0, 3000), boundary=st.integers(1, 4000))
def test_prompt_and_end_decides_by_the_prompt_checkpoint(pol, n, boundary):
    boundary *= pol.chunk_tokens
    ck = pol.prompt_checkpoint(n)
    action = pol.decide(boundary, n)
    if boundary == ck:
        assert action is StateAction.STORE
    elif boundary > ck:
        assert action is StateAction.STAGE
    else:
        assert action is None


def test_prompt_and_end_examples():
    pol = CheckpointPolicy("prompt_and_end", 64, 64)
    assert pol.prompt_checkpoint(300) == 256
    assert pol.prompt_checkpoint(257) == 256
    assert pol.prompt_checkpoint(256) == 192
    assert pol.decide(256, 300) is StateAction.STORE
    assert pol.decide(192, 300) is None
    assert pol.decide(320, 300) is StateAction.STAGE  # a decode boundary: newest wins


@given(pol=policies("every_chunk"), n=st.integers(0, 3000), boundary=st.integers(1, 4000))
def test_every_chunk_stores_every_boundary(pol, n, boundary):
    assert pol.decide(boundary * pol.chunk_tokens, n) is StateAction.STORE
