"""vLLM KV cache events for what hybridkv can resume, published through vLLM's own
connector event hook (`take_events`, scheduler side) when `--kv-events-config` enables
them.

What is announced (core/resumable.py decides when): on each tier, the entries of every
boundary a hit could resume at from that tier alone — the full-attention chunks before
it, its sliding-window chunks, its recurrent states — as `BlockStored`, and `BlockRemoved`
once no such boundary is left for them. Each entry is one group's blocks for one chunk;
it is announced with vLLM's own block hashes of those blocks (`request.block_hashes`,
viewed at the group's block size, as vLLM's block pool does), their token ids, the parent
block's hash, the group's index and kind, LoRA and extra keys: the same payload vLLM's GPU
events carry, so a router hashes prompts the way it already does. A recurrent entry is
announced as the last block of its chunk (the block the state is held for). Tiers map to
vLLM's media: the CPU tier to `CPU`, the disk tier to `STORAGE`, both `locality="LOCAL"`
and `ownership="hybridkv"`. Redis is not announced: every replica reads it alike, so it
tells a router nothing about which replica to pick, and this replica cannot see what
other replicas or Redis's own eviction remove.

The payload of an entry is taken from the request that stored it (or restored it: after a
restart, disk entries are announced once a request has used them) and kept while the
tracker watches the entry; it is dropped after the announcement that retracts it.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm import envs
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from hybridkv.core.keys import group_key, token_bytes, tokens_from_bytes
from hybridkv.core.keytable import RowBytes
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.resumable import ResumableTracker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from hybridkv.core.index import StoreIndex

log = logging.getLogger(__name__)

MEDIA = {"cpu": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
OWNERSHIP = "hybridkv"
LOCALITY = "LOCAL"
_LOW64 = (1 << 64) - 1


def event_hash(block_hash: bytes, as_ints: bool) -> Any:
    """A block's hash as events carry it: where `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`
    asks for ints (`as_ints`, vLLM's default) what vLLM's `maybe_convert_block_hash`
    makes of it (tests/test_kv_events.py holds them equal), without its reading the
    environment at every call (once per step here)."""
    return int.from_bytes(block_hash, "big") & _LOW64 if as_ints else block_hash


class _Payload(NamedTuple):
    """What a `BlockStored` says of one entry's blocks, kept compact: the blocks' hashes
    as vLLM made them, joined (`width` bytes each), and their token ids as uint32 bytes,
    4 bytes a token (tuples of vLLM's token ints kept every stored token's int object
    alive: bench/lookup.py --events, docs/benchmarks.md). Kept pickled
    (`KVEvents._payloads`): a map of byte strings is one the garbage collector never
    walks, where one of tuples it walks whole in every full collection, an entry at a
    time, on the scheduler's thread."""

    group: int
    hashes: bytes
    width: int
    parent: bytes | None
    tokens: bytes
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None

    def block_hashes(self, as_ints: bool) -> list[Any]:
        w = self.width
        return [event_hash(self.hashes[i : i + w], as_ints) for i in range(0, len(self.hashes), w)]

    def last_hash(self) -> bytes:
        return self.hashes[-self.width :]


def kv_events(
    vllm_config: VllmConfig,
    layout: Layout,
    planner: Planner,
    kv_cache_config: KVCacheConfig,
    index: StoreIndex,
    below: bool,
) -> KVEvents | None:
    """The scheduler side's events when vLLM publishes KV cache events, else None.
    `below`: the engine has tiers below CPU memory."""
    cfg = vllm_config.kv_events_config
    if cfg is None or not cfg.enable_kv_cache_events:
        return None
    return KVEvents(layout, planner, kv_cache_config, index, disk=index.has_disk, below=below)


def _group(p: _Payload) -> int:
    return p.group


class KVEvents:
    """Follows what the index holds (it calls `changed`), learns payloads from requests
    (`observe`), and turns the tracker's announcements into vLLM events each step."""

    def __init__(
        self,
        layout: Layout,
        planner: Planner,
        kv_cache_config: KVCacheConfig,
        index: StoreIndex,
        disk: bool,
        below: bool = True,
    ):
        self.layout = layout
        self.planner = planner
        self.index = index
        self.hash_block_size = kv_cache_config.hash_block_size or planner.chunk_tokens
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self._kind = [get_kv_cache_spec_kind(s).value for s in specs]
        self._window = [get_kv_cache_spec_sliding_window(s) for s in specs]
        self._full = [g for g, s in enumerate(layout.groups) if s.kind is GroupKind.FULL]
        self._state = [g for g, s in enumerate(layout.groups) if s.kind is GroupKind.STATE]
        tiers = ("cpu", "disk") if disk else ("cpu",)
        # Boundaries restorable nowhere wait only where entries arrive by themselves
        # (disk writes landing, promotions): with CPU memory alone a boundary's entries
        # come back only with a request that stores or restores it, which registers it
        # again, and each one kept would hold its whole chain's payloads for nothing.
        self.tracker = ResumableTracker(tiers, self._present, keep_dormant=below)
        self._payloads = RowBytes()  # entry -> its `_Payload`, pickled
        self._final: list[KVCacheEvent] = []  # the retractions `stop` leaves to send
        self.broken = False  # an error in the tracker turned the events off

    def _present(self, tier: str, key: bytes) -> bool:
        return self.index.in_cpu(key) if tier == "cpu" else self.index.on_disk(key)

    # ---- what the index tells -------------------------------------------------------------
    # The index calls these in the middle of its own changes (an eviction, a promotion):
    # an error here must not leave one half done, so it turns the events off instead.
    def changed(self, tier: str, key: bytes, present: bool) -> None:
        if self.broken or tier not in self.tracker.tiers:
            return
        try:
            self.tracker.changed(tier, key, present)
        except Exception:
            self.stop()

    def cleared(self) -> None:
        if self.broken:
            return
        try:
            for tier in self.tracker.tiers:
                self.tracker.clear(tier)
        except Exception:
            self.stop()

    def stop(self) -> None:
        """After an error in the tracker: what it holds may be half changed, so no event
        from it can be trusted any more. The next `take` retracts, on every tier, each
        entry it may have announced (every one it keeps a payload of; a router ignores a
        removal of what it never had), so routers stop sending this replica prefixes on
        the word of announcements that will never be corrected."""
        log.exception("hybridkv: KV cache events failed; publishing no more of them")
        self.broken = True
        try:
            self._final = self._retract_all()
        except Exception:
            log.exception("hybridkv: retracting the KV cache events failed")
        self._payloads.clear()

    def _retract_all(self) -> list[KVCacheEvent]:
        as_ints = envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        payloads = [_Payload._make(pickle.loads(self._payloads[e])) for e in self._payloads.rows()]
        return [
            event
            for tier in self.tracker.tiers
            for event in _removed(payloads, MEDIA[tier], as_ints)
        ]

    # ---- what requests tell ---------------------------------------------------------------
    def observe(self, request: Request, keys: Sequence[bytes], boundaries: Sequence[int]) -> None:
        """The request stored (or restored) boundaries `boundaries` (tokens, chunk-aligned)
        of its chain `keys`: register the chunks they read and the boundaries, with the
        payloads of their entries."""
        if self.broken:
            return
        C = self.planner.chunk_tokens
        hashes = [
            resolve_block_hashes(request.block_hashes, self.hash_block_size, g.block_tokens)
            for g in self.layout.groups
        ]
        # The chunks only where boundaries hang on them (a layout without full attention
        # has none to announce, and chunks no boundary hangs on would never be freed).
        top = max(boundaries, default=0) // C if self._full else 0
        parent = None
        for c in range(top):
            key = keys[c]
            if not self.tracker.has_chunk(key):
                full = [group_key(key, g) for g in self._full]
                for g, e in zip(self._full, full, strict=True):
                    self._remember(e, request, hashes[g], g, c * C, (c + 1) * C)
                self.tracker.chunk(key, parent, full)
            parent = key
        for B in boundaries:
            if B <= 0 or B % C:
                continue
            c = B // C - 1
            needs = []
            for g, spec in enumerate(self.layout.groups):
                if spec.kind is GroupKind.FULL:
                    continue
                chunks = self.planner.needed_chunks(g, 0, B)
                # A state is held for the last block of its chunk.
                last = spec.block_tokens if spec.kind is GroupKind.STATE else C
                for k in chunks:
                    e = group_key(keys[k], g)
                    self._remember(e, request, hashes[g], g, (k + 1) * C - last, (k + 1) * C)
                    needs.append(e)
            bid = group_key(keys[c], self._state[0]) if self._state else keys[c]
            self.tracker.boundary(bid, keys[c] if self._full else None, needs)

    def _remember(
        self, entry: bytes, request: Request, hashes: Sequence[Any], g: int, start: int, end: int
    ) -> None:
        if entry in self._payloads:
            return
        bs = self.layout.groups[g].block_tokens
        first, last = start // bs, end // bs
        lora = request.lora_request
        extra = [
            generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)[0]
            for i in range(first, last)
        ]
        own = [hashes[i] for i in range(first, last)]
        width = len(own[0])
        if any(len(h) != width for h in own):
            raise ValueError("an entry's block hashes have one length")
        extra_keys = to_event_extra_keys(extra)
        payload = _Payload(
            group=g,
            hashes=b"".join(own),
            width=width,
            parent=hashes[first - 1] if first > 0 else None,
            tokens=token_bytes(request.all_token_ids[start:end]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=tuple(extra_keys) if extra_keys is not None else None,
        )
        self._payloads[entry] = pickle.dumps(tuple(payload), pickle.HIGHEST_PROTOCOL)

    # ---- out ------------------------------------------------------------------------------
    def take(self) -> list[KVCacheEvent]:
        """The step's events: one `BlockStored` per entry that became resumable on a tier,
        one `BlockRemoved` per (tier, group) for those that stopped being so. A fault
        here has consumed the tracker's changes: the events stop (`stop`), and this step
        sends their retraction instead."""
        if not self.broken:
            try:
                return self._take()
            except Exception:
                self.stop()
        final, self._final = self._final, []
        return final

    def _take(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        as_ints = envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        for a in self.tracker.take():
            medium = MEDIA[a.tier]
            known = [
                (e, _Payload._make(pickle.loads(p)))
                for e in a.entries
                if (p := self._payloads.get(e)) is not None
            ]
            if a.stored:
                # by group (stable: each group's entries stay in chain order)
                events += self._stored(sorted((p for _, p in known), key=_group), medium, as_ints)
                continue
            events += _removed([p for _, p in known], medium, as_ints)
        for entry in self.tracker.take_released():
            self._payloads.pop(entry)
        return events

    def _stored(self, payloads: list[_Payload], medium: str, as_ints: bool) -> list[BlockStored]:
        """One `BlockStored` per run of entries that continue each other (a chain's chunks
        in one group, each one's parent the last block of the one before), as vLLM's
        block pool sends a request's new blocks."""
        events: list[BlockStored] = []
        last: _Payload | None = None
        for p in payloads:
            e = events[-1] if events else None
            if (
                e is not None
                and last is not None
                and (p.group, p.block_size, p.lora_name)
                == (last.group, last.block_size, last.lora_name)
                and p.parent == last.last_hash()
            ):
                hashes = p.block_hashes(as_ints)
                e.block_hashes.extend(hashes)
                e.token_ids.extend(tokens_from_bytes(p.tokens))
                if e.extra_keys is not None or p.extra_keys is not None:
                    before = e.extra_keys or [None] * (len(e.block_hashes) - len(hashes))
                    e.extra_keys = before + list(p.extra_keys or [None] * len(hashes))
            else:
                events.append(
                    BlockStored(
                        block_hashes=p.block_hashes(as_ints),
                        parent_block_hash=(
                            event_hash(p.parent, as_ints) if p.parent is not None else None
                        ),
                        token_ids=tokens_from_bytes(p.tokens),
                        block_size=p.block_size,
                        lora_id=p.lora_id,
                        medium=medium,
                        lora_name=p.lora_name,
                        extra_keys=list(p.extra_keys) if p.extra_keys is not None else None,
                        group_idx=p.group,
                        kv_cache_spec_kind=self._kind[p.group],
                        kv_cache_spec_sliding_window=self._window[p.group],
                        locality=LOCALITY,
                        ownership=OWNERSHIP,
                    )
                )
            last = p
        return events


def _removed(payloads: Sequence[_Payload], medium: str, as_ints: bool) -> list[BlockRemoved]:
    """One `BlockRemoved` per group for `payloads` leaving `medium`."""
    by_group: dict[int, list[Any]] = {}
    for p in payloads:
        by_group.setdefault(p.group, []).extend(p.block_hashes(as_ints))
    return [
        BlockRemoved(
            block_hashes=hashes,
            medium=medium,
            group_idx=g,
            locality=LOCALITY,
            ownership=OWNERSHIP,
        )
        for g, hashes in by_group.items()
    ]
