"""Scheduler side of the connector: lookup, hit rule, and the per-step plan of copies.

It decides from the index (core/index.py) of what the workers hold and never touches
an entry's bytes: a lookup costs no I/O. A hit whose entries are all in the workers' CPU
memory is reported at once; one that needs disk entries has them promoted first and
answers "ask again" (None) until every rank has them, so a reported hit cannot fail.

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

import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import ChainMemo, extend_chain, group_key, group_keys, split_group_key
from hybridkv.core.keytable import first_found
from hybridkv.core.layout import GroupKind, Layout
from hybridkv.core.metrics import Figures
from hybridkv.core.planner import NULL_BLOCK, EntryCopy, Planner
from hybridkv.core.policy import CheckpointPolicy, StateAction
from hybridkv.core.probe import Probe
from hybridkv.vllm.handover import Handover
from hybridkv.vllm.kv_events import KVEvents
from hybridkv.vllm.metadata import (
    HybridKVMetadata,
    KeyedCopy,
    RequestLoad,
    RequestStore,
    TaggedCopy,
    TagName,
)
from hybridkv.vllm.request_identity import KeyContext, key_context
from hybridkv.vllm.split_guard import SplitGuard

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

STATS_LOG_SECONDS = 10.0
# A request waits this long at most for disk entries to reach CPU memory (or, at start,
# for the workers' disk listings); then its hit is planned without them.
PROMOTE_WAIT_SECONDS = 30.0
# Blocks vLLM keeps for a finished request's stores in flight count as frees to come for
# this many steps after the request finished (`frees_pending`). A store lands within a
# step or two of it on a GPU; a report that never comes must not stop vLLM from
# preempting for good.
FREE_WAIT_STEPS = 8


def _add(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


def _keyed(chain: list[bytes], plan: list[EntryCopy]) -> list[KeyedCopy]:
    return [KeyedCopy(group_key(chain[c.chunk], c.group), c) for c in plan]


@dataclass
class SchedulerStats:
    """Monotonic counters (they only ever grow)."""

    lookups: int = 0
    # Tokens beyond vLLM's own hit at each answered lookup: a prompt's, and a resumed
    # request's output so far.
    queried_tokens: int = 0
    hit_tokens: int = 0  # tokens loaded by hybridkv (a hit vLLM allocated)
    # The same by the tier a hit came from ("cpu", or the lower tier its entries were
    # promoted from; lookups: "none" for a miss), for the metrics.
    lookups_by_tier: dict[str, int] = field(default_factory=dict)
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    miss_tokens: int = 0  # queried tokens an answered lookup did not serve
    waits: int = 0  # lookups answered "ask again": disk entries on their way
    failed_plans: int = 0  # hits whose load could not be planned (reported failed)
    # Tokens of hits counted in hit_tokens whose load failed (vLLM recomputed them), by
    # the tier the hit came from.
    failed_load_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    hook_errors: int = 0  # exceptions caught at the connector boundary
    # Queried tokens past vLLM's own hit a lookup could not serve, by what stopped the hit
    # (a cap, not a forecast: tokens at and past the last boundary never count):
    short_of_chunks: int = 0  # the attention chunks stop there (never stored, or evicted)
    short_of_state: int = 0  # the chunks go further, but no boundary with every state does
    # Lookups that asked vLLM to checkpoint the state at the prompt's branch point.
    junctions: int = 0


@dataclass(frozen=True)
class _Tagged:
    """A store the workers gathered under `tag` before every token of its key was known
    (async scheduling): named once they are, dropped if they never will be."""

    tag: int
    end: int  # its key covers tokens [0, end)
    copy: EntryCopy
    staged: bool  # a decode-time state the policy stages
    preemptions: int  # the request's `num_preemptions` when it was gathered


@dataclass
class _RequestState:
    request: Request
    # None: inputs hybridkv cannot key (no hit, no store for this request).
    ctx: KeyContext | None
    keys: list[bytes] = field(default_factory=list)  # chain keys of full chunks seen so far
    stored_chunks: int = 0  # chunks [0, stored_chunks) are handled for attention stores
    hit: tuple[int, int] | None = None  # (local tokens, boundary) of the reported hit
    hit_source: str = "cpu"  # the tier the reported hit came from
    loading: int = 0  # tokens of its planned load (counted in hit_tokens)
    promoted_from: str | None = None  # the tier this lookup's wait promotes from
    waited_on: frozenset[bytes] = frozenset()  # the entries that wait was for
    waited_at: int = -1  # vLLM's own hit when it last waited for promotions
    pins: list[bytes] = field(default_factory=list)  # entries its hit or wait needs
    waiting_since: float | None = None  # first "ask again" of this wait
    # Its newest decode-time state: pinned, in CPU memory only until it finishes.
    staged: list[bytes] = field(default_factory=list)
    load_failed: bool = False  # vLLM recomputes it: no more hits for it
    # The latest answered lookup's figures (`_count_lookup`'s arguments), counted once
    # vLLM allocates for the request: a request vLLM cannot allocate for yet asks again
    # every step, and counting each answer would count its prompt again and again.
    answer: tuple[int, int, int, int, str] | None = None
    junction: bool = False  # that lookup asked for a checkpoint (counted with it)
    tagged: list[_Tagged] = field(default_factory=list)  # gathered, not named yet
    drafted: bool = False  # has had speculative tokens: keyed on known tokens only
    # Attention chunks it stored, pinned until it finishes (with recurrent groups: they
    # serve no hit until its boundary is stored, so they must not go as orphans first).
    owned: list[bytes] = field(default_factory=list)
    # (its `num_preemptions`, the step) when a store was last planned on its blocks
    # (None: none since vLLM allocated them): its finish may wait for that store.
    stored_at: tuple[int, int] | None = None


class SchedulerSide:
    def __init__(
        self,
        layout: Layout,
        planner: Planner,
        policy: CheckpointPolicy | None,
        index: StoreIndex,
        enabled: bool,
        below: bool,
        tiers: Sequence[tuple[str, float]] = (),
        probe: Probe | None = None,
        split_guard: SplitGuard | None = None,
        events: KVEvents | None = None,
        stores_land_in_step: bool = False,
        hash_block_size: int | None = None,
    ):
        """`below`: the workers have a tier below CPU memory that takes stores (one
        without CPU room still goes there). `tiers`: the tiers below CPU memory a hit
        may be promoted from, fastest first, with their load weights. `probe`: asks
        the shared tier what it holds. `split_guard`: keeps vLLM's prefill split on
        the recurrent blocks (vllm/split_guard.py), checked at every lookup. `events`:
        vLLM KV cache events for what can be resumed (vllm/kv_events.py), if enabled;
        it follows the index and learns block hashes from the requests here.
        `stores_land_in_step`: every store has landed by the time vLLM finishes the
        requests of its step (a CPU cache with one batch in flight, i.e. neither async
        scheduling nor pipeline stages: the workers' copies run within `wait_for_save`,
        before the step's output comes back, and no later step is scheduled meanwhile),
        so no finished request's blocks need keeping (`request_finished`).
        `hash_block_size`: the tokens a block hash of vLLM's fingerprints, where that
        hash is collision resistant (sha256); then chains are remembered under those
        hashes and a prompt extending one seen lately hashes only its tail
        (core/keys.py's `ChainMemo`). None: every prompt is keyed whole."""
        self.layout = layout
        self.planner = planner
        self.policy = policy
        self.index = index
        self.enabled = enabled
        self.below = below
        self.tiers = list(tiers)
        # Tiers a worker reported down (by rank), and all of them: no hit is planned from
        # one until every worker has it back (`worker_reports`).
        self._down: dict[int, set[str]] = {}
        self._tiers_down: set[str] = set()
        self.probe = probe
        self.split_guard = split_guard
        self.events = events
        self.stores_land_in_step = stores_land_in_step
        if events is not None:
            index.listener = events
        self._fingerprint = layout.fingerprint
        C = planner.chunk_tokens
        # vLLM's block hashes a chunk spans, where whole blocks make a chunk.
        self._hashes_per_chunk = (
            C // hash_block_size if hash_block_size and not C % hash_block_size else 0
        )
        self._memo = ChainMemo() if self._hashes_per_chunk else None
        self._reqs: dict[str, _RequestState] = {}
        self._loads: list[RequestLoad] = []
        self._load_pins: list[bytes] = []  # released once the loads are sent
        self._manager: KVCacheManager | None = None
        self._state_groups = [g for g, s in enumerate(layout.groups) if s.kind is GroupKind.STATE]
        self._attention_groups = [
            g for g, s in enumerate(layout.groups) if s.kind is not GroupKind.STATE
        ]
        self._full_groups = [g for g, s in enumerate(layout.groups) if s.kind is GroupKind.FULL]
        self._tags = itertools.count()
        self._tagged: set[str] = set()  # requests with tagged stores
        # Tagged stores of finished requests, settled at finish: (index epoch, names).
        self._settled: list[tuple[int, RequestStore]] = []
        # What the request being planned (`_guarded`) admitted to the index so far.
        self._admitted: list[bytes] = []
        # Finished requests whose blocks vLLM keeps for the workers' stores, to name in
        # the next step's metadata; the blocks each schedule hands over; the steps built,
        # and by rank the newest whose stores have all landed.
        self._delayed: list[str] = []
        # The delayed requests vLLM still holds, in the order they finished, with the
        # step each finished in and the step of its newest store (`frees_pending`).
        self._freeing: dict[str, tuple[int, int]] = {}
        self.handover = Handover([g.block_tokens for g in layout.groups])
        self._step = 0
        self._landed: dict[int, int] = {}
        self.stats = SchedulerStats()
        self._last_log = self._started = time.monotonic()

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
        C = self.planner.chunk_tokens
        if len(st.keys) >= num_tokens // C:
            return st.keys  # keyed already: slicing a 24k-token prompt again costs 20 us
        request = st.request
        memo = self._memo
        if memo is None or st.keys or request.mm_features or request.prompt_embeds is not None:
            # Chunk extras, or keyed in part: the memo does not apply (`ChainMemo`).
            return extend_chain(
                st.keys, st.ctx.seed, request.all_token_ids, C, st.ctx.chunk_extras, num_tokens
            )
        r = self._hashes_per_chunk
        fingerprints = request.block_hashes[r - 1 : num_tokens // C * r : r]
        st.keys.extend(memo.recall(st.ctx.seed, fingerprints))
        recalled = len(st.keys)
        extend_chain(st.keys, st.ctx.seed, request.all_token_ids, C, None, num_tokens)
        memo.remember(st.ctx.seed, fingerprints, st.keys, recalled)
        return st.keys

    def num_new_matched_tokens(self, request: Request, local_tokens: int) -> int | None:
        """The hit beyond vLLM's own, or None ("ask again") while disk entries it needs
        are promoted into CPU memory.

        Costs no I/O and may be asked any number of times: each answer re-runs the hit
        rule on the index and replaces the request's pins. An entry that cannot be made
        ready (no CPU room, a failed or overdue promotion) is left out and the rule runs
        again, so the loop ends.
        """
        if self.split_guard is not None:
            self.split_guard.check()  # before vLLM splits this request's prefill
        if not self.enabled:
            return 0
        st = self._state(request)
        if st.ctx is None or st.load_failed or request.skip_reading_prefix_cache:
            # vLLM discards any hit of a request that reads no prefix cache (prompt
            # logprobs: a restored prefix has none), after asking: a lookup would only
            # order promotions (CPU room, reads) and count a hit that never happens.
            return 0
        if not self.index.ready() and time.monotonic() - self._started < PROMOTE_WAIT_SECONDS:
            self.stats.waits += 1
            return None  # the workers list their disks in the first step's report
        index = self.index
        overdue = (
            st.waiting_since is not None
            and time.monotonic() - st.waiting_since > PROMOTE_WAIT_SECONDS
        )
        C = self.planner.chunk_tokens
        if (
            st.stored_at is not None
            and st.stored_at[0] < request.num_preemptions
            and st.stored_at[1] > self._landed_through()
            and local_tokens < self.planner.max_hit_chunks(request.num_tokens) * C
            and not overdue
        ):
            # Resumed before the stores planned on its old blocks have landed: a hit now
            # would read the very entries that may yet be lost (Model Runner V2 drops a
            # store whose blocks vLLM handed on before it landed), a failed load and the
            # whole context computed again. Once they have landed (a step or two on a
            # GPU), the index knows what was lost. (Unless vLLM's own hit leaves nothing
            # to add.)
            if st.waiting_since is None:
                st.waiting_since = time.monotonic()
            self.stats.waits += 1
            return None
        if (
            st.promoted_from is not None
            and st.waited_at == local_tokens
            and not overdue
            and index.any_promoting(st.pins)
        ):
            # Still waiting for the same promotions: the rule would answer the same, and
            # re-running it for every waiting request in every step costs the scheduler
            # ~0.3 ms a request (a 32k-token prompt).
            self.stats.waits += 1
            return None
        # A resumed (preempted) request is looked up over its output so far too: its
        # decode-time chunks and staged state are stored under its chain like a prompt's,
        # and vLLM recomputes the output as well (a long decode's most of all).
        L = request.num_tokens
        keys = self._keys(st, L)
        # What vLLM serves itself is a use too: without it the shared head of every
        # chain would age out of CPU memory while vLLM keeps hitting it.
        index.touch(self._wanted(keys, 0, local_tokens // C * C))
        excluded: set[bytes] = set()

        if (
            self.probe is not None
            and not overdue
            and self.probe.name not in self._tiers_down
            and self._probe(keys, local_tokens, L)
        ):
            if st.waiting_since is None:
                st.waiting_since = time.monotonic()
            self.stats.waits += 1
            return None  # the shared tier is being asked what it holds

        st.hit = None
        while True:
            boundary, tier = self._best_hit(keys, L, local_tokens, excluded)
            if boundary <= local_tokens:
                break
            wanted = self._wanted(keys, local_tokens, boundary)
            # The request's pins from now on: nothing the hit needs is evicted to make
            # room for its promotions.
            index.pin(wanted)
            try:
                waits = index.not_ready(wanted)
                blocked = [k for k in waits if not self._ready_or_coming(k, overdue, tier)]
            except Exception:
                index.unpin(wanted)  # a lookup error is a miss: it must leave no pin
                raise
            if blocked:
                index.unpin(wanted)
                excluded.update(blocked)
                continue
            index.unpin(st.pins)
            st.pins = wanted
            if index.any_promoting(wanted):
                if st.waiting_since is None:
                    st.waiting_since = time.monotonic()
                st.promoted_from, st.waited_at = tier, local_tokens
                st.waited_on = frozenset(waits)
                self.stats.waits += 1
                return None
            index.touch(wanted)
            st.waiting_since = None
            st.hit = (local_tokens, boundary)
            # From below only if it reads what the wait promoted (not when those
            # promotions failed or were overdue and a hit in CPU memory alone was found).
            below = st.promoted_from is not None and not st.waited_on.isdisjoint(wanted)
            st.hit_source = st.promoted_from if below else "cpu"
            st.promoted_from, st.waited_on = None, frozenset()
            self._answered(st, keys, local_tokens, boundary, st.hit_source)
            return boundary - local_tokens
        self._pin(st, [])
        st.waiting_since = st.promoted_from = None
        st.waited_on = frozenset()
        self._answered(st, keys, local_tokens, 0, "none")
        return 0

    def _answered(
        self, st: _RequestState, keys: list[bytes], local_tokens: int, boundary: int, tier: str
    ) -> None:
        """Note an answered lookup whose hit (if any) ends at `boundary` and comes from
        `tier`, to count once vLLM allocates for it (`after_alloc`), and ask vLLM to
        checkpoint the recurrent state at the prompt's branch point when one is missing
        (core/policy.py): the attention chunks of an earlier prompt reach further than
        any boundary with a state. vLLM ends a prefill chunk at
        `shared_prefix_boundary` (its own Marconi-style junction, which its local prefix
        cache sets the same way) and hands the state there off like a prompt's."""
        request = st.request
        L = request.num_tokens
        served = max(boundary, local_tokens)
        reach = self._reach(keys, served, L)
        st.answer = (L, local_tokens, served, reach, tier)
        st.junction = (
            bool(self._state_groups)
            and self.policy is not None
            and max(served, request.shared_prefix_boundary) < reach
            and reach < self.policy.prompt_checkpoint(request.num_prompt_tokens)
        )
        if st.junction:
            request.shared_prefix_boundary = reach

    def _probe(self, keys: list[bytes], local_tokens: int, num_tokens: int) -> bool:
        """Ask the shared tier about the request's entries CPU memory does not hold and
        no fresh answer covers (those on disk too: the load weights choose between the
        tiers); whether an answer is still out (the lookup then waits for it). The keys
        of every lookup of the step go out together, in one round trip (`build_meta`)."""
        C = self.planner.chunk_tokens
        # Only a boundary past the hit CPU memory serves alone can make the tier's hit
        # worth loading, and every chunk it needs below that hit is in CPU memory (the
        # window chunks a later boundary needs overlap the ones this hit reads): ask about
        # the chunks from there on, not the whole prompt's. A conversation's next turn
        # then asks about its new message, not every state of its history.
        first = max(local_tokens, self._hit_in(keys, num_tokens, local_tokens, None))
        chunks = keys[first // C : self.planner.max_hit_chunks(num_tokens)]
        unknown = self.index.unknown_in(
            group_keys(chunks, len(self.layout.groups)), self.probe.name
        )
        if not unknown:
            return False
        held, asking = self.probe.held(unknown)
        self.index.hint(self.probe.name, held, time.monotonic() + self.probe.ttl_s)
        return asking

    def _best_hit(
        self, keys: list[bytes], num_tokens: int, local_tokens: int, excluded: set[bytes]
    ) -> tuple[int, str | None]:
        """The hit to plan, and the tier below CPU memory it is promoted from: of the
        hits each tier could serve (with what CPU memory holds), the one with the most
        tokens times the tier's load weight; on a tie, the faster tier."""
        best, best_tier, best_score = 0, None, 0.0
        tiers = [(t, w) for t, w in self.tiers if t not in self._tiers_down]
        for tier, weight in tiers or [(None, 1.0)]:
            boundary = self._hit_in(keys, num_tokens, local_tokens, tier, excluded)
            if boundary * weight > best_score:
                best, best_tier, best_score = boundary, tier, boundary * weight
        return best, best_tier

    def _hit_in(
        self,
        keys: list[bytes],
        num_tokens: int,
        local_tokens: int,
        tier: str | None,
        excluded: set[bytes] | frozenset[bytes] = frozenset(),
    ) -> int:
        """The hit (a boundary in tokens, or 0) CPU memory serves with `tier`'s help
        (None: alone), leaving out the entries in `excluded`."""
        index = self.index

        def present(g: int, c: int) -> bool:
            if c >= len(keys):
                return False
            key = group_key(keys[c], g)
            return key not in excluded and index.known_in(key, tier)

        def run(g: int, start: int, stop: int) -> int:
            suffix = group_key(b"", g)
            wanted = [k + suffix for k in keys[start:stop]]
            n = index.known_run(wanted, tier)
            if excluded:
                n = next((i for i, key in enumerate(wanted[:n]) if key in excluded), n)
            return n

        return self.planner.find_hit(num_tokens, local_tokens, present, run)

    def _ready_or_coming(self, key: bytes, overdue: bool, tier: str | None) -> bool:
        """In CPU memory, or promoted there from `tier` (started now if need be) while
        the request may still wait."""
        if self.index.in_cpu(key):
            return True
        if overdue or tier is None:
            return False
        if self.index.promoting(key):
            return True
        return self.index.on_tier(key, tier) and self.index.promote(
            key, self._entry_bytes(key), tier
        )

    def _reach(self, keys: list[bytes], served: int, num_tokens: int) -> int:
        """How far past `served` tokens the request's stored full-attention chunks run
        without a gap (chunk-aligned, short of its last token): the prefix it
        shares with an earlier prompt, as far as the index knows. `served` without
        full-attention groups (nothing to measure a shared prefix by)."""
        C = self.planner.chunk_tokens
        cap = self.planner.max_hit_chunks(num_tokens)
        attention = self._full_groups
        if not attention:
            return served
        first = served // C
        chunks = keys[first : max(cap, first)]
        suffixes = [group_key(b"", g) for g in attention]
        wanted = [k + suffix for k in chunks for suffix in suffixes]
        reach = first + first_found(wanted, self.index.unknown) // len(attention)
        return max(reach * C, served)

    def _count_lookup(
        self, num_tokens: int, local_tokens: int, served: int, reach: int, tier: str
    ) -> None:
        """Count an answered lookup that served `served` tokens (vLLM's own and its hit
        from `tier`) of a request's `num_tokens` whose stored chunks `reach` that far."""
        self.stats.lookups += 1
        _add(self.stats.lookups_by_tier, tier, 1)
        self.stats.queried_tokens += max(num_tokens - local_tokens, 0)
        self.stats.miss_tokens += max(num_tokens - served, 0)
        cap = self.planner.max_hit_chunks(num_tokens) * self.planner.chunk_tokens
        self.stats.short_of_state += max(min(reach, cap) - served, 0)
        self.stats.short_of_chunks += max(cap - max(reach, served), 0)

    def _wanted(self, keys: list[bytes], local: int, boundary: int) -> list[bytes]:
        """Every entry a hit at `boundary` reads."""
        wanted: list[bytes] = []
        for g in range(len(self.planner.groups)):
            suffix = group_key(b"", g)
            wanted += [keys[c] + suffix for c in self.planner.needed_chunks(g, local, boundary)]
        return wanted

    def _entry_bytes(self, key: bytes) -> int:
        return self.planner.entry_bytes(split_group_key(key)[1])

    def _pin(self, st: _RequestState, keys: list[bytes]) -> None:
        """Make `keys` the request's pins (pin the new before releasing the old)."""
        self.index.pin(keys)
        self.index.unpin(st.pins)
        st.pins = keys

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        """Plan the load of a reported hit. vLLM calls this a second time once the load
        is done (with no external tokens), and for requests without a hit. With a hit,
        vLLM keeps the request waiting until its load is reported: whatever fails here
        before the load is queued, it is queued as a failed one (vLLM recomputes the
        request) and the request's pins go, before the fault is raised to the hook."""
        queued = len(self._loads)
        try:
            self._after_alloc(request, blocks, num_external)
        except BaseException:
            if num_external > 0 and len(self._loads) == queued:
                self._loads.append(RequestLoad(request.request_id, [], failed=True))
                self.stats.failed_plans += 1
                st = self._reqs.get(request.request_id)
                if st is not None:
                    self._pin(st, [])
            raise

    def _after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        req_id = request.request_id
        self.handover.admitted(req_id, blocks, num_external > 0)
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.stored_at = None  # new blocks (a request is admitted only from waiting)
        st.loading = 0  # a load of its earlier admission is reported already
        if st.answer is not None:
            self._count_lookup(*st.answer)
            self.stats.junctions += st.junction
            st.answer, st.junction = None, False
        hit, st.hit = st.hit, None
        if num_external == 0:
            self._pin(st, [])
            return
        try:
            if hit is None or hit[1] - hit[0] != num_external:
                raise RuntimeError(f"allocation for {num_external} tokens matches no hit")
            local, boundary = hit
            plan = self.planner.load_plan(local, boundary, blocks.get_block_ids())
            copies = _keyed(st.keys, plan)
        except Exception:
            # vLLM waits for this load: it must still reach the workers, as a failure.
            log.exception("hybridkv: planning the load of %s failed", req_id)
            self.stats.failed_plans += 1
            self._loads.append(RequestLoad(req_id, [], failed=True))
            self._pin(st, [])
            return
        self._loads.append(RequestLoad(req_id, copies))
        # The entries stay pinned until the load is sent (evictions of the same step are
        # chosen before the pins go).
        self._load_pins.extend(st.pins)
        st.pins = []
        self.stats.hit_tokens += num_external
        _add(self.stats.hit_tokens_by_tier, st.hit_source, num_external)
        st.loading = num_external
        # What was loaded is stored already (unless the load fails: `loads_failed`).
        st.stored_chunks = max(st.stored_chunks, boundary // self.planner.chunk_tokens)
        self._observe(st, st.keys, [boundary])  # after a restart, disk entries are news
        if self._state_groups:  # last: its fault (caught at the hook) costs itself alone
            self._restored_boundary(st.keys, boundary)

    # ---- per-step plan ----------------------------------------------------------------------
    def build_meta(self, out: SchedulerOutput) -> HybridKVMetadata:
        """The step's loads, then its stores. Loads and the requests whose blocks vLLM
        keeps go out whatever happens to the rest: vLLM waits for each to be reported.
        Every other part that fails is logged and counted, never raised into vLLM's
        scheduler; where the blocks handed over cannot be listed, the workers take
        every block for handed over."""
        meta = HybridKVMetadata(loads=self._loads, idle=out.total_num_scheduled_tokens == 0)
        self._loads = []
        self._step += 1
        meta.step = self._step
        meta.delayed, self._delayed = self._delayed, []
        meta.finished = list(out.finished_req_ids)
        meta.all_handed = True
        with self._caught("listing the blocks this step hands over"):
            meta.allocated_blocks, meta.foreign_blocks = self.handover.take(out)
            meta.all_handed = False
        if self.enabled:
            with self._caught("planning this step's stores (none are made)"):
                meta.stores = self._plan_stores(out)
        pins, self._load_pins = self._load_pins, []
        with self._caught("releasing the planned loads' pins"):
            self.index.unpin(pins)
        meta.epoch = self.index.epoch
        with self._caught("taking the index's orders"):
            meta.orders = self.index.take_orders()
        if self.probe is not None:
            with self._caught("sending the probe"):
                self.probe.send()  # what this step's lookups asked about, in one round trip
        with self._caught("reading stats for the log"):
            self._maybe_log_stats()
        return meta

    @contextlib.contextmanager
    def _caught(self, what: str) -> Iterator[None]:
        """Log and count an exception of the block instead of raising it."""
        try:
            yield
        except Exception:
            log.exception("hybridkv: %s failed", what)
            self.stats.hook_errors += 1

    def _plan_stores(self, out: SchedulerOutput) -> list[RequestStore]:
        """The stores of this step: first the fate of entries tagged in earlier steps
        (they go out even if planning this step's fails), then this step's copies."""
        stores = self._settle_finished() + self._settle_running()
        with self._caught("planning this step's copies (none are made)"):
            stores += self._plan_copies(out)
        return stores

    def _plan_copies(self, out: SchedulerOutput) -> list[RequestStore]:
        """Every attention chunk this step's forward completes and every recurrent state
        the policy keeps among those it writes, gathered in this step (while their blocks
        certainly hold them). A copy whose key's tokens are all known is keyed now; one
        whose key needs the token the step before is still sampling (async scheduling)
        is tagged, and named by a later step (`_settle`)."""
        offers = self._state_offers(out)
        stores = []
        for req_id in set(out.num_scheduled_tokens) | set(offers):
            st = self._reqs.get(req_id)
            if st is None or st.ctx is None:
                continue
            store = self._guarded(st, partial(self._plan_request, st, out, offers.get(req_id, {})))
            if store is not None:
                stores.append(store)
        return stores

    def _plan_request(
        self, st: _RequestState, out: SchedulerOutput, offers: dict[int, list[EntryCopy]]
    ) -> RequestStore | None:
        """One request's part of `_plan_copies`."""
        C = self.planner.chunk_tokens
        req = st.request
        req_id = req.request_id
        n = out.num_scheduled_tokens.get(req_id, 0)
        start = req.num_computed_tokens
        known = req.num_tokens
        limit = known + self._keyable_inputs(st, out)
        end = min(start + n, limit)
        chunks = range(st.stored_chunks, end // C) if n > 0 else range(0)
        states = {b: c for b, c in offers.items() if b <= limit}
        block_ids = None
        if n > 0 and end not in states and self._decode_boundary(req, start, end):
            block_ids = self._manager.get_block_ids(req_id)
            states[end] = self._decode_state(end, block_ids)
        plan: list[tuple[int, EntryCopy, bool]] = []  # (tokens its key covers, copy, staged)
        if chunks:
            st.stored_chunks = max(st.stored_chunks, end // C)
            if block_ids is None:
                block_ids = self._manager.get_block_ids(req_id)
            copies = self.planner.store_plan(chunks, block_ids)
            plan += [((c.chunk + 1) * C, c, False) for c in copies]
        for boundary, offered in states.items():
            action = self.policy.decide(boundary, req.num_prompt_tokens, req.shared_prefix_boundary)
            if action is not None:
                plan += [(boundary, c, action is StateAction.STAGE) for c in offered]
        keyed = self._name(st, [(c, staged) for e, c, staged in plan if e <= known])
        tagged = self._tag(st, [(e, c, staged) for e, c, staged in plan if e > known])
        if not keyed and not tagged:
            return None
        st.stored_at = (req.num_preemptions, self._step)
        return RequestStore(req_id, keyed, tagged)

    def _guarded(
        self, st: _RequestState, plan: Callable[[], RequestStore | None]
    ) -> RequestStore | None:
        """Plan one request's stores. An error costs that request's stores alone, not
        the step's: what it admitted to the index is withdrawn (no store carries it, so
        no worker holds it), its tagged stores are dropped, and it stores nothing more
        (it would fail the same way every step)."""
        self._admitted = []
        try:
            return plan()
        except Exception:
            req_id = st.request.request_id
            log.exception("hybridkv: planning the stores of %s failed; it stores no more", req_id)
            self.stats.hook_errors += 1
            self.index.withdraw(self._admitted)
            st.ctx = None
            self._tagged.discard(req_id)
            dropped, st.tagged = [TagName(t.tag, None) for t in st.tagged], []
            return RequestStore(req_id, [], named=dropped) if dropped else None

    def _keyable_inputs(self, st: _RequestState, out: SchedulerOutput) -> int:
        """How many of the step's input tokens past those known its stores may still be
        keyed on: under async scheduling, the one token the step before is sampling, which
        vLLM appends as sampled when it processes that step (or never: the request
        finished or was preempted first). Speculative tokens may be rejected and their
        positions sampled again, so a request that has had any gets none."""
        req = st.request
        if out.scheduled_spec_decode_tokens.get(req.request_id):
            st.drafted = True
        return int(req.num_output_placeholders == 1 and not st.drafted)

    def _name(self, st: _RequestState, copies: list[tuple[EntryCopy, bool]]) -> list[KeyedCopy]:
        """Key copies whose tokens are all known; the ones admitted (see `_admit`) or
        staged (`_stage`)."""
        if not copies:
            return []
        keys = self._keys(st, (max(c.chunk for c, _ in copies) + 1) * self.planner.chunk_tokens)
        stored = self._admit(st, keys, _keyed(keys, [c for c, staged in copies if not staged]))
        staged = self._stage(st, keys, _keyed(keys, [c for c, staged in copies if staged]))
        C = self.planner.chunk_tokens
        self._observe(
            st,
            keys,
            {
                (c.chunk + 1) * C
                for c, _ in copies
                if not self._state_groups or c.group in self._state_groups
            },
        )
        return stored + staged

    def _observe(self, st: _RequestState, keys: list[bytes], boundaries: Iterable[int]) -> None:
        """Tell the KV cache events (if enabled) of boundaries the request stored or
        restored: they take their block hashes and tokens from it. An error here turns
        the events off (counted), never costs a store or a hit."""
        if self.events is None or self.events.broken:
            return
        try:
            self.events.observe(st.request, keys, sorted(boundaries))
        except Exception:
            self.events.stop()
            self.stats.hook_errors += 1

    def _stage(
        self, st: _RequestState, keys: list[bytes], copies: list[KeyedCopy]
    ) -> list[KeyedCopy]:
        """Stage the newest of the decode-time states in `copies` (one boundary's): kept
        in CPU memory only and pinned until the request finishes, when it goes down to
        the lower tiers (`request_finished`). It replaces the state staged before, which
        leaves CPU memory and is never written below: a long decode crosses a boundary
        every `chunk_tokens` tokens, and writing each state through to a shared tier only
        to delete it at the next was nearly all its writes. A state held already (in a
        lower tier too) replaces it as well, unless it is the one staged (planned twice);
        one CPU memory has no room for is not stored, and the one before stays staged."""
        if not copies:
            return []
        last = max(kc.copy.chunk for kc in copies)
        newest = [kc for kc in copies if kc.copy.chunk == last]
        if any(kc.key in st.staged for kc in newest):
            return []
        admitted: list[KeyedCopy] = []
        if not all(self.index.known(kc.key) for kc in newest):
            admitted = self._admit(st, keys, newest, spill=False)
            if not admitted:
                return []
        self.index.unpin(st.staged)
        for key in st.staged:
            self.index.delete(key)
        st.staged = [kc.key for kc in admitted]
        self.index.pin(st.staged)
        return [replace(kc, below=False) for kc in admitted]

    def _tag(
        self, st: _RequestState, copies: list[tuple[int, EntryCopy, bool]]
    ) -> list[TaggedCopy]:
        preemptions = st.request.num_preemptions
        tagged = [_Tagged(next(self._tags), e, c, staged, preemptions) for e, c, staged in copies]
        if tagged:
            st.tagged += tagged
            self._tagged.add(st.request.request_id)
        return [TaggedCopy(t.tag, t.copy) for t in tagged]

    def _settle(self, st: _RequestState, finished: bool) -> list[TagName]:
        """Name the request's tagged stores whose tokens are all known now; drop those
        whose tokens never will be: the request was preempted since (vLLM may drop the
        token in flight and sample its position again), or finished first. The request's
        tags change only once all is decided (an error leaves them to the next try)."""
        req = st.request
        ready: list[_Tagged] = []
        names: list[TagName] = []
        waiting: list[_Tagged] = []
        for t in st.tagged:
            if t.preemptions != req.num_preemptions:
                names.append(TagName(t.tag, None))
                if t.copy.group not in self._state_groups:  # store it when recomputed
                    st.stored_chunks = min(st.stored_chunks, t.copy.chunk)
            elif req.num_tokens >= t.end:
                ready.append(t)
            elif finished or req.num_output_placeholders == 0:
                names.append(TagName(t.tag, None))  # no output in flight can bring it
            else:
                waiting.append(t)
        keyed = {
            (kc.copy.group, kc.copy.chunk): kc
            for kc in self._name(st, [(t.copy, t.staged) for t in ready])
        }
        for t in ready:
            kc = keyed.get((t.copy.group, t.copy.chunk))
            names.append(TagName(t.tag, kc.key, kc.cpu, kc.below) if kc else TagName(t.tag, None))
        st.tagged = waiting
        return names

    def _settle_running(self) -> list[RequestStore]:
        stores = []
        for req_id in list(self._tagged):
            st = self._reqs.get(req_id)
            if st is not None:
                store = self._guarded(st, partial(self._named, st, False))
                if store is not None:
                    stores.append(store)
            if st is None or not st.tagged:
                self._tagged.discard(req_id)
        return stores

    def _named(self, st: _RequestState, finished: bool) -> RequestStore | None:
        names = self._settle(st, finished)
        return RequestStore(st.request.request_id, [], named=names) if names else None

    def _settle_finished(self) -> list[RequestStore]:
        """The names given at finish. They were admitted to the index then, so that the
        next lookup finds them (the workers store them before the step's loads); if the
        index was cleared since, they are dropped instead."""
        stores = []
        for epoch, store in self._settled:
            if epoch != self.index.epoch:
                store = RequestStore(
                    store.req_id, [], named=[TagName(n.tag, None) for n in store.named]
                )
            stores.append(store)
        self._settled = []
        return stores

    def _finish_tagged(self, st: _RequestState) -> None:
        self._tagged.discard(st.request.request_id)
        if not st.tagged:
            return
        store = self._guarded(st, partial(self._named, st, True))
        if store is not None:
            self._settled.append((self.index.epoch, store))

    def pending_tags(self) -> int:
        """Tagged stores not named or dropped yet: the workers hold an entry for each."""
        running = sum(len(self._reqs[r].tagged) for r in self._tagged if r in self._reqs)
        return running + sum(len(store.named) for _, store in self._settled)

    def _admit(
        self,
        st: _RequestState,
        keys: list[bytes],
        copies: Iterable[KeyedCopy],
        spill: bool = True,
    ) -> list[KeyedCopy]:
        """The copies worth making: entries not held yet, each admitted to CPU memory
        (evicting others) or, without room there and with `spill`, to the lower tiers
        alone. With recurrent groups a boundary's states are admitted together (see
        core/index.py), and the attention chunks the request stores stay pinned until
        it finishes. Room for all of them is made at once: one eviction choice instead of
        one per entry (a turn stores a dozen chunks, and each choice costs the scheduler
        thread tens of microseconds whatever it frees).

        A boundary with any state new is admitted whole: its states only a lower tier
        holds are copied to CPU memory too, and those CPU memory holds (left by a
        boundary whose other states were lost) stay pinned while room is made, so the
        boundary enters with every state or not at all."""
        index = self.index
        copies = list(copies)
        out: list[KeyedCopy] = []
        fresh = set(index.unknown([kc.key for kc in copies]))
        boundaries: dict[int, list[KeyedCopy]] = {}
        if index.recurrent:
            for kc in copies:
                if kc.copy.group in self._state_groups:
                    boundaries.setdefault(kc.copy.chunk, []).append(kc)
            boundaries = {
                c: states
                for c, states in boundaries.items()
                if any(kc.key in fresh for kc in states)
            }
        whole = {kc.key for states in boundaries.values() for kc in states}
        in_cpu = {key for key in whole if index.known_in(key, None)}
        copied = fresh | (whole - in_cpu)
        to_cpu = [kc for kc in copies if kc.key in copied]
        entry_bytes = {kc.key: self.planner.entry_bytes(kc.copy.group) for kc in to_cpu}
        C = self.planner.chunk_tokens
        needs = {chunk: self._needs(keys, (chunk + 1) * C) for chunk in boundaries}
        total = sum(entry_bytes.values())
        # Held until every entry is admitted: the states of a boundary admitted whole that
        # CPU memory holds, and, where admitting evicts, the chunks CPU memory holds that
        # its hit reads (the chain's previous boundary, a leaf, would otherwise be evicted
        # with them).
        kept = list(in_cpu)
        if not index.fits(total):
            kept += index.present(list(dict.fromkeys(k for n in needs.values() for k in n)))
        index.pin(kept)
        try:
            room = index.make_room(total)
            owned: list[bytes] = []  # admitted, to pin (at once: the admissions evict nothing)
            for kc in to_cpu:
                if index.recurrent and kc.copy.group in self._state_groups:
                    continue  # with its boundary, below
                if index.admit(kc.key, entry_bytes[kc.key]):
                    out.append(kc)
                    self._admitted.append(kc.key)
                    if index.recurrent:
                        owned.append(kc.key)
                        if not room:  # the next admission may evict: hold this one now
                            self._own(st, owned)
                elif spill and self.below:
                    out.append(KeyedCopy(kc.key, kc.copy, cpu=False))
            self._own(st, owned)
            for chunk, states in boundaries.items():
                pairs = [(kc.key, kc.copy.group) for kc in states]
                if self._admit_boundary(keys, (chunk + 1) * C, pairs, needs[chunk]):
                    admitted = [kc for kc in states if kc.key not in in_cpu]
                    out += admitted
                    self._admitted += [kc.key for kc in admitted]
                elif spill and self.below:
                    out += [
                        KeyedCopy(kc.key, kc.copy, cpu=False) for kc in states if kc.key in fresh
                    ]
        finally:
            index.unpin(kept)
        return out

    def _own(self, st: _RequestState, keys: list[bytes]) -> None:
        """Pin `keys` until the request finishes (emptying the list)."""
        if keys:
            self.index.pin(keys)
            st.owned += keys
            keys.clear()

    def _needs(self, keys: list[bytes], boundary: int) -> list[bytes]:
        """The attention entries a hit at `boundary` tokens reads besides the states."""
        needs: list[bytes] = []
        for g in self._attention_groups:
            suffix = group_key(b"", g)
            needs += [keys[c] + suffix for c in self.planner.needed_chunks(g, 0, boundary)]
        return needs

    def _admit_boundary(
        self,
        keys: list[bytes],
        boundary: int,
        states: list[tuple[bytes, int]],
        needs: list[bytes],
    ) -> bool:
        """Count a boundary's states (key, group) into CPU memory, with what a hit there
        also reads (`needs`), what keeping it costs beyond the chain's previous boundary
        in CPU memory, and that boundary (its parent)."""
        C = self.planner.chunk_tokens
        attention = self._attention_groups
        # The chain's previous boundary: the nearest chunk before this one whose state
        # begins a boundary in CPU memory.
        suffix, last = group_key(b"", self._state_groups[0]), boundary // C - 2
        found = self.index.nearest_boundary([keys[c] + suffix for c in range(last, -1, -1)])
        previous, parent = (last - found[0] + 1, found[1]) if found else (0, None)
        sizes = [(key, self.planner.entry_bytes(g)) for key, g in states]
        own = sum(n for _, n in sizes)
        own += (boundary // C - previous) * sum(self.planner.entry_bytes(g) for g in attention)
        return self.index.admit_boundary(sizes, needs, boundary, own, parent)

    def _restored_boundary(self, keys: list[bytes], boundary: int) -> None:
        """The boundary a hit restores, if its states are not one in the index: states
        promoted from a lower tier come into CPU memory one entry at a time, plain
        entries the eviction policy takes for orphans (evicted first), whichever request
        then reads them. Counted in as the boundary they are, a document restored from
        disk is kept as one (the branch point of the questions after it)."""
        c = boundary // self.planner.chunk_tokens - 1
        states = [(group_key(keys[c], g), g) for g in self._state_groups]
        if self.index.boundary_id(states[0][0]) is None:
            self._admit_boundary(keys, boundary, states, self._needs(keys, boundary))

    def _decode_boundary(self, req: Request, start: int, end: int) -> bool:
        """Whether this step ends decoding on a chunk boundary past the prompt's
        checkpoint. vLLM hands off only prompt-time states (decode-time blocks get no
        hash), so this is the one state derived here: in align mode a step that ends at
        `end` leaves the running state in block `cdiv(end, block) - 1` (the model runner
        copies the previous state there before the forward), and the workers gather it
        at the end of that very step, before any later step can retire or reuse the
        block (speculative decoding, which moves it, is refused). `end` counts the token
        the step before is still sampling under async scheduling (see `_plan_copies`)."""
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
        return {
            **asdict(self.stats),
            **asdict(self.index.stats),
            **self.index.gauges(),
            "tracked_requests": len(self._reqs),
            "tagged_entries": self.pending_tags(),
            "promoted_from": dict(self.index.promoted_from),
            "probe_round_trips": self.probe.round_trips if self.probe else 0,
            "probe_lookups": self.probe.lookups if self.probe else 0,
            "kv_events_stopped": int(self.events is not None and self.events.broken),
            "block_size_restores": self.split_guard.restores if self.split_guard else 0,
        }

    def metrics(self) -> tuple[Figures, Figures]:
        """Cumulative counters and current gauges by tier, for reports (core/metrics.py)."""
        s = self.stats
        counters = {
            "lookups": dict(s.lookups_by_tier),
            "hit_tokens": dict(s.hit_tokens_by_tier),
            "miss_tokens": {"none": s.miss_tokens},
            "short_of_state_tokens": {"none": s.short_of_state},
            "failed_load_tokens": dict(s.failed_load_tokens_by_tier),
            "failed_promotions": dict(self.index.failed_from),
            "errors": {"none": s.hook_errors},
        }
        return counters, {"held_entries": {"cpu": self.index.pinned()}}

    def hit_source(self, request: Request) -> str:
        """The tier the request's last reported hit came from."""
        st = self._reqs.get(request.request_id)
        return st.hit_source if st is not None else "cpu"

    def worker_output(
        self,
        reports: dict[int, WorkerReport],
        landed: dict[int, int],
        failed: Iterable[str],
        sent: Iterable[str] = (),
    ) -> None:
        """A step's output from the workers, each part on its own: the failed loads first
        (a request not marked would be offered the same failing hit after its recompute,
        again and again), then each rank's report apart (a fault applying one costs that
        report alone), then the stores landed, and the delayed requests every rank
        reported (`sent`: vLLM frees their blocks now)."""
        with self._caught("marking failed loads"):
            self.loads_failed(failed)
        for req_id in sent:
            self._freeing.pop(req_id, None)
        for rank, report in reports.items():
            with self._caught(f"applying rank {rank}'s report"):
                self.worker_reports({rank: report})
        with self._caught("noting the stores landed"):
            self.stores_landed(landed)

    def worker_reports(self, reports: dict[int, WorkerReport]) -> None:
        for rank, report in reports.items():
            # Failed reads from the probed tier: not asked about again for a while (a
            # damaged disk entry says nothing of the shared tier's copy).
            probed = [
                key
                for epoch, key, ok in report.promoted
                if not ok
                and self.probe is not None
                and self.index.source(epoch, key) == self.probe.name
            ]
            self.index.apply(rank, report)
            if report.down is not None:
                self._tier_health(rank, report.down)
            for key in probed:
                self.probe.failed(key)

    def _tier_health(self, rank: int, down: list[str]) -> None:
        """A worker's tiers that are down now. Why: a tier down in a worker answers every
        read with a miss at once (tiers/redis.py), while this process's probe may still
        reach the server; without this, each lookup in the outage would plan promotions
        from it that all fail, and wait for them (a soak with Redis starved of CPU
        failed 29 % of its promotions so: docs/benchmarks.md)."""
        before = self._tiers_down
        self._down[rank] = set(down)
        self._tiers_down = set().union(*self._down.values())
        for tier in sorted(self._tiers_down - before):
            log.warning("hybridkv: tier %s is down on a worker; no hit is planned from it", tier)
        for tier in sorted(before - self._tiers_down):
            log.info("hybridkv: tier %s is back on every worker", tier)

    def stores_landed(self, landed: dict[int, int]) -> None:
        """Each rank's newest step whose stores have all landed."""
        for rank, step in landed.items():
            self._landed[rank] = max(self._landed.get(rank, 0), step)

    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """vLLM recomputes these requests: never offer them a hit again, so a fault that
        repeats cannot make a request loop (the workers report the entries they missed
        as lost, which keeps other requests off them too), and offer every chunk it
        recomputes to the index again: it admits the lost ones and none it holds (a
        resumed request's chunks from before its preemption may be among the lost)."""
        for req_id in req_ids:
            st = self._reqs.get(req_id)
            if st is not None:
                _add(self.stats.failed_load_tokens_by_tier, st.hit_source, st.loading)
                st.loading = 0
                st.load_failed = True
                st.stored_chunks = 0

    def request_finished(self, request: Request) -> bool:
        """Forget the request and release its pins; whether vLLM must keep its blocks
        until the workers report it in `finished_sending` (vllm/delayed_free.py): while a
        store planned on them may still be copying them out, i.e. some rank has not
        reported its step's stores landed (on a GPU a store lands after its step). On a
        CPU cache a store lands within its step (`stores_land_in_step`), and nothing is
        kept: waiting for the report (vLLM hands a step's report to
        `update_connector_output` only after the requests that step finished) would hold
        a finished request's blocks one step longer for nothing, and vLLM's prefix cache
        would evict other cached blocks in their place (on a held-out trace, a prefix
        vLLM itself would have hit). A request waiting for a load, hybridkv's or another
        connector's, has had no store planned since vLLM allocated its blocks: vLLM
        keeps them until the load is reported and then frees them itself (a second
        report would find the request gone). A load already planned keeps its pins
        until it is sent."""
        st = self._reqs.pop(request.request_id, None)
        delay = False
        if st is not None:
            self._pin(st, [])
            # May store (and pin) its last chunks and state: first. Its fault costs those
            # stores alone: the request's state is gone, so pins left now stay for good.
            with self._caught("storing a finished request's last chunks and state"):
                self._finish_tagged(st)
            self.index.unpin(st.owned)
            self.index.unpin(st.staged)
            if self.below:  # its last decode-time state, in CPU memory only until now
                self.index.persist(st.staged)
            preemptions, step = st.stored_at or (-1, 0)
            delay = (
                not self.stores_land_in_step
                and preemptions == request.num_preemptions
                and step > self._landed_through()
            )
        if delay:
            self._delayed.append(request.request_id)
            self._freeing[request.request_id] = (self._step, step)
        return delay

    def _landed_through(self) -> int:
        """The newest step whose stores have landed on every rank."""
        return min(self._landed.get(rank, 0) for rank in range(self.index.ranks))

    def frees_pending(self) -> bool:
        """Whether blocks vLLM keeps for hybridkv's stores in flight are about to be freed.
        vLLM then lets a running request it cannot allocate for wait a step rather than
        preempt one, whose whole context would be computed (or restored) again. Only
        stores not landed yet count: once they have, vLLM frees the blocks in the same
        output, unless another connector (a `MultiConnector`'s NIXL, waiting for a
        decode node's pull) holds them, for seconds. And only requests that finished in
        the last `FREE_WAIT_STEPS` steps (those before are forgotten): a report that
        never came would otherwise stop every preemption, and with the pool short the
        engine would schedule nothing for good."""
        freeing = self._freeing
        while freeing:
            oldest = next(iter(freeing))
            if self._step - freeing[oldest][0] <= FREE_WAIT_STEPS:
                break
            del freeing[oldest]
        landed = self._landed_through()
        return any(stored > landed for _, stored in freeing.values())

    def reset(self) -> None:
        """Forget this engine's view: the index (the workers then drop what they stored,
        but no other replica's entries in a shared tier) and the probe's answers."""
        self.index.clear()
        if self.probe is not None:
            self.probe.clear()
