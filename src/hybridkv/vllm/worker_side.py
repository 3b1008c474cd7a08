"""Worker side of the connector: copies between the engine's KV cache and the tiers."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from hybridkv.core.canonical import build_canonical
from hybridkv.core.copy_engine import CopyEngine
from hybridkv.core.layout import GroupKind
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.store import TieredStore
from hybridkv.vllm.metadata import HybridKVMetadata

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, planner: Planner, store: TieredStore):
        self.planner = planner
        self.store = store
        self.copies: CopyEngine | None = None
        # Keys of the staged (newest decode-time) states each running request inserted.
        self._staged: dict[str, list[bytes]] = {}
        self._load_errors: set[int] = set()
        self._pending_scatters: list[tuple[EntryCopy, torch.Tensor]] = []
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
        kv = build_canonical(kv_caches, group_layers, num_blocks)
        for g in range(len(group_layers)):
            expected = self.planner.groups[g].block_bytes
            if kv.block_bytes(g) != expected:
                raise ValueError(
                    f"group {g}: registered caches hold {kv.block_bytes(g)} bytes a block, "
                    f"the layout says {expected}"
                )
        self.copies = CopyEngine(kv, self.store.pool)

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
        states: list[tuple[EntryCopy, torch.Tensor]] = []
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
                is_state = self.planner.groups[kc.copy.group].kind is GroupKind.STATE
                (states if is_state else self._pending_scatters).append((kc.copy, entry))
        self._scatter(states)

    def restore_blocks(self) -> None:
        """Phase 2 of a load, just before the forward."""
        self._scatter(self._pending_scatters)
        self._pending_scatters = []

    def _scatter(self, loads: list[tuple[EntryCopy, torch.Tensor]]) -> None:
        self.copies.scatter(loads)
        for c, _ in loads:
            self.loaded_blocks += len(c.block_ids)
            self.loaded_bytes += len(c.block_ids) * self.planner.groups[c.group].block_bytes

    def save(self, meta: HybridKVMetadata) -> None:
        """Copy this step's new chunks out while their blocks are sure to be intact: every
        entry of the step in one batch, then into the tiers."""
        staged = [
            (job.req_id, kc)
            for job in meta.stores
            for kc in job.staged
            if not self.store.contains(kc.key)
        ]
        stores = [kc for job in meta.stores for kc in job.copies]
        entries = self.copies.gather([kc.copy for kc in stores] + [kc.copy for _, kc in staged])
        for kc, entry in zip(stores, entries[: len(stores)], strict=True):
            if self.store.put(kc.key, entry):
                self.stored_entries += 1
        inserted: dict[str, list[bytes]] = {job.req_id: [] for job in meta.stores if job.staged}
        for (req_id, kc), entry in zip(staged, entries[len(stores) :], strict=True):
            if self.store.put(kc.key, entry):
                inserted[req_id].append(kc.key)
                self.stored_entries += 1
        for req_id, keys in inserted.items():
            self._replace_staged(req_id, keys)

    def _replace_staged(self, req_id: str, inserted: list[bytes]) -> None:
        """Drop the state a request staged before its newest one, so the state at its last
        boundary is what survives the request. The newest is stored at once rather than
        at request end: the next turn may be looked up before the engine takes another
        step."""
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
