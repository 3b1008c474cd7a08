"""Serving behaviour on a real engine: batches, multi-turn, bad configuration."""

from __future__ import annotations

import random

import pytest
from conftest import SEED, recomputed, tokens
from serving import real_difference

from hybridkv.engine import generate, scheduler_connector

pytestmark = pytest.mark.engine


def test_concurrent_mixed_hits_match_engine_without_connector(model_dirs, engine_factory):
    """16 requests at once, half restored by hybridkv, against an engine without the
    connector whose own prefix cache serves the same prefixes: the same hits and the same
    outputs, up to batch rounding (`LOGPROB_NOISE`): a restored request starts one step
    later than one of vLLM's own hits (its load is asynchronous), so the two engines
    batch the requests differently."""
    model = model_dirs["qwen3-next"]
    seen = [tokens(300 + 40 * i, seed=100 + i) for i in range(8)]
    fresh = [tokens(280 + 50 * i, seed=200 + i) for i in range(8)]
    batch = [p for pair in zip(seen, fresh, strict=True) for p in pair]
    plain = engine_factory(model, connector=False)
    generate(plain, seen, max_tokens=6)
    expected = generate(plain, batch, max_tokens=6)

    llm = engine_factory(model, {"cpu_bytes": "256MiB"})
    generate(llm, seen, max_tokens=6)
    llm.reset_prefix_cache()
    got = generate(llm, batch, max_tokens=6)
    hits = [g.num_cached_tokens for g in got]
    assert all(h > 0 for h in hits[0::2]), hits  # every seen prompt is restored
    assert all(h == 0 for h in hits[1::2]), hits  # fresh prompts miss
    assert hits == [e.num_cached_tokens for e in expected]
    differ = {
        i: at
        for i, (g, e) in enumerate(zip(got, expected, strict=True))
        if (at := real_difference(g, e)) is not None
    }
    assert not differ, differ


def test_next_turn_hits_state_at_end_of_previous_turn(model_dirs, engine_factory):
    """Marconi's rule: the state at the last boundary a request reached while decoding is
    kept, so the next turn (prompt + answer + new text) resumes past the old prompt."""
    llm = engine_factory(model_dirs["qwen3-next"], {"cpu_bytes": "256MiB"})
    C = scheduler_connector(llm).planner.chunk_tokens
    prompt = tokens(500, seed=300)
    first = generate(llm, [prompt], max_tokens=300, ignore_eos=True)[0]
    computed = len(prompt) + len(first.token_ids) - 1  # the last token is never fed
    llm.reset_prefix_cache()
    turn2 = prompt + first.token_ids + tokens(50, seed=301)
    restored = generate(llm, [turn2], max_tokens=8)[0]
    assert restored.num_cached_tokens == computed // C * C
    assert restored.num_cached_tokens > (len(prompt) - 1) // C * C
    reference = recomputed(llm, turn2)
    assert real_difference(restored, reference) is None, (restored, reference)


@pytest.mark.parametrize("arch", ["qwen3-next", "gemma3"])
def test_real_difference_tells_wrong_prefixes_from_batch_rounding(model_dirs, engine_factory, arch):
    """The negative control of every comparison up to batch rounding (`real_difference`):
    output from a prompt one chunk of which is another prompt's (what a restore of wrong
    KV computes) is told apart from the right output, while the same prompts run again in
    another batch are not. Measured (40 prompts, seeds 1-4): the chosen tokens' logprobs
    alone missed 2 to 8 wrong prefixes; with the best five, at most one."""
    rng = random.Random(SEED)
    llm = engine_factory(model_dirs[arch], connector=False)
    n, chunk = 20, 64

    def draw(k: int) -> list[int]:
        return [rng.randrange(1, 2000) for _ in range(k)]

    right = [draw(rng.randrange(200, 400)) for _ in range(n)]
    first = [draw(chunk) + p[chunk:] for p in right]
    late = [p[: -chunk - 16] + draw(chunk) + p[-16:] for p in right]
    outs = generate(llm, right + first + late, max_tokens=16)
    again = generate(llm, right[::-1], max_tokens=16)[::-1]
    ref = outs[:n]
    for name, wrong in (("first", outs[n : 2 * n]), ("late", outs[2 * n :])):
        missed = [i for i in range(n) if real_difference(ref[i], wrong[i]) is None]
        assert len(missed) <= 1, (name, missed)
    assert [i for i in range(n) if real_difference(ref[i], again[i]) is not None] == []


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytez": "1GiB"}, "cpu_bytez"),
        ({"cpu_bytes": "lots"}, "cpu_bytes"),
        ({"disk_bytes": "1GiB"}, "disk_bytes"),
        ({"disk_path": "/dev/null"}, "disk_path"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(model_dirs, engine_factory, extra, key):
    with pytest.raises(Exception) as info:
        engine_factory(model_dirs["qwen3"], extra)
    assert key in str(info.value)


@pytest.mark.parametrize(
    ("parallel", "key"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"data_parallel_size": 2}, "data_parallel_size"),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size"),
        ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size"),
        ({"distributed_executor_backend": "ray"}, "distributed_executor_backend"),
        ({"distributed_executor_backend": "external_launcher"}, "distributed_executor_backend"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, None),
        ({"tensor_parallel_size": 63, "distributed_executor_backend": "mp"}, None),
        ({"tensor_parallel_size": 64, "distributed_executor_backend": "mp"}, "tensor_parallel"),
        ({"distributed_executor_backend": "uni"}, None),
    ],
)
def test_process_layouts_without_per_step_channels_are_refused(parallel, key):
    """Workers must report to this engine's scheduler side through vLLM's per-step
    channels; layouts where they would not (or that are untested) fail at start, naming
    the setting."""
    from types import SimpleNamespace

    from hybridkv.core.config import ConfigError
    from hybridkv.vllm.connector import check_process_layout

    pc = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "distributed_executor_backend": None,
        **parallel,
    }
    config = SimpleNamespace(parallel_config=SimpleNamespace(**pc))
    if key is None:
        check_process_layout(config)
        return
    with pytest.raises(ConfigError, match=key):
        check_process_layout(config)
