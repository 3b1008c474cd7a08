"""Scheduler side of the connector: lookup, hit rule, and the per-step plan of copies.

Every hit is reported to vLLM as an asynchronous load. vLLM 0.32 under-counts the blocks
a *synchronous* external hit takes from a recurrent (align-mode Mamba/GDN) group: its
capacity check allows one new block per recurrent group, but admission then takes two,
one for the restored state (`allocate_external_computed_blocks`) and one for the running
state (`allocate_new_blocks`). With the pool nearly full that raised "Cannot get 1 free
blocks" inside the scheduler and killed the engine. An asynchronous load allocates only
the restored blocks first (counted right), and the request's next chunk is allocated in
a later step through the ordinary path.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from hybridkv.core.keys import extend_chain, group_key
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.planner import NULL_BLOCK, EntryCopy, Planner
from hybridkv.core.policy import CheckpointPolicy, StateAction
from hybridkv.core.store import TieredStore
from hybridkv.vllm.metadata import HybridKVMetadata, KeyedCopy, RequestLoad, RequestStore
from hybridkv.vllm.request_identity import KeyContext, key_context

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

STATS_LOG_SECONDS = 10.0


def _keyed(chain: list[bytes], plan: list[EntryCopy]) -> list[KeyedCopy]:
    return [KeyedCopy(group_key(chain[c.chunk], c.group), c) for c in plan]


@dataclass
class SchedulerStats:
    """Monotonic counters (they only ever grow)."""

    lookups: int = 0
    queried_tokens: int = 0  # prompt tokens beyond vLLM's own hit, at each admission lookup
    hit_tokens: int = 0  # tokens reported to vLLM as an external hit
    failed_plans: int = 0  # hits whose load could not be planned (reported failed)
    hook_errors: int = 0  # exceptions caught at the connector boundary


@dataclass
class _RequestState:
    request: Request
    # None: inputs hybridkv cannot key (no hit, no store for this request).
    ctx: KeyContext | None
    keys: list[bytes] = field(default_factory=list)  # chain keys of full chunks seen so far
    stored_chunks: int = 0  # chunks [0, stored_chunks) are handled for attention stores
    hit: tuple[int, int] | None = None  # (local tokens, boundary) of the held hit


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
        self._state_groups = [g for g, s in enumerate(layout.groups) if s.kind is GroupKind.STATE]
        self.stats = SchedulerStats()
        self._last_log = time.monotonic()

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager

    # ---- lookup -------------------------------------------------------------------------
    def _state(self, request: Request) -> _RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            ctx = key_context(request, self._fingerprint)
            st = self._reqs[request.request_id] = _RequestState(request, ctx)
        return st

    def _keys(self, st: _RequestState, num_tokens: int) -> list[bytes]:
        """Chain keys of the first `num_tokens` tokens' full chunks (`st.ctx` is set)."""
        tokens = st.request.all_token_ids[:num_tokens]
        C = self.planner.chunk_tokens
        return extend_chain(st.keys, st.ctx.seed, tokens, C, st.ctx.chunk_extras)

    def num_new_matched_tokens(self, request: Request, local_tokens: int) -> int:
        """The hit beyond vLLM's own, with every entry it needs already fetched and held.

        Fetching here, before the hit is reported, is what makes damaged, foreign or
        vanished entries a plain miss. A failed entry is excluded and the hit rule runs
        again, so the loop ends. vLLM asks again for a request it could not admit: the
        held hit is answered again without touching the tiers.
        """
        if not self.enabled:
            return 0
        st = self._state(request)
        if st.ctx is None:
            return 0
        if (
            st.hit is not None
            and st.hit[0] == local_tokens
            and self.store.is_held(request.request_id)
        ):
            return st.hit[1] - local_tokens
        self.store.release(request.request_id)
        st.hit = None
        L = request.num_prompt_tokens
        self.stats.lookups += 1
        self.stats.queried_tokens += max(L - local_tokens, 0)
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
                self.stats.hit_tokens += boundary - local_tokens
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
        """Plan the load of a reported hit. vLLM calls this a second time once the load
        is done (with no external tokens), and for requests without a hit."""
        req_id = request.request_id
        st = self._reqs.get(req_id)
        hit, st_hit = None, None
        if st is not None:
            st_hit, st.hit = st.hit, None
        if num_external == 0:
            self.store.release(req_id)
            return
        try:
            if st_hit is None or st_hit[1] - st_hit[0] != num_external:
                raise RuntimeError(f"allocation for {num_external} tokens matches no held hit")
            local, boundary = hit = st_hit
            plan = self.planner.load_plan(local, boundary, blocks.get_block_ids())
            copies = _keyed(st.keys, plan)
        except Exception:
            # vLLM waits for this load: it must still reach the worker, as a failure.
            log.exception("hybridkv: planning the load of %s failed", req_id)
            self.stats.failed_plans += 1
            self._loads.append(RequestLoad(req_id, [], failed=True))
            return
        self._loads.append(RequestLoad(req_id, copies))
        # What was loaded is stored already.
        st.stored_chunks = max(st.stored_chunks, hit[1] // self.planner.chunk_tokens)

    # ---- per-step plan ----------------------------------------------------------------------
    def build_meta(self, out: SchedulerOutput) -> HybridKVMetadata:
        """The step's loads, then its stores. Loads go out whatever happens to the stores:
        vLLM waits for each one to be reported."""
        meta = HybridKVMetadata(loads=self._loads)
        self._loads = []
        if not self.enabled:
            return meta
        try:
            meta.stores = self._plan_stores(out)
        except Exception:
            log.exception("hybridkv: planning this step's stores failed; none are made")
            self.stats.hook_errors += 1
        try:
            self._maybe_log_stats()
        except Exception:
            log.exception("hybridkv: reading stats for the log failed")
            self.stats.hook_errors += 1
        return meta

    def _plan_stores(self, out: SchedulerOutput) -> list[RequestStore]:
        C = self.planner.chunk_tokens
        offers = self._state_offers(out)
        stores = []
        for req_id in set(out.num_scheduled_tokens) | set(offers):
            st = self._reqs.get(req_id)
            if st is None or st.ctx is None:
                continue
            req = st.request
            n = out.num_scheduled_tokens.get(req_id, 0)
            start = req.num_computed_tokens
            end = min(start + n, req.num_tokens)
            chunks = range(st.stored_chunks, end // C) if n > 0 else range(0)
            states = offers.get(req_id, {})
            block_ids = None
            if n > 0 and end not in states and self._decode_boundary(req, start, end):
                block_ids = self._manager.get_block_ids(req_id)
                states[end] = self._decode_state(end, block_ids)
            store_at: list[EntryCopy] = []
            stage_at: list[EntryCopy] = []
            for boundary, copies in states.items():
                action = self.policy.decide(boundary, req.num_prompt_tokens)
                if action is StateAction.STORE:
                    store_at.extend(copies)
                elif action is StateAction.STAGE:
                    stage_at.extend(copies)
            if not chunks and not store_at and not stage_at:
                continue
            keys = self._keys(st, max([end, *states]))
            if chunks:
                st.stored_chunks = max(st.stored_chunks, end // C)
                if block_ids is None:
                    block_ids = self._manager.get_block_ids(req_id)
            attention = self.planner.store_plan(chunks, block_ids) if chunks else []
            copies = [
                kc for kc in _keyed(keys, attention + store_at) if not self.store.contains(kc.key)
            ]
            staged = _keyed(keys, stage_at)
            if copies or staged:
                stores.append(RequestStore(req_id, copies, staged))
        return stores

    def _decode_boundary(self, req: Request, start: int, end: int) -> bool:
        """Whether this step ends decoding on a chunk boundary past the prompt's
        checkpoint. vLLM hands off only prompt-time states (decode-time blocks get no
        hash), so this is the one state derived here: in align mode the running state
        sits in block `end / block - 1` when a step ends there, and stays until the next
        step retires that block (speculative decoding, which moves it, is refused)."""
        if self.policy is None or not self._state_groups or end <= start:
            return False
        C = self.planner.chunk_tokens
        return end % C == 0 and end > self.policy.prompt_checkpoint(req.num_prompt_tokens)

    def _decode_state(self, end: int, block_ids: tuple[list[int], ...]) -> list[EntryCopy]:
        i = end // self.planner.chunk_tokens - 1
        ids = [block_ids[g][i] if i < len(block_ids[g]) else NULL_BLOCK for g in self._state_groups]
        if NULL_BLOCK in ids:
            return []
        return [
            self.planner.state_copy(g, end, b) for g, b in zip(self._state_groups, ids, strict=True)
        ]

    def _state_offers(self, out: SchedulerOutput) -> dict[str, dict[int, list[EntryCopy]]]:
        """Recurrent states vLLM wrote in this step, from its own hand-off: per request,
        per chunk boundary, one copy per recurrent group. A boundary is kept only when
        every recurrent group offers it (a partial set can never serve a hit); states
        inside a chunk (finer checkpoint alignment) are not kept."""
        block_state = getattr(out, "kv_connector_block_state", None)
        if not self._state_groups or self.policy is None or block_state is None:
            return {}
        C = self.planner.chunk_tokens
        result: dict[str, dict[int, list[EntryCopy]]] = {}
        for req_id, offered in block_state.boundary_state_offloads.items():
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block_id, boundary in offered:
                if boundary > 0 and boundary % C == 0:
                    by_boundary.setdefault(boundary, {})[group] = block_id
            for boundary, blocks in by_boundary.items():
                if sorted(blocks) == self._state_groups:
                    result.setdefault(req_id, {})[boundary] = [
                        self.planner.state_copy(g, boundary, blocks[g]) for g in self._state_groups
                    ]
        return result

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= STATS_LOG_SECONDS:
            self._last_log = now
            log.info("hybridkv stats %s", json.dumps(self.snapshot()))

    def snapshot(self) -> dict:
        """Counters and gauges for logs and tests."""
        tiers = {name: asdict(s) for name, s in self.store.stats().items()}
        return {
            **asdict(self.stats),
            "held_entries": self.store.held_entries(),
            "tracked_requests": len(self._reqs),
            "tiers": tiers,
        }

    def request_finished(self, request: Request) -> bool:
        """Forget the request. Stores are copied out synchronously within each step, so no
        block is still being read and vLLM may free them at once. A load already planned
        keeps its held entries: the worker takes them (vLLM keeps the blocks until the
        load is reported)."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None and not any(job.req_id == request.request_id for job in self._loads):
            self.store.release(request.request_id)
        return False

    def reset(self) -> None:
        self.store.clear()
