"""Scheduler side of the connector: lookup, hit rule, and the per-step plan of copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv.core.keys import chain_seed, extend_chain, group_key
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.policy import CheckpointPolicy, StateAction
from hybridkv.core.store import TieredStore
from hybridkv.vllm.metadata import HybridKVMetadata, KeyedCopy, RequestLoad, RequestStore

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def _keyed(chain: list[bytes], plan: list[EntryCopy]) -> list[KeyedCopy]:
    return [KeyedCopy(group_key(chain[c.chunk], c.group), c) for c in plan]


@dataclass
class _RequestState:
    request: Request
    seed: bytes
    keys: list[bytes] = field(default_factory=list)  # chain keys of full chunks seen so far
    stored_chunks: int = 0  # chunks [0, stored_chunks) are handled for attention stores
    hit: tuple[int, int] | None = None  # (local tokens, boundary) of the last lookup


class SchedulerSide:
    def __init__(
        self,
        layout: Layout,
        planner: Planner,
        policy: CheckpointPolicy | None,
        store: TieredStore,
        enabled: bool,
    ):
        self.layout = layout
        self.planner = planner
        self.policy = policy
        self.store = store
        self.enabled = enabled
        self._fingerprint = layout.fingerprint
        self._reqs: dict[str, _RequestState] = {}
        self._loads: list[RequestLoad] = []
        self._manager: KVCacheManager | None = None
        self._has_state = any(g.kind is GroupKind.STATE for g in layout.groups)

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager

    # ---- lookup -------------------------------------------------------------------------
    def _state(self, request: Request) -> _RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            seed = chain_seed(self._fingerprint, request.cache_salt)
            st = self._reqs[request.request_id] = _RequestState(request, seed)
        return st

    def _keys(self, st: _RequestState, num_tokens: int) -> list[bytes]:
        tokens = st.request.all_token_ids
        return extend_chain(st.keys, st.seed, tokens[:num_tokens], self.planner.chunk_tokens)

    def num_new_matched_tokens(self, request: Request, local_tokens: int) -> int:
        """The hit beyond vLLM's own, with every entry it needs already fetched and held.

        Fetching here, before the hit is reported, is what makes damaged, foreign or
        vanished entries a plain miss: vLLM cannot take back a reported hit of a model
        with several KV cache groups (it refuses block-level load errors for them). A
        failed entry is excluded and the hit rule runs again, so the loop ends.
        """
        self.store.release(request.request_id)
        if not self.enabled:
            return 0
        st = self._state(request)
        st.hit = None
        L = request.num_prompt_tokens
        keys = self._keys(st, L)
        failed: set[bytes] = set()

        def present(g: int, c: int) -> bool:
            if c >= len(keys):
                return False
            key = group_key(keys[c], g)
            return key not in failed and self.store.contains(key)

        while (boundary := self.planner.find_hit(L, local_tokens, present)) > local_tokens:
            entries = self._fetch(keys, local_tokens, boundary, failed)
            if entries is not None:
                self.store.hold(request.request_id, entries)
                st.hit = (local_tokens, boundary)
                return boundary - local_tokens
        return 0

    def _fetch(
        self, keys: list[bytes], local: int, boundary: int, failed: set[bytes]
    ) -> dict[bytes, torch.Tensor] | None:
        """Every entry a hit at `boundary` reads, or None after adding the bad ones to
        `failed`. Entries on disk are read in parallel."""
        wanted = {
            group_key(keys[c], g): self.planner.entry_bytes(g)
            for g in range(len(self.planner.groups))
            for c in self.planner.needed_chunks(g, local, boundary)
        }
        entries = self.store.get_many(list(wanted))
        for key, size in wanted.items():
            entry = entries.get(key)
            if entry is not None and entry.numel() != size:
                self.store.delete(key)  # cannot be this layout's: never ask again
                entry = None
            if entry is None:
                failed.add(key)
        return None if failed.intersection(wanted) else entries

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if num_external == 0:
            self.store.release(request.request_id)
            return
        st = self._reqs[request.request_id]
        assert st.hit is not None and st.hit[1] - st.hit[0] == num_external, (
            "hybridkv: allocation does not match the reported hit"
        )
        local, boundary = st.hit
        st.hit = None
        plan = self.planner.load_plan(local, boundary, blocks.get_block_ids())
        self._loads.append(RequestLoad(request.request_id, _keyed(st.keys, plan)))
        # What was loaded is stored already.
        st.stored_chunks = max(st.stored_chunks, boundary // self.planner.chunk_tokens)

    # ---- per-step plan ----------------------------------------------------------------------
    def build_meta(self, out: SchedulerOutput) -> HybridKVMetadata:
        meta = HybridKVMetadata(loads=self._loads)
        self._loads = []
        if not self.enabled:
            return meta
        C = self.planner.chunk_tokens
        for req_id, n in out.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or n <= 0:
                continue
            req = st.request
            start = req.num_computed_tokens
            end = min(start + n, req.num_tokens)
            chunks = range(st.stored_chunks, end // C)
            store_at, stage_at = [], []
            if self._has_state and self.policy is not None:
                for b in self.policy.materialized(start, end, req.num_prompt_tokens):
                    action = self.policy.decide(b, req.num_prompt_tokens)
                    if action is StateAction.STORE:
                        store_at.append(b)
                    elif action is StateAction.STAGE:
                        stage_at.append(b)
            if not chunks and not store_at and not stage_at:
                continue
            keys = self._keys(st, end)
            block_ids = self._manager.get_block_ids(req_id)
            st.stored_chunks = max(st.stored_chunks, end // C)

            copies = [
                kc
                for kc in _keyed(keys, self.planner.store_plan(chunks, store_at, block_ids))
                if not self.store.contains(kc.key)
            ]
            staged = _keyed(keys, self.planner.store_plan(range(0), stage_at, block_ids))
            if copies or staged:
                meta.stores.append(RequestStore(req_id, copies, staged))
        return meta

    def request_finished(self, request: Request) -> bool:
        """Forget the request. Stores are copied out synchronously within each step, so no
        block is still being read and vLLM may free them at once."""
        self._reqs.pop(request.request_id, None)
        self.store.release(request.request_id)
        return False

    def reset(self) -> None:
        self.store.clear()
