"""A CPU offloading spec for vLLM's own `OffloadingConnector` on vLLM's CPU build.

vLLM 0.32's `CPUOffloadingSpec` refuses any platform but CUDA-alike and XPU GPUs in
`get_worker` ("CPU Offloading is currently only supported on ..."). This spec keeps
everything of it on the scheduler side (its chunk budget from `cpu_bytes_to_use`,
`CPUOffloadingManager` with the same LRU or ARC policy) and swaps the worker for a
synchronous one that copies pages between the engine's KV tensors and a host int8
tensor with plain torch indexing. It is the baseline hybridkv is measured against
(bench/hit_rate.py), so it also counts what it stores, evicts and loads per group.

    KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "CPUSyncOffloadingSpec",
            "spec_module_path": "hybridkv.benchmarks.offloading_cpu", "cpu_bytes_to_use": N})
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class CountingCPUOffloadingManager(CPUOffloadingManager):
    """vLLM's manager, unchanged, counting keys per KV cache group (as `str(group)`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_counts: dict[str, Counter[str]] = {
            k: Counter() for k in ("stored", "evicted", "loaded", "store_refused")
        }

    def _count(self, what: str, keys) -> None:
        self.group_counts[what].update(str(get_offload_group_idx(k)) for k in keys)

    def prepare_store(self, keys, req_context):
        keys = list(keys)
        out = super().prepare_store(keys, req_context)
        if out is None:
            self._count("store_refused", keys)
        else:
            self._count("stored", out.keys_to_store)
            self._count("evicted", out.evicted_keys)
        return out

    def prepare_load(self, keys, req_context):
        self._count("loaded", keys)
        return super().prepare_load(keys, req_context)


class SyncCPUOffloadingWorker(OffloadingWorker):
    """Copies at submit time; `get_finished` reports the jobs at the next call."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self.per_chunk = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        self.engine = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        # One host row per engine block a chunk holds: chunk c is rows [c * per, (c+1) * per).
        self.host = [
            torch.zeros((num_chunks * blocks_per_chunk, t.page_size_bytes), dtype=torch.int8)
            for t in kv_caches.tensors
        ]
        self._done: list[TransferResult] = []
        self.stored_bytes = 0
        self.loaded_bytes = 0

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, store: bool) -> bool:
        per, nbytes, g_off, c_off = self.per_chunk, 0, 0, 0
        for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if n == 0:
                continue
            skip = first % per  # the group's first block may start inside a chunk
            chunks = cpu.block_ids[c_off : c_off + -(-(n + skip) // per)].astype(np.int64)
            c_off += len(chunks)
            rows = (chunks[:, None] * per + np.arange(per)).ravel()[skip : skip + n]
            blocks = torch.from_numpy(gpu.block_ids[g_off : g_off + n].astype(np.int64))
            g_off += n
            rows_t = torch.from_numpy(rows)
            for ref in self.refs[g]:
                p, eng, host = (
                    ref.page_size_bytes,
                    self.engine[ref.tensor_idx],
                    self.host[ref.tensor_idx],
                )
                if store:
                    host[rows_t, :p] = eng[blocks, :p]
                else:
                    eng[blocks, :p] = host[rows_t, :p]
                nbytes += n * p
        if store:
            self.stored_bytes += nbytes
        else:
            self.loaded_bytes += nbytes
        self._done.append(TransferResult(job_id, True, nbytes, 0.0))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished when it was submitted


class CPUSyncOffloadingSpec(CPUOffloadingSpec):
    """`CPUOffloadingSpec` with a counting manager and a worker that runs on CPU."""

    def get_manager(self) -> CountingCPUOffloadingManager:
        if not self._manager:
            self._manager = CountingCPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> SyncCPUOffloadingWorker:
        if self.config.canonical_layout:
            raise ValueError("CPUSyncOffloadingSpec: canonical_layout is not supported")
        if not self._worker:
            self._worker = SyncCPUOffloadingWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        return self._worker
