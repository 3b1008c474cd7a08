"""A restore from disk never stalls the engine: the scheduler never waits on a read.

The lookup of a hit whose entries are only on disk answers "ask again" while every rank
reads them in the background; meanwhile the engine keeps stepping, and a request that
is decoding gets its token in every step. Counted in engine steps, not wall time: before
this design the whole read ran inside one `schedule()` call, so there was no step in
which the restoring request waited and the others went on. Then the loads are written
into the KV cache a few entries a step (`load_step_bytes`), the decoder still getting
its token in every step, and the restored request's output is the one it had cold.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import tokens
from serving import real_difference

from hybridkv.engine import (
    TOP_LOGPROBS,
    drop_cpu_tier,
    drop_page_cache,
    generate,
    scheduler_connector,
    worker_connector,
)

pytestmark = pytest.mark.engine

DECODE = 100  # the decoder's tokens: it runs through the whole restore


@pytest.mark.parametrize("arch", ["qwen3-next", "gemma3"])
def test_decoding_goes_on_while_a_prefix_is_read_from_disk(
    arch, model_dirs, engine_factory, tmp_path
):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {
        "cpu_bytes": "256MiB",
        "disk_path": str(tmp_path),
        "disk_bytes": "1GiB",
        "load_step_bytes": 1,  # one entry a step
    }
    llm = engine_factory(model_dirs[arch], extra)
    long = tokens(3000, seed=41)
    cold = generate(llm, [long], max_tokens=4)[0]  # stores it
    drop_cpu_tier(llm)
    llm.reset_prefix_cache()
    assert drop_page_cache(tmp_path.rglob("*.kv")) > 0
    side = scheduler_connector(llm).scheduler_side
    worker = worker_connector().worker_side
    engine = llm.llm_engine

    def params(n: int, logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True, detokenize=False, logprobs=logprobs
        )

    decoder = TokensPrompt(prompt_token_ids=tokens(40, seed=42))
    engine.add_request("decoder", decoder, params(DECODE))
    decoded = 0
    while decoded < 3:  # decoding, past its prefill
        decoded = max([len(o.outputs[0].token_ids) for o in engine.step()] or [decoded])
    waits = side.stats.waits
    engine.add_request("restorer", TokensPrompt(prompt_token_ids=long), params(4, TOP_LOGPROBS))
    gains, waiting_steps, loading_steps, restored = [], 0, 0, None
    while engine.has_unfinished_requests():
        waiting = side.stats.waits
        outs = {o.request_id: o for o in engine.step()}
        if decoded < DECODE:  # a step without the decoder's token is a stall
            n = len(outs["decoder"].outputs[0].token_ids) if "decoder" in outs else decoded
            gains.append(n - decoded)
            decoded = n
            if side.stats.waits > waiting:
                waiting_steps += 1
            loading_steps += worker.restoring > 0
        if "restorer" in outs and outs["restorer"].finished:
            restored = outs["restorer"]
    # The read and the loads took steps of their own, and the decoder got a token in
    # every step.
    assert side.stats.waits > waits and waiting_steps >= 1
    assert loading_steps >= 3 and worker.restoring == 0
    assert decoded == DECODE and set(gains) == {1}, gains
    C = side.planner.chunk_tokens
    assert restored.num_cached_tokens == (len(long) - 1) // C * C
    out = restored.outputs[0]
    top = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
    chosen = [best[t] for best, t in zip(top, out.token_ids, strict=True)]
    got = SimpleNamespace(token_ids=list(out.token_ids), logprobs=chosen, top=top)
    assert real_difference(got, cold) is None, (got, cold)
    assert side.snapshot()["held_entries"] == 0
