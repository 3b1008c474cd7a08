"""vLLM's own OffloadingConnector on the CPU build, through hybridkv.benchmarks.offloading_cpu
(the baseline of the hit-rate benchmark)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SEED, tokens


def test_sync_worker_round_trip_with_partial_chunks():
    """Pages go to host chunks and back, per group, with two blocks per chunk and a
    group whose first block starts inside a chunk."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from hybridkv.benchmarks.offloading_cpu import SyncCPUOffloadingWorker

    page = 64
    gen = torch.Generator().manual_seed(SEED)
    engine = torch.randint(-128, 127, (20, page), dtype=torch.int8, generator=gen)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(engine, page)],
        [[CanonicalKVCacheRef(0, page)], [CanonicalKVCacheRef(0, 48)]],  # 2nd: unpadded 48
    )
    worker = SyncCPUOffloadingWorker(caches, blocks_per_chunk=2, num_chunks=6)
    # group 0: logical blocks 0..2 (engine 1, 2, 3) -> chunks 0, 1; group 1: logical
    # block 3 (engine 4), i.e. the second half of chunk 2.
    gpu = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[3, 1], block_indices=[0, 3])
    assert worker.submit_store(7, gpu, CPULoadStoreSpec([0, 1, 2]))
    assert worker.stored_bytes == 3 * page + 48
    before = engine.clone()
    engine[10:14] = 0
    dst = GPULoadStoreSpec([10, 11, 12, 13], group_sizes=[3, 1], block_indices=[0, 3])
    assert worker.submit_load(8, CPULoadStoreSpec([0, 1, 2]), dst)
    assert torch.equal(engine[10:13], before[1:4])
    assert torch.equal(engine[13, :48], before[4, :48])
    assert not engine[13, 48:].any()  # the padding is not offloaded
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, True), (8, True)]
    assert worker.get_finished() == []
    assert np.array_equal(gpu.block_ids, [1, 2, 3, 4])  # inputs left alone


@pytest.mark.engine
def test_offloading_connector_restores_on_cpu(model_dirs):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hybridkv.benchmarks.offloading_cpu import SyncCPUOffloadingWorker
    from hybridkv.engine import generate, offline_env, shutdown

    offline_env()
    extra = {
        "spec_name": "CPUSyncOffloadingSpec",
        "spec_module_path": "hybridkv.benchmarks.offloading_cpu",
        "cpu_bytes_to_use": 64 << 20,
    }
    llm = LLM(
        model=model_dirs["qwen3-next"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=2048,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )
    try:
        prompt = tokens(1500, seed=21)
        cold = generate(llm, [prompt], 8)[0]
        native = generate(llm, [prompt], 8)[0]  # vLLM's own prefix cache
        llm.reset_prefix_cache()
        restored = generate(llm, [prompt], 8)[0]  # only the connector has it
        assert cold.num_cached_tokens == 0
        assert restored.num_cached_tokens > 0
        assert restored.num_cached_tokens == native.num_cached_tokens
        assert restored.token_ids == cold.token_ids
        assert restored.token_ids == native.token_ids
        assert restored.logprobs == native.logprobs
        worker = get_kv_transfer_group().connector_worker.worker
        assert isinstance(worker, SyncCPUOffloadingWorker)
        assert worker.loaded_bytes > 0 and worker.stored_bytes >= worker.loaded_bytes
        manager = (
            llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
        )
        # Every group (3 recurrent, 1 attention) was stored and loaded.
        assert len(manager.group_counts["stored"]) == 4
        assert len(manager.group_counts["loaded"]) == 4
    finally:
        shutdown(llm)
