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
        # Keys of the staged (newest decode-time) states each running request inserted.
        self._staged: dict[str, list[bytes]] = {}
        self._load_errors: set[int] = set()
        self._pending_scatters: list[tuple[torch.Tensor, KeyedCopy]] = []
        self.loaded_blocks = 0
        self.loaded_bytes = 0  # written into the KV cache by restores
        self.failed_loads = 0  # requests whose entries were gone at load time
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
        allocated attention blocks in between. Entries come from what the scheduler side
        fetched and held at lookup; the tiers are asked only if that is gone. A request
        with any entry missing loads nothing, and its blocks are reported as failed so
        vLLM recomputes them (vLLM accepts that for single-group models only).
        """
        for job in meta.loads:
            held = self.store.release(job.req_id)
            entries = [
                held[kc.key] if kc.key in held else self.store.get(kc.key) for kc in job.copies
            ]
            if not all(
                e is not None and e.numel() == self.planner.entry_bytes(kc.copy.group)
                for e, kc in zip(entries, job.copies, strict=True)
            ):
                log.warning("hybridkv: entries for %s vanished before load", job.req_id)
                self.failed_loads += 1
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
        self.loaded_bytes += len(c.block_ids) * self.planner.groups[c.group].block_bytes

    def _gather(self, kc: KeyedCopy) -> torch.Tensor:
        return gather_blocks(self.kv, kc.copy.group, kc.copy.block_ids)

    def save(self, meta: HybridKVMetadata) -> None:
        """Copy this step's new chunks out while their blocks are sure to be intact."""
        for job in meta.stores:
            for kc in job.copies:
                if self.store.put(kc.key, self._gather(kc)):
                    self.stored_entries += 1
            if job.staged:
                self._replace_staged(job.req_id, job.staged)

    def _replace_staged(self, req_id: str, staged: list[KeyedCopy]) -> None:
        """Store a request's newest boundary state and drop the one it staged before, so
        the state at its last boundary is what survives the request. It is stored at
        once rather than at request end: the next turn may be looked up before the
        engine takes another step."""
        inserted = []
        for kc in staged:
            if not self.store.contains(kc.key) and self.store.put(kc.key, self._gather(kc)):
                inserted.append(kc.key)
                self.stored_entries += 1
        for key in self._staged.pop(req_id, ()):
            self.store.delete(key)
        self._staged[req_id] = inserted

    def finished(self, finished_req_ids: set[str]) -> None:
        """A request ended: what it staged last stays stored."""
        for req_id in finished_req_ids:
            self._staged.pop(req_id, None)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
