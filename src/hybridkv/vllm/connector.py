"""`HybridKVConnector`: the vLLM KV connector, a thin shell over the two sides.

vLLM builds one instance per role. Both roles of one engine live in the engine-core
process when tensor parallelism is 1 (the only case supported so far), so they share one
`TieredStore` through a per-process registry keyed by the engine id: the scheduler side
looks entries up, the worker side moves the bytes.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from hybridkv.core.config import ConfigError, HybridKVConfig
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.core.store import TieredStore
from hybridkv.vllm.layout import group_layer_pages, layout_from_vllm
from hybridkv.vllm.scheduler_side import SchedulerSide
from hybridkv.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_stores: dict[str, TieredStore] = {}
_stores_lock = threading.Lock()


def _shared_store(engine_id: str, config: HybridKVConfig, layout: Layout, pin: bool) -> TieredStore:
    with _stores_lock:
        store = _stores.get(engine_id)
        if store is None:
            store = _stores[engine_id] = TieredStore.from_config(config, layout, pin)
        return store


def _close_store(engine_id: str) -> None:
    with _stores_lock:
        store = _stores.pop(engine_id, None)
    if store is not None:
        store.close()


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = HybridKVConfig.from_dict(ktc.kv_connector_extra_config)
        if vllm_config.parallel_config.world_size > 1:
            raise ConfigError(
                "tensor_parallel_size: hybridkv supports one worker per engine for now"
            )
        model_id = self.config.model_id or str(vllm_config.model_config.model)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, model_id)
        self.planner = Planner(self.layout.groups, self.config.chunk_tokens)
        state_groups = [g for g in self.layout.groups if g.kind is GroupKind.STATE]
        policy = None
        enabled = True
        if state_groups:
            mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
            if mode != "align":
                # Without "align", vLLM keeps one running state per request and no
                # checkpoint at chunk boundaries: nothing restorable exists.
                log.warning(
                    "hybridkv: recurrent layers without prefix caching (mamba_cache_mode=%s);"
                    " offloading is off for this engine",
                    mode,
                )
                enabled = False
            if self.planner.chunk_tokens != state_groups[0].block_tokens:
                # vLLM materializes states at multiples of its state block only: a larger
                # chunk would leave the prompt checkpoint unstorable (silently no hits).
                raise ConfigError(
                    f"chunk_tokens: must equal the recurrent block size "
                    f"{state_groups[0].block_tokens} here, got {self.planner.chunk_tokens}"
                )
            policy = CheckpointPolicy(
                self.config.checkpoint_policy,
                self.planner.chunk_tokens,
                state_groups[0].block_tokens,
            )
        self.engine_id = ktc.engine_id
        # A CUDA cache copies to and from pinned host memory (full PCIe speed).
        pin = vllm_config.device_config.device_type == "cuda"
        store = _shared_store(self.engine_id, self.config, self.layout, pin)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.layout, self.planner, policy, store, enabled)
        else:
            self.worker_side = WorkerSide(self.planner, store)
        log.info(
            "hybridkv: %s side, chunk %d tokens, groups %s",
            role.name.lower(),
            self.planner.chunk_tokens,
            [(g.kind.value, g.block_tokens, g.block_bytes) for g in self.layout.groups],
        )

    # ---- scheduler side ------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request), None

    def reset_cache(self) -> bool:
        self.scheduler_side.reset()
        return True

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(
            kv_caches, group_layer_pages(self._kv_cache_config), self._kv_cache_config.num_blocks
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """The first hook of every step: restore recurrent states here (see worker_side)."""
        self.worker_side.fetch_and_restore_states(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.restore_blocks()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in `start_load_kv`, before the forward."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Recurrent layers never call this, so every group is saved at step end instead."""

    def wait_for_save(self) -> None:
        self.worker_side.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.worker_side.finished(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    # ---- both --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued disk writes; the first side to shut down closes the shared store."""
        _close_store(self.engine_id)
