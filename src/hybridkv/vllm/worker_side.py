"""Worker side of the connector: copies between the engine's KV cache and the tiers."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from hybridkv.core.canonical import CanonicalKV, build_canonical, gather_blocks, scatter_blocks
from hybridkv.core.layout import GroupKind
from hybridkv.core.planner import Planner
from hybridkv.core.store import TieredStore
from hybridkv.vllm.metadata import HybridKVMetadata, KeyedCopy

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, planner: Planner, store: TieredStore):
        self.planner = planner
        self.store = store
        self.kv: CanonicalKV | None = None
        self._staged: dict[str, list[tuple[bytes, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()
        self._pending_scatters: list[tuple[torch.Tensor, KeyedCopy]] = []
        self.loaded_blocks = 0
        self.stored_entries = 0

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        group_layers: Sequence[Sequence[tuple[str, int]]],
        num_blocks: int,
    ) -> None:
        self.kv = build_canonical(kv_caches, group_layers, num_blocks)
        for g in range(len(group_layers)):
            expected = self.planner.groups[g].block_bytes
            if self.kv.block_bytes(g) != expected:
                raise ValueError(
                    f"group {g}: registered caches hold {self.kv.block_bytes(g)} bytes a block, "
                    f"the layout says {expected}"
                )

    def fetch_and_restore_states(self, meta: HybridKVMetadata) -> None:
        """Phase 1 of a load, at the very start of the step.

        vLLM copies a restored recurrent state out of its boundary block into the
        request's running block before the forward and before `start_load_kv`, so states
        must be in place this early. Attention blocks wait for phase 2: vLLM zeroes newly
        allocated attention blocks in between. A request with any entry missing loads
        nothing, and its blocks are reported as failed so vLLM recomputes them.
        """
        for job in meta.loads:
            entries = [self.store.get(kc.key) for kc in job.copies]
            if not all(
                e is not None and e.numel() == self.planner.entry_bytes(kc.copy.group)
                for e, kc in zip(entries, job.copies, strict=True)
            ):
                log.warning("hybridkv: entries for %s vanished before load", job.req_id)
                self._load_errors.update(b for kc in job.copies for b in kc.copy.block_ids)
                continue
            for entry, kc in zip(entries, job.copies, strict=True):
                if self.planner.groups[kc.copy.group].kind is GroupKind.STATE:
                    self._scatter(entry, kc)
                else:
                    self._pending_scatters.append((entry, kc))

    def restore_blocks(self) -> None:
        """Phase 2 of a load, just before the forward."""
        for entry, kc in self._pending_scatters:
            self._scatter(entry, kc)
        self._pending_scatters.clear()

    def _scatter(self, entry: torch.Tensor, kc: KeyedCopy) -> None:
        c = kc.copy
        scatter_blocks(self.kv, c.group, entry, c.slots, c.block_ids)
        self.loaded_blocks += len(c.block_ids)

    def _gather(self, kc: KeyedCopy) -> torch.Tensor:
        return gather_blocks(self.kv, kc.copy.group, kc.copy.block_ids)

    def save(self, meta: HybridKVMetadata) -> None:
        """Copy this step's new chunks out while their blocks are sure to be intact."""
        for job in meta.stores:
            for kc in job.copies:
                if self.store.put(kc.key, self._gather(kc)):
                    self.stored_entries += 1
            if job.staged:
                self._staged[job.req_id] = [(kc.key, self._gather(kc)) for kc in job.staged]

    def finished(self, finished_req_ids: set[str]) -> None:
        """A request ended: its newest staged state becomes a stored checkpoint."""
        for req_id in finished_req_ids:
            for key, entry in self._staged.pop(req_id, ()):
                if self.store.put(key, entry):
                    self.stored_entries += 1

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
