"""Worker side of the connector: one per tensor-parallel rank, in the process that owns the
rank's KV cache. It holds the rank's share of every entry and does what the step's
orders say; it decides nothing.

Each step (vLLM calls the hooks in this order):
0. `guard` (`handle_preemptions`): stores still copying out blocks that this step's
   schedule hands to another request either hold the engine's compute stream back (Model
   Runner V1) or are dropped (see `guard`).
1. `begin_step` (`start_load_kv`): a clear first, if ordered; then the entries tagged in
   earlier steps that the scheduler side names now, stored (or dropped); then the step's
   loads, queued behind earlier ones with their entries held, and written from CPU
   memory into their blocks in one batch of at most `load_step_bytes` (a load may read
   an entry just named); then promotions, handed to a background thread (a disk read
   never holds up the step).
2. `end_step` (`wait_for_save`): the step's stores, copied out while their blocks are
   sure to be intact, into CPU memory and the disk queue once their bytes have landed
   (at once on a CPU cache; on a GPU the copy runs on a side stream and the entries wait
   in `_landing` until it is done, so the step never synchronizes), or kept under a tag
   while their keys' tokens are not known yet (async scheduling); then what finished
   requests staged in CPU memory alone goes down to the lower tiers, and evictions and
   deletions follow (after the stores: an entry stored and evicted in one step ends up
   evicted, as the index has it, also while it is still landing). Nothing here waits on
   a lower tier: their writes and deletes are queued for their own threads.
3. `report` (`build_connector_worker_meta`): promotions done, disk entries come and
   gone, entries lost; and `transfer_results`: the requests whose every entry has
   landed in its blocks (or, failed, whose every queued copy has), and the finished
   requests whose blocks vLLM kept for stores that have landed now (`delayed_free.py`).

Every hit is an asynchronous load in vLLM's terms: the request is not in the step's
forward while its blocks are written, and a load that fails is reported for that one
request, which vLLM then recomputes (the only failure report it accepts from models with
several KV cache groups).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hybridkv.core.background import lower_priority
from hybridkv.core.canonical import build_canonical
from hybridkv.core.copy_engine import LANDED, CopyEngine, Landing
from hybridkv.core.index import Orders, WorkerReport
from hybridkv.core.metrics import Figures, Observations
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.store import TieredStore
from hybridkv.core.tiers.memory import MemoryTier
from hybridkv.vllm.delayed_free import DelayedFree
from hybridkv.vllm.metadata import HybridKVMetadata

log = logging.getLogger(__name__)

# The longest a step without a forward waits for promotions under way.
IDLE_WAIT_SECONDS = 0.01
# A promotion is read and reported this many entries at a time, in the order the
# scheduler asked (request by request), so the first request's entries are loaded while
# later ones are still read: 8 prefixes of 32 MiB read cold at low priority took 5 s
# before the first could load (bench/stall.py).
PROMOTE_SLICE_ENTRIES = 32


@dataclass
class WorkerStats:
    """Monotonic counters (they only ever grow)."""

    loads: int = 0
    failed_loads: int = 0  # requests reported failed: vLLM recomputes them
    loaded_blocks: int = 0
    loaded_bytes: int = 0  # written into the KV cache by restores
    stored_entries: int = 0
    failed_stores: int = 0  # steps whose stores were dropped after an error
    promoted_entries: int = 0  # read from disk into CPU memory
    failed_promotions: int = 0
    hook_errors: int = 0  # exceptions caught at the connector boundary
    # Where a block still being copied out went to another request (`WorkerSide.guard`):
    held_compute: int = 0  # steps whose compute stream waited for a store
    overtaken_entries: int = 0  # entries dropped: no wait could come before the writes
    # Bytes of entries read out of each tier: CPU memory by restores, lower tiers by
    # promotions.
    read_bytes: dict[str, int] = field(default_factory=dict)
    cpu_evictions: int = 0  # entries dropped from CPU memory on the index's orders


class _Store(NamedTuple):
    """An entry to hand to the tiers (None: its copy failed): into CPU memory if `cpu`,
    into the lower tiers if `below` (see metadata.KeyedCopy)."""

    key: bytes
    entry: torch.Tensor | None
    cpu: bool
    below: bool


@dataclass
class _Landing:
    """Stores whose bytes are still on their way from the GPU, handed to the tiers once
    `landing` is done. `hold` keeps every entry the copy writes (tagged ones and dropped
    ones too) until then: the host pool hands a dropped entry's memory to the next one
    at once."""

    landing: Landing
    items: list[_Store]
    hold: list[torch.Tensor | None] = field(default_factory=list)
    reads: list[frozenset[int]] = field(default_factory=list)  # each held entry's blocks
    started: float | None = None  # perf_counter() when a step's stores began (timed)
    step: int = 0  # the step whose metadata planned them (`HybridKVMetadata.step`)


@dataclass
class _Restore:
    """A request's load not reported yet: the entries still to write (held here: the
    index may evict them once the load is sent, and a held entry's memory is not
    reused), and the copy that wrote the last ones (batches of a load run in order)."""

    req_id: str
    pending: list[tuple[EntryCopy, torch.Tensor]]
    landing: Landing = LANDED
    # Entries read from stores still landing, by id(): the store each waits for.
    sources: dict[int, Landing] = field(default_factory=dict)
    failed: bool = False  # reported failed once its queued copies have landed
    cancelled: bool = False  # its request finished: reported once its copies landed


@dataclass
class TransferResults:
    received: set[str]
    failed: set[str]
    sending: set[str] = field(default_factory=set)  # delayed requests now released


class WorkerSide:
    def __init__(
        self,
        planner: Planner,
        store: TieredStore,
        rank: int = 0,
        load_step_bytes: int = 0,
        hook_before_reuse: bool = True,
    ):
        """`hook_before_reuse`: vLLM calls `handle_preemptions` before the step writes
        the blocks its schedule handed over (Model Runner V1; V2 calls it after its
        zeroing and state pre-copy): see `guard`."""
        self.planner = planner
        self.store = store
        self.rank = rank
        self.load_step_bytes = load_step_bytes  # 0: every load in the step it is sent
        self.hook_before_reuse = hook_before_reuse
        self.sending = DelayedFree()
        self._guarded: HybridKVMetadata | None = None  # the last step `guard` saw
        self._step = 0  # the current step's `HybridKVMetadata.step`
        # The newest step whose stores were queued (`end_step`): with speculative decoding
        # vLLM reports a step (`build_connector_worker_meta`) before its `wait_for_save`.
        self._saved = 0
        self._restores: list[_Restore] = []  # loads not reported yet, oldest first
        self.copies: CopyEngine | None = None
        self.epoch = 0
        self._received: set[str] = set()
        self._failed: set[str] = set()
        # What the next report carries; promotion threads add to it. Re-entrant: the CPU
        # tier's own evictions call `lost` from inside a put made under it.
        self._lock = threading.RLock()
        # The first report lists the whole disk tier (what earlier processes stored).
        self._report = WorkerReport(listed=store.disk is not None)
        # The tiers down at the last report: the scheduler side plans no hit from them.
        self._reported_down: list[str] = []
        self._promoter = ThreadPoolExecutor(
            1, thread_name_prefix="hybridkv-promote", initializer=lower_priority
        )
        self._promotions: list[Future] = []
        # Keys ordered promoted and not read yet. An evict or delete order takes a key out
        # (with tensor parallelism the index orders one when another rank's read failed):
        # a read landing after it must not put into CPU memory what the index dropped.
        self._promoting: set[bytes] = set()
        self._closing = False  # `close` began: no more promotion reads
        self._idle = False
        # Entries gathered before their keys were known, by tag, until named or dropped,
        # and each request's tags (released with the request if never named).
        self._staged: dict[int, tuple[torch.Tensor | None, Landing]] = {}
        self._tags: dict[str, list[int]] = {}
        # Stores still being copied out, oldest first (see `_land`).
        self._landing: list[_Landing] = []
        self._timing: list[tuple[Landing, float]] = []  # load batches not seen landed
        self.stats = WorkerStats()
        # Latencies observed since the last `metrics` call: {histogram: {tier: [s]}}.
        self._latencies: Observations = {}
        if isinstance(store.cpu, MemoryTier):
            store.cpu.on_evict = self.lost

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

    def lost(self, key: bytes) -> None:
        """The CPU tier dropped an entry on its own (its safety bound): tell the index."""
        with self._lock:
            self._report.lost.append(key)

    # ---- 0. blocks handed over while stores still read them ------------------------------------
    def guard(self, meta: HybridKVMetadata, hook: bool = True) -> None:
        """Keep the stores in flight from copying blocks that this step's schedule handed
        to a request (`meta.allocated_blocks`, `meta.foreign_blocks`: vllm/handover.py,
        which says which blocks vLLM frees while their request runs), once per step.

        The stores still in `_landing` are those that had not landed at the previous
        step's last hook; every other one landed before anything of this step was
        queued. `hook`: called from `handle_preemptions`. Model Runner V1 calls it first
        in `execute_model`, before `_update_states` zeroes new blocks and
        `preprocess_mamba` copies states into them: there the compute stream waits for
        the newest store reading a block handed over, so no write of the step overtakes
        it (hybridkv's own loads wait for the compute stream). That is the one wait on
        the compute stream, and only a step that hands over a block still being read
        pays it; the step's token was sampled before it. Where no wait can come first
        (Model Runner V2 calls the hook after `update_requests` zeroed the new blocks and
        `preprocess_state` copied states into them; another connector's load writes
        outside the streams; this hook not called at all), the entries copied from such
        a block are dropped, never stored, and a load that read one fails (vLLM
        recomputes it): a lost hit, never wrong bytes. If anything here fails, every
        entry in flight is dropped the same way (`_drop_in_flight`) before the fault is
        raised: a store left copying a block handed on would save another request's KV."""
        if meta is self._guarded:
            return
        try:
            self._guard(meta, hook)
        except BaseException:
            self._drop_in_flight()
            raise
        finally:
            self._guarded = meta

    def _guard(self, meta: HybridKVMetadata, hook: bool) -> None:
        handed, foreign = set(meta.allocated_blocks), set(meta.foreign_blocks)
        ordered = hook and self.hook_before_reuse
        newest: Landing | None = None
        overtaken: set[int] = set()
        for pending in self._landing if handed or foreign or meta.all_handed else ():
            for entry, reads in zip(pending.hold, pending.reads, strict=True):
                if entry is None or not (meta.all_handed or reads & (handed | foreign)):
                    continue
                if ordered and not reads & foreign:
                    newest = pending.landing
                else:
                    overtaken.add(id(entry))
        if newest is not None:
            self.copies.hold_compute(newest)
            self.stats.held_compute += 1
        if overtaken:
            self._overtaken(overtaken)

    def _drop_in_flight(self) -> None:
        """Drop every entry not landed yet, and fail every restore reading one: what
        `_overtaken` does to the entries of blocks handed on, for all of them, in as few
        steps as can fail (a fault on the way to knowing which blocks were handed on)."""
        ids = {id(e) for p in self._landing for e in p.hold if e is not None}
        ids.update(id(s.entry) for p in self._landing for s in p.items if s.entry is not None)
        ids.update(id(e) for e, _ in self._staged.values() if e is not None)
        self.stats.overtaken_entries += len(ids)
        self._drop(ids)

    def _overtaken(self, ids: set[int]) -> None:
        """The entries `ids` (by id()) lost their blocks in flight: drop them."""
        log.info("hybridkv: %d stored entries lost their blocks in flight; dropped", len(ids))
        self.stats.overtaken_entries += len(ids)
        self._drop(ids)

    def _drop(self, ids: set[int]) -> None:
        """Drop the entries `ids` (by id()) wherever they wait: stores landing, tags,
        loads reading them."""
        for pending in self._landing:
            pending.items = [
                s._replace(entry=None) if s.entry is not None and id(s.entry) in ids else s
                for s in pending.items
            ]
        for tag, (entry, landing) in self._staged.items():
            if entry is not None and id(entry) in ids:
                self._staged[tag] = (None, landing)
        self._fail_restores([r for r in self._restores if ids & r.sources.keys()])

    # ---- 1. start of the step: clear, loads, promotions ----------------------------------------
    def begin_step(self, meta: HybridKVMetadata) -> None:
        """Whatever fails on the way, every load of the step is still reported (vLLM
        keeps its request waiting until it is)."""
        self._idle = meta.idle
        self.epoch = meta.epoch
        self._step = meta.step
        self.sending.delayed(meta.delayed)
        try:
            self.guard(meta, hook=False)  # unless `handle_preemptions` did
            self._land()
        finally:
            try:
                if meta.orders.clear:  # ordered once: the new epoch's work assumes it done
                    self._clear()
            finally:
                self.name(meta)  # catches its own faults (after a failed guard: reports lost)
                try:
                    self._end_finished(meta.finished)  # after the names: theirs come last
                    self.load(meta)
                finally:
                    # Whatever failed above: the index waits for these promotions' results.
                    self._submit_promotions(meta)

    def _end_finished(self, finished: list[str]) -> None:
        """Requests vLLM finished since the last step: their tags never named by now never
        will be, and are released; their loads write no more (vLLM keeps an aborted
        request's blocks until its load is reported: a restore writing on, a long
        prompt's for dozens of steps, would hold them and every load queued behind it
        for nothing), and are reported once what they queued has landed. After the
        step's names (a finished request's last entries are named in the step after it
        ends), before its loads and stores: a request id vLLM reuses is a new request's
        from this step on."""
        if not finished:
            return
        ended = set(finished)
        for restore in self._restores:
            if restore.req_id in ended:
                restore.cancelled = True
                restore.pending = []
        for req_id in ended:
            for tag in self._tags.pop(req_id, ()):
                self._staged.pop(tag, None)

    def _submit_promotions(self, meta: HybridKVMetadata) -> None:
        if meta.orders.promote:
            with self._lock:
                self._promoting.update(key for key, _ in meta.orders.promote)
            future = self._promoter.submit(self._promote, meta.epoch, list(meta.orders.promote))
            self._promotions.append(future)

    def _clear(self) -> None:
        """Drop what this engine stored, stores still landing included; the next report
        lists the disk afresh (what other engines stored there stays)."""
        for pending in self._landing:
            pending.items = []
        with self._lock:
            self.store.clear()
            self._promoting.clear()  # the epoch's promotions are forgotten with it
            self._report = WorkerReport()
            disk = self.store.disk
            if disk is not None:
                self._report.disk = disk.take_changes(everything=True)
                self._report.listed = True

    def load(self, meta: HybridKVMetadata) -> None:
        """Queue the step's loads, then write queued entries into their blocks, oldest
        first and one batch for all requests, up to `load_step_bytes` (at least one
        entry): a large restore spreads over steps instead of stalling the requests that
        decode meanwhile. A request with an entry missing from CPU memory (the index
        pinned it there, so only a fault can cause this) loads nothing and is reported
        failed; so is every request a failed copy touched."""
        for job in meta.loads:
            found = None if job.failed else self._entries(job.req_id, job.copies)
            if found is None:
                self._fail(job.req_id)
            else:
                entries, sources = found
                pending = [(kc.copy, e) for kc, e in zip(job.copies, entries, strict=True)]
                self._restores.append(_Restore(job.req_id, pending, sources=sources))
        batch, touched, spent = self._next_batch()  # every entry's group checked above
        if not batch:
            return
        sources = {k: landing for r in touched for k, landing in r.sources.items()}
        after = {id(a): a for _, e in batch if (a := sources.get(id(e))) is not None}
        try:
            started = time.perf_counter()
            landing = self.copies.scatter(batch, list(after.values()))
            self._timing.append((landing, started))
            self._time_loads()
        except Exception:
            # Blocks may be half written; vLLM recomputes every one of these requests.
            log.exception("hybridkv: restoring %d requests failed", len(touched))
            self._fail_restores(touched)
            return
        for restore in touched:
            restore.landing = landing
        self._count_read("cpu", (e for _, e in batch))
        self.stats.loaded_blocks += sum(len(c.block_ids) for c, _ in batch)
        self.stats.loaded_bytes += spent

    def _next_batch(self) -> tuple[list[tuple[EntryCopy, torch.Tensor]], list[_Restore], int]:
        """Queued entries to write this step, oldest first, up to `load_step_bytes` (at
        least one); the restores they belong to; their bytes."""
        batch: list[tuple[EntryCopy, torch.Tensor]] = []
        touched: list[_Restore] = []
        spent = 0
        for restore in self._restores:
            taken = len(batch)
            while restore.pending:
                copy = restore.pending[0][0]
                size = len(copy.block_ids) * self.planner.groups[copy.group].block_bytes
                if batch and self.load_step_bytes and spent + size > self.load_step_bytes:
                    break
                batch.append(restore.pending.pop(0))
                spent += size
            if len(batch) > taken:
                touched.append(restore)
            if restore.pending:  # the step's budget is spent
                break
        return batch, touched, spent

    def _fail_restores(self, restores: list[_Restore]) -> None:
        """Stop writing `restores`; they are reported failed (vLLM recomputes them) once
        the copies they queued have landed. vLLM frees or hands on a failed load's
        blocks as soon as it is reported (`kv_load_failure_policy="recompute"`:
        `Scheduler._update_waiting_for_remote_kv` frees them), while a copy still running
        would write them, behind whatever another connector (RDMA) or the compute stream
        writes there by then."""
        for restore in restores:
            restore.failed = True
            restore.pending = []

    def _time_loads(self) -> None:
        """Observe `load_seconds` of the batches that landed, oldest first: a CPU cache's
        at once (its copy is done when `scatter` returns); a GPU copy runs on a side
        stream and is seen landed at a later poll (the figure is then an upper bound,
        within a step), never at the launch, which takes microseconds. A broken copy
        gives no figure (`_finish_loads` fails its requests)."""
        while self._timing:
            landing, started = self._timing[0]
            try:
                if not landing.done():
                    return
                self._observe("load_seconds", "cpu", started)
            except Exception:
                pass  # logged where its requests fail
            self._timing.pop(0)

    def _finish_loads(self) -> None:
        """Report the requests whose every entry is written and landed (a GPU copy runs
        on a side stream: vLLM schedules the request only once it is reported, so its
        forward never reads a block still being written), failed ones once what they
        queued has landed. A copy that cannot say it landed (a device error) fails its
        requests at once: they must not wait forever, and it writes nothing any more."""
        self._time_loads()
        done, broken = [], []
        for restore in self._restores:
            if restore.pending:
                continue
            try:
                if restore.landing.done():
                    done.append(restore)
            except Exception:
                log.exception("hybridkv: a load's copy failed; %s is recomputed", restore.req_id)
                broken.append(restore)
        for restore in done + broken:
            self._restores.remove(restore)
            if restore.cancelled:
                self._received.add(restore.req_id)  # vLLM frees the blocks, nothing more
            elif restore.failed or restore in broken:
                self._fail(restore.req_id)
            else:
                self._received.add(restore.req_id)
                self.stats.loads += 1

    def _entries(
        self, req_id: str, copies: Sequence
    ) -> tuple[list[torch.Tensor], dict[int, Landing]] | None:
        """The entries of a load from CPU memory, or from stores still landing (the load
        then waits for their copies: the store each such entry waits for, by id())."""
        try:
            landing = {
                s.key: (s.entry, p.landing)
                for p in self._landing
                for s in p.items
                if s.cpu and s.entry is not None
            }
            sources = {
                id(landing[kc.key][0]): landing[kc.key][1] for kc in copies if kc.key in landing
            }
            entries = [
                landing[kc.key][0] if kc.key in landing else self.store.cpu.get(kc.key)
                for kc in copies
            ]
            missing = [
                kc.key
                for e, kc in zip(entries, copies, strict=True)
                if e is None or e.numel() != self.planner.entry_bytes(kc.copy.group)
            ]
        except Exception:  # a tier's fault, or a plan naming no group of the layout
            log.exception("hybridkv: reading the entries of %s failed", req_id)
            return None
        if missing:
            log.warning("hybridkv: %d entries of %s are not in CPU memory", len(missing), req_id)
            with self._lock:
                self._report.lost.extend(missing)
            return None
        return entries, sources

    def _fail(self, req_id: str) -> None:
        self.stats.failed_loads += 1
        self._failed.add(req_id)

    def _promote(self, epoch: int, items: list[tuple[bytes, str]]) -> None:
        """Read entries of lower tiers into CPU memory (a background thread), a slice at a
        time, each slice reported when it is read. After a clear the rest is not read:
        the index has forgotten those promotions."""
        for start in range(0, len(items), PROMOTE_SLICE_ENTRIES):
            if epoch != self.epoch or self._closing:
                with self._lock:
                    self.stats.failed_promotions += len(items) - start
                return
            chunk = items[start : start + PROMOTE_SLICE_ENTRIES]
            try:
                self._promote_slice(epoch, chunk)
            except Exception:  # the index waits for each key's result: report them failed
                log.exception("hybridkv: promoting %d entries failed", len(chunk))
                with self._lock:
                    if epoch != self.epoch:  # cleared since: a newer read of a key is not ours
                        self.stats.failed_promotions += len(chunk)
                        continue
                    unread = [key for key, _ in chunk if key in self._promoting]
                    self._promoting.difference_update(unread)
                    self._report.promoted.extend((epoch, key, False) for key in unread)
                    self.stats.failed_promotions += len(unread)

    def _promote_slice(self, epoch: int, items: list[tuple[bytes, str]]) -> None:
        """One slice, one batch per tier. Disk and Redis check each entry (size,
        fingerprint, key, checksum) before handing it out."""
        by_tier: dict[str, list[bytes]] = {}
        for key, tier in items:
            by_tier.setdefault(tier, []).append(key)
        read: list[tuple[bytes, str, torch.Tensor | None]] = []
        for name, keys in by_tier.items():
            tier = self.store.tier(name)
            started = time.perf_counter()
            try:
                entries = tier.get_many(keys) if tier is not None else [None] * len(keys)
            except Exception:
                log.exception("hybridkv: promoting %d entries from %s failed", len(keys), name)
                entries = [None] * len(keys)
            self._observe("load_seconds", name, started)
            self._count_read(name, (e for e in entries if e is not None))
            read += [(k, name, e) for k, e in zip(keys, entries, strict=True)]
        results = []
        with self._lock:
            for key, source, entry in read:
                if epoch != self.epoch or key not in self._promoting:
                    # Its promotion was settled: by a clear (a key promoted again since
                    # is the new epoch's read's), by the evict or delete order that took
                    # the key out, or by an earlier read of a newer promotion of it. The
                    # index matches reports by key: one now could fail a later promotion.
                    self.stats.failed_promotions += 1
                    continue
                ok = entry is not None and self._promoted(key, entry, source)
                self._promoting.discard(key)
                results.append((epoch, key, ok))
                if ok:
                    self.stats.promoted_entries += 1
                else:
                    self.stats.failed_promotions += 1
            self._report.promoted.extend(results)

    # ---- 2. end of the step: stores, then evictions --------------------------------------------
    def end_step(self, meta: HybridKVMetadata) -> None:
        try:
            self.save(meta)
        finally:
            self._saved = meta.step
            self.follow(meta.orders)
            self._land()

    def save(self, meta: HybridKVMetadata) -> None:
        """Copy this step's stores out, every entry of the step in one batch, then into
        the tiers; tagged ones are kept until a later step names them. A failure drops
        the step's stores (counted, and reported lost to the index): a missed store costs
        a future hit, never correctness."""
        copies = [kc for job in meta.stores for kc in job.copies]
        tagged = [tc for job in meta.stores for tc in job.tagged]
        if not copies and not tagged:
            return
        started = time.perf_counter()
        try:
            entries, landing = self.copies.gather_async([c.copy for c in (*copies, *tagged)])
        except Exception:
            log.exception("hybridkv: storing a step failed; its entries are dropped")
            self.stats.failed_stores += 1
            entries, landing = [None] * (len(copies) + len(tagged)), None
        items = [
            _Store(kc.key, e, kc.cpu, kc.below)
            for kc, e in zip(copies, entries[: len(copies)], strict=True)
        ]
        if landing is None:
            self._store(items)
            return
        reads = [frozenset(c.copy.block_ids) for c in (*copies, *tagged)]
        self._landing.append(_Landing(landing, items, entries, reads, started, meta.step))
        for tc, entry in zip(tagged, entries[len(copies) :], strict=True):
            self._staged[tc.tag] = (entry, landing)
        for job in meta.stores:
            self._tags.setdefault(job.req_id, []).extend(tc.tag for tc in job.tagged)
        self.sending.stored(
            (job.req_id for job in meta.stores if job.copies or job.tagged), landing
        )

    def name(self, meta: HybridKVMetadata) -> None:
        """Store the entries tagged in earlier steps that the scheduler side names now,
        under their keys, and drop the ones it drops."""
        try:
            for job in meta.stores:
                for n in job.named:
                    entry, landing = self._staged.pop(n.tag, (None, None))
                    if n.key is not None:  # a name finding no entry reports it lost
                        item = _Store(n.key, entry, n.cpu, n.below)
                        self._landing.append(_Landing(landing or LANDED, [item], step=meta.step))
            self._land()
        except Exception:
            log.exception("hybridkv: storing named entries failed")
            self.stats.hook_errors += 1

    def _land(self, wait: bool = False) -> None:
        """Hand the stores whose bytes are complete to the tiers, in the order they were
        made (`wait`: all of them, waiting for the copies still running)."""
        while self._landing:
            pending = self._landing[0]
            try:
                if not (wait or pending.landing.done()):
                    return
                pending.landing.wait()
            except Exception:
                # A failed copy (a device error): its stores are dropped, not retried at
                # every hook, and the index learns the CPU entries are not held.
                log.exception("hybridkv: a store's copy failed; its entries are dropped")
                self.stats.failed_stores += 1
                pending.items = [s._replace(entry=None) for s in pending.items]
            self._landing.pop(0)
            self._store(pending.items)
            if pending.started is not None:
                self._observe("store_seconds", "cpu", pending.started)

    def landed_through(self) -> int:
        """The newest step whose stores have all landed (read their blocks) on this rank:
        the scheduler side delays no finished request whose stores are all that old. A
        step whose stores are not even queued yet has not landed."""
        return self._landing[0].step - 1 if self._landing else self._saved

    @property
    def restoring(self) -> int:
        """Requests whose loads are not reported yet (entries still to write or landing)."""
        return len(self._restores)

    @property
    def staged_entries(self) -> int:
        """Entries kept under a tag, waiting for their names."""
        return len(self._staged)

    def _store(self, items: list[_Store]) -> None:
        """Put entries into the tiers; an entry the index counts in CPU memory that is
        missing or not taken is reported lost."""
        lost = []
        for s in items:
            stored = s.entry is not None and self._put(s)
            if stored:
                self.stats.stored_entries += 1
            if s.cpu and not stored:
                lost.append(s.key)
        if lost:
            with self._lock:
                self._report.lost.extend(lost)

    def _promoted(self, key: bytes, entry: torch.Tensor, source: str) -> bool:
        try:
            return self.store.promoted(key, entry, source)
        except Exception:
            log.exception("hybridkv: keeping a promoted entry failed")
            return False

    def _put(self, s: _Store) -> bool:
        """Whether the CPU tier took the entry (or, for a store below it only, any tier)."""
        assert s.entry is not None
        try:
            with self._lock:
                stored = self.store.put(s.key, s.entry, s.cpu, s.below)
                return self.store.cpu.contains(s.key) if s.cpu else stored
        except Exception:
            log.exception("hybridkv: storing an entry failed")
            return False

    def follow(self, orders: Orders) -> None:
        """Write down what CPU memory alone held (`persist`), then evict and delete (from
        CPU memory only: the lower tiers are shared, and a deleted entry never reached
        them); a store still landing is redirected or dropped, as if it had landed first.
        Nothing waits on a lower tier: they queue their writes."""
        persist, evict, delete = set(orders.persist), set(orders.evict), set(orders.delete)
        for pending in self._landing:
            pending.items = [
                s._replace(cpu=s.cpu and s.key not in evict, below=s.below or s.key in persist)
                for s in pending.items
                if s.key not in delete
            ]
        with self._lock:
            for key in orders.persist:
                entry = self.store.cpu.get(key)
                if entry is not None:
                    self.store.persist(key, entry)
            self._promoting.difference_update(evict | delete)
            for key in orders.evict:
                entry = self.store.cpu.get(key) if self.store.evicts_below else None
                self.stats.cpu_evictions += int(self.store.cpu.delete(key))
                if entry is not None:
                    self.store.evicted(key, entry)
            for key in orders.delete:
                self.store.cpu.delete(key)

    # ---- 3. reports ---------------------------------------------------------------------------
    def report(self) -> WorkerReport:
        """What the index must learn: promotions done, disk changes, entries lost.

        In a step without a forward, promotions under way get up to IDLE_WAIT_SECONDS
        to finish first. Nothing else runs in such a step, and without the wait the
        engine spins through empty steps that hold the GIL against the reading thread
        (measured: a disk restore then took 1.5x vLLM's own hit instead of about 1x)."""
        self._land()
        self._promotions = [f for f in self._promotions if not f.done()]
        if self._idle and self._promotions:
            wait(self._promotions, timeout=IDLE_WAIT_SECONDS)
        disk = self.store.disk
        if disk is not None:  # before the report is taken: a fault here loses none of it
            disk.rescan_if_stale()
        down = [tier.name for tier in self.store.tiers if not tier.up]
        with self._lock:
            report, self._report = self._report, WorkerReport()
            report.epoch = self.epoch
            if disk is not None:
                report.disk.extend(disk.take_changes())
        if down != self._reported_down:
            report.down = self._reported_down = down
        return report

    # ---- metrics ------------------------------------------------------------------------------
    def _observe(self, histogram: str, tier: str, started: float) -> None:
        """Record the seconds since `started` (promotion threads call it too)."""
        elapsed = time.perf_counter() - started
        with self._lock:
            self._latencies.setdefault(histogram, {}).setdefault(tier, []).append(elapsed)

    def _count_read(self, tier: str, entries: Iterable[torch.Tensor]) -> None:
        n = sum(e.numel() * e.element_size() for e in entries)
        with self._lock:
            self.stats.read_bytes[tier] = self.stats.read_bytes.get(tier, 0) + n

    def metrics(self) -> tuple[Figures, Figures, Observations]:
        """Cumulative counters and current gauges by tier, and the latencies observed
        since the last call, for reports (core/metrics.py)."""
        tiers = self.store.stats()
        counters: Figures = {
            "evictions": {name: s.evictions for name, s in tiers.items()},
            "dropped_stores": {
                name: s.dropped_puts + s.rejected_puts + s.write_errors for name, s in tiers.items()
            },
            "damaged_entries": {name: s.corrupt for name, s in tiers.items()},
            "errors": {"none": self.stats.hook_errors},
        }
        counters["evictions"]["cpu"] += self.stats.cpu_evictions
        gauges = {
            "occupancy_bytes": {name: s.bytes_used for name, s in tiers.items()},
            "tier_up": {t.name: int(t.up) for t in self.store.tiers},
            "host_memory_bytes": {"cpu": self.store.pool.resident_bytes},
        }
        with self._lock:  # promotion threads add to these
            counters["loaded_bytes"] = dict(self.stats.read_bytes)
            counters["stored_bytes"] = dict(self.store.stored_bytes)
            latencies, self._latencies = self._latencies, {}
        return counters, gauges, latencies

    def transfer_results(self, finished: Iterable[str] = ()) -> TransferResults:
        """Loads finished since the last call: failed ones are received too (vLLM must
        release the request from its wait either way); and the requests vLLM delayed
        whose stores have all landed. `finished`: vLLM's requests finished since the
        last step (their loads and tags ended at the step's start: `_end_finished`)."""
        self._finish_loads()
        sending = self.sending.finished(finished)
        out = TransferResults(self._received | self._failed, self._failed, sending)
        self._received, self._failed = set(), set()
        return out

    def close(self) -> None:
        """Land the stores, stop promoting (a read at shutdown serves nothing, and would
        hold up the disk writes still queued, which vLLM's executor gives seconds before
        it kills the worker), then drain and close the tiers."""
        self._land(wait=True)
        self._closing = True
        self._promoter.shutdown(wait=True, cancel_futures=True)
        self.store.close()
