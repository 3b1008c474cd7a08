"""hybridkv inside vLLM's own `MultiConnector` (how users combine it with another
connector, e.g. a P/D transfer connector): the wrapper keeps hybrid KV cache management
on only when every child declares `SupportsHMA`, routes each child its own worker
metadata, and a hybrid model's prefix (Qwen3-Next: full attention + three recurrent
groups) is restored through it with vLLM's own output."""

from __future__ import annotations

import pytest
from conftest import tokens
from test_engine_disk import PROMPT, hit_tokens, same_output

from hybridkv.engine import CONNECTOR, generate, scheduler_connector

pytestmark = pytest.mark.engine


def multi(*children: dict) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def test_a_prefix_restored_through_multiconnector_matches_vllms_own_hit(model_dirs, engine_factory):
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    ours = {**CONNECTOR, "kv_connector_extra_config": {"cpu_bytes": "64MiB"}}
    llm = engine_factory(model_dirs["qwen3-next"], connector=multi(ours))
    wrapper = scheduler_connector(llm)
    assert isinstance(wrapper, MultiConnector)
    # Hybrid KV cache management stayed on: vLLM kept one group per layer kind.
    config = llm.llm_engine.vllm_config
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    (child,) = wrapper.sub_connectors
    assert len(child.layout.groups) > 1

    prompt = tokens(PROMPT, seed=70)
    generate(llm, [prompt], max_tokens=8)
    native = generate(llm, [prompt], max_tokens=8)[0]  # vLLM's own prefix hit
    llm.reset_prefix_cache()
    restored = generate(llm, [prompt], max_tokens=8)[0]
    assert restored.num_cached_tokens == hit_tokens(child.planner.chunk_tokens)
    assert same_output(vars(restored), vars(native))
    assert child.scheduler_side.stats.hit_tokens == restored.num_cached_tokens
