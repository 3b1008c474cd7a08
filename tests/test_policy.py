"""Checkpoint policy: which of the recurrent states the engine offers are kept."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from hybridkv.core.policy import CheckpointPolicy, StateAction


@st.composite
def policies(draw, name: str | None = None) -> CheckpointPolicy:
    chunk = draw(st.sampled_from([1, 4, 16, 64, 128]))
    name = name or draw(st.sampled_from(["prompt_and_end", "every_chunk"]))
    return CheckpointPolicy(name, chunk)


@given(pol=policies(), n=st.integers(0, 5000))
def test_prompt_checkpoint_is_the_last_boundary_before_the_prompt_end(pol, n):
    ck = pol.prompt_checkpoint(n)
    C = pol.chunk_tokens
    assert ck % C == 0
    assert 0 <= ck < max(n, 1)  # never the whole prompt: one token is left to compute
    assert ck + C >= n  # and no later boundary would leave one
    if n > 0:
        assert ck <= n - 1


# Boundaries are drawn around the prompt's checkpoint (drawn apart, they met it in none
# of a hundred examples): before it, at it and after it, each often.
@given(pol=policies("prompt_and_end"), n=st.integers(0, 3000), offset=st.integers(-3, 3))
def test_prompt_and_end_decides_by_the_prompt_checkpoint(pol, n, offset):
    ck = pol.prompt_checkpoint(n)
    boundary = ck + offset * pol.chunk_tokens
    assume(boundary > 0)
    action = pol.decide(boundary, n)
    if boundary == ck:
        assert action is StateAction.STORE
    elif boundary > ck:
        assert action is StateAction.STAGE
    else:
        assert action is None


def test_prompt_and_end_examples():
    pol = CheckpointPolicy("prompt_and_end", 64)
    assert pol.prompt_checkpoint(300) == 256
    assert pol.prompt_checkpoint(257) == 256
    assert pol.prompt_checkpoint(256) == 192
    assert pol.decide(256, 300) is StateAction.STORE
    assert pol.decide(192, 300) is None
    assert pol.decide(320, 300) is StateAction.STAGE  # a decode boundary: newest wins


@given(pol=policies("every_chunk"), n=st.integers(0, 3000), boundary=st.integers(1, 4000))
def test_every_chunk_stores_every_boundary(pol, n, boundary):
    assert pol.decide(boundary * pol.chunk_tokens, n) is StateAction.STORE


@given(
    pol=policies("prompt_and_end"),
    n=st.integers(0, 3000),
    offset=st.integers(-3, 3),
    fork=st.integers(-1, 1),
    inside=st.integers(0, 127),
)
def test_the_branch_point_is_stored_as_well(pol, n, offset, fork, inside):
    """The branch point, drawn near the boundary (at it, a chunk off), anywhere inside
    its chunk (vLLM's hash blocks may be finer than a state's)."""
    C = pol.chunk_tokens
    ck = pol.prompt_checkpoint(n)
    boundary = ck + offset * C
    assume(boundary > 0)
    junction = max(boundary + fork * C, 0) + inside % C
    action = pol.decide(boundary, n, junction)
    if boundary == junction // C * C and boundary < ck:
        assert action is StateAction.STORE
    else:  # the junction changes nothing else
        assert action is pol.decide(boundary, n)


def test_branch_point_examples():
    pol = CheckpointPolicy("prompt_and_end", 64)
    assert pol.decide(128, 300, junction=128) is StateAction.STORE  # fork inside the prompt
    # vLLM's hash blocks may be finer than a state's: a fork inside chunk [128, 192)
    # is checkpointed at 128.
    assert pol.decide(128, 300, junction=144) is StateAction.STORE
    assert pol.decide(64, 300, junction=32) is None  # inside the first chunk: no state
    assert pol.decide(192, 300, junction=128) is None  # not the fork
    assert pol.decide(320, 300, junction=320) is StateAction.STAGE  # past the checkpoint
