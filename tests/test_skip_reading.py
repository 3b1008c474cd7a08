"""A request that reads no prefix cache: vLLM sets `skip_reading_prefix_cache` for prompt
logprobs (a restored prefix has no logprobs) and then discards whatever hit the connector
answers. hybridkv must not act on a lookup for it: no promotion from a lower tier (each
takes CPU room and a read), no lookup or hit counted. Through vLLM's real `Scheduler`
without a model (test_async_scheduling's `Engine`); the prompt is stored on disk by a
first engine, so only the second engine's lookup could start promotions."""

from __future__ import annotations

import pytest
from test_async_scheduling import Engine, _prompt, config_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return config_dir(tmp_path_factory)


def add_reading_no_cache(eng: Engine, req_id: str, prompt: list[int]):
    """As `Engine.add`, with prompt logprobs asked for (vLLM then skips its caches)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False, prompt_logprobs=1)
    req = Request(req_id, list(prompt), sp, None, block_hasher=eng.hasher)
    assert req.skip_reading_prefix_cache
    eng.sched.add_request(req)
    eng.requests[req_id] = req
    return req


def test_a_request_reading_no_cache_orders_no_promotion_and_counts_no_lookup(model_dir, tmp_path):
    disk = {"disk_path": str(tmp_path / "kv")}
    first = Engine(model_dir, False, seed=13, extra=disk)
    a = first.add("a", _prompt(40, 51), max_tokens=2)
    first.run()
    first.worker.close()
    prompt = list(a.prompt_token_ids)

    eng = Engine(model_dir, False, seed=13, extra=disk)
    side = eng.side
    eng.add("w", _prompt(40, 99), max_tokens=2)  # the workers' disks are listed after it
    eng.run(limit=100_000)
    assert side.index.ready() and side.stats.lookups == 1
    waits = side.stats.waits
    b = add_reading_no_cache(eng, "b", prompt)
    eng.run()
    assert b.is_finished() and eng.first_start["b"] == 0
    assert side.index.stats.promotions == 0 and side.index.stats.failed_promotions == 0
    assert side.stats.lookups == 1 and side.stats.waits == waits
    assert side.index.ledger.held_bytes == 0
    eng.worker.close()
    # The entries were there to be found: in another engine on the same disk, the same
    # prompt read as usual is promoted and hits.
    control = Engine(model_dir, False, seed=13, extra=disk)
    c = control.add("c", prompt, max_tokens=2)
    control.run(limit=100_000)
    assert c.is_finished() and control.first_start["c"] > 0
    assert control.side.index.stats.promotions > 0 and control.side.stats.lookups == 1
