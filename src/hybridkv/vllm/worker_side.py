"""Worker side of the connector: copies between the engine's KV cache and the tiers.

Every hit is an asynchronous load in vLLM's terms: the request waits (it is not
scheduled) while the step that carries its load runs, and is admitted once
`transfer_results` reports it received. So nothing of vLLM's own per-step work
(zeroing new blocks, copying a recurrent state into the running block) touches the
blocks while they are written, and a load that fails is reported for that one request,
which vLLM then recomputes: the only failure report it accepts from models with several
KV cache groups.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridkv.core.canonical import build_canonical
from hybridkv.core.copy_engine import CopyEngine
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.store import TieredStore
from hybridkv.vllm.metadata import HybridKVMetadata, RequestLoad

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """Monotonic counters (they only ever grow)."""

    loads: int = 0
    failed_loads: int = 0  # requests reported failed: vLLM recomputes them
    loaded_blocks: int = 0
    loaded_bytes: int = 0  # written into the KV cache by restores
    stored_entries: int = 0
    failed_stores: int = 0  # steps whose stores were dropped after an error
    hook_errors: int = 0  # exceptions caught at the connector boundary


@dataclass
class TransferResults:
    received: set[str]
    failed: set[str]


class WorkerSide:
    def __init__(self, planner: Planner, store: TieredStore):
        self.planner = planner
        self.store = store
        self.copies: CopyEngine | None = None
        # Keys of the staged (newest decode-time) states each running request inserted.
        self._staged: dict[str, list[bytes]] = {}
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self.stats = WorkerStats()

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

    def load(self, meta: HybridKVMetadata) -> None:
        """Write every load of the step into its blocks, one batch for all requests.

        Entries come from what the scheduler side fetched and held at lookup; the tiers
        are asked only if that is gone. A request with any entry missing, or whose copy
        fails, loads nothing and is reported failed.
        """
        batch: list[tuple[EntryCopy, torch.Tensor]] = []
        batch_reqs: list[str] = []
        for job in meta.loads:
            try:
                entries = self._entries(job)
            except Exception:
                log.exception("hybridkv: reading the entries of %s failed", job.req_id)
                entries = None
            if entries is None:
                self._fail(job.req_id)
                continue
            batch.extend((kc.copy, e) for kc, e in zip(job.copies, entries, strict=True))
            batch_reqs.append(job.req_id)
        if not batch_reqs:
            return
        try:
            self.copies.scatter(batch)
        except Exception:
            # Blocks may be half written; vLLM recomputes every one of these requests.
            log.exception("hybridkv: restoring %d requests failed", len(batch_reqs))
            for req_id in batch_reqs:
                self._fail(req_id)
            return
        self._received.update(batch_reqs)
        self.stats.loads += len(batch_reqs)
        for c, _ in batch:
            self.stats.loaded_blocks += len(c.block_ids)
            self.stats.loaded_bytes += len(c.block_ids) * self.planner.groups[c.group].block_bytes

    def _entries(self, job: RequestLoad) -> list[torch.Tensor] | None:
        held = self.store.release(job.req_id)
        if job.failed:
            return None
        entries = [held[kc.key] if kc.key in held else self.store.get(kc.key) for kc in job.copies]
        for e, kc in zip(entries, job.copies, strict=True):
            if e is None or e.numel() != self.planner.entry_bytes(kc.copy.group):
                log.warning("hybridkv: entries for %s vanished before load", job.req_id)
                return None
        return entries

    def _fail(self, req_id: str) -> None:
        self.stats.failed_loads += 1
        self._failed.add(req_id)

    def transfer_results(self) -> TransferResults:
        """Loads finished since the last call: failed ones are received too (vLLM must
        release the request from its wait either way)."""
        out = TransferResults(self._received | self._failed, self._failed)
        self._received, self._failed = set(), set()
        return out

    def save(self, meta: HybridKVMetadata) -> None:
        """Copy this step's new chunks out while their blocks are sure to be intact: every
        entry of the step in one batch, then into the tiers. A failure drops the step's
        stores (counted): a missed store costs a future hit, never correctness."""
        try:
            self._save(meta)
        except Exception:
            log.exception("hybridkv: storing a step failed; its entries are dropped")
            self.stats.failed_stores += 1

    def _save(self, meta: HybridKVMetadata) -> None:
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
                self.stats.stored_entries += 1
        inserted: dict[str, list[bytes]] = {job.req_id: [] for job in meta.stores if job.staged}
        for (req_id, kc), entry in zip(staged, entries[len(stores) :], strict=True):
            if self.store.put(kc.key, entry):
                inserted[req_id].append(kc.key)
                self.stats.stored_entries += 1
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
