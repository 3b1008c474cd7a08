"""Worker side of the connector: one per tensor-parallel rank, in the process that owns the
rank's KV cache. It holds the rank's share of every entry and does what the step's
orders say; it decides nothing.

Each step (vLLM calls the hooks in this order):
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
   landed in its blocks.

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
    started: float | None = None  # perf_counter() when a step's stores began (timed)


@dataclass
class _Restore:
    """A request's load not reported yet: the entries still to write (held here: the
    index may evict them once the load is sent, and a held entry's memory is not
    reused), and the copy that wrote the last ones."""

    req_id: str
    pending: list[tuple[EntryCopy, torch.Tensor]]
    landing: Landing = LANDED


@dataclass
class TransferResults:
    received: set[str]
    failed: set[str]


class WorkerSide:
    def __init__(
        self, planner: Planner, store: TieredStore, rank: int = 0, load_step_bytes: int = 0
    ):
        self.planner = planner
        self.store = store
        self.rank = rank
        self.load_step_bytes = load_step_bytes  # 0: every load in the step it is sent
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
        self._promoter = ThreadPoolExecutor(
            1, thread_name_prefix="hybridkv-promote", initializer=lower_priority
        )
        self._promotions: list[Future] = []
        self._idle = False
        # Entries gathered before their keys were known, by tag, until named or dropped.
        self._staged: dict[int, tuple[torch.Tensor, Landing]] = {}
        # Stores still being copied out, oldest first (see `_land`).
        self._landing: list[_Landing] = []
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

    # ---- 1. start of the step: clear, loads, promotions ----------------------------------------
    def begin_step(self, meta: HybridKVMetadata) -> None:
        """Whatever fails on the way, every load of the step is still reported (vLLM
        keeps its request waiting until it is)."""
        self._idle = meta.idle
        self.epoch = meta.epoch
        try:
            self._land()
            if meta.orders.clear:
                self._clear()
            self.name(meta)
        finally:
            self.load(meta)
        if meta.orders.promote:
            future = self._promoter.submit(self._promote, meta.epoch, list(meta.orders.promote))
            self._promotions.append(future)

    def _clear(self) -> None:
        """Drop what this engine stored, stores still landing included; the next report
        lists the disk afresh (what other engines stored there stays)."""
        for pending in self._landing:
            pending.items = []
        with self._lock:
            self.store.clear()
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
            entries = None if job.failed else self._entries(job.req_id, job.copies)
            if entries is None:
                self._fail(job.req_id)
            else:
                pending = [(kc.copy, e) for kc, e in zip(job.copies, entries, strict=True)]
                self._restores.append(_Restore(job.req_id, pending))
        batch, touched, spent = self._next_batch()  # every entry's group checked above
        if not batch:
            return
        try:
            started = time.perf_counter()
            landing = self.copies.scatter(batch)
            self._observe("load_seconds", "cpu", started)
        except Exception:
            # Blocks may be half written; vLLM recomputes every one of these requests.
            log.exception("hybridkv: restoring %d requests failed", len(touched))
            self._drop_failed(touched)
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

    def _drop_failed(self, restores: list[_Restore]) -> None:
        """Report `restores` failed (vLLM recomputes them) and stop writing them."""
        for restore in restores:
            self._fail(restore.req_id)
            self._restores.remove(restore)

    def _finish_loads(self) -> None:
        """Report the requests whose every entry is written and landed (a GPU copy runs
        on a side stream: vLLM schedules the request only once it is reported, so its
        forward never reads a block still being written). A copy that cannot say it
        landed (a device error) fails its requests: they must not wait forever."""
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
        self._drop_failed(broken)
        for restore in done:
            self._restores.remove(restore)
            self._received.add(restore.req_id)
        self.stats.loads += len(done)

    def _entries(self, req_id: str, copies: Sequence) -> list[torch.Tensor] | None:
        """The entries of a load from CPU memory, or from stores still landing (a load
        runs on the same stream as the store that copies them out, so after it)."""
        try:
            landing = {s.key: s.entry for p in self._landing for s in p.items if s.cpu}
            entries = [
                landing[kc.key] if kc.key in landing else self.store.cpu.get(kc.key)
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
        return entries

    def _fail(self, req_id: str) -> None:
        self.stats.failed_loads += 1
        self._failed.add(req_id)

    def _promote(self, epoch: int, items: list[tuple[bytes, str]]) -> None:
        """Read entries of lower tiers into CPU memory (a background thread), a slice at a
        time, each slice reported when it is read. After a clear the rest is not read:
        the index has forgotten those promotions."""
        for start in range(0, len(items), PROMOTE_SLICE_ENTRIES):
            if epoch != self.epoch:
                with self._lock:
                    self.stats.failed_promotions += len(items) - start
                return
            self._promote_slice(epoch, items[start : start + PROMOTE_SLICE_ENTRIES])

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
                ok = (
                    entry is not None and epoch == self.epoch and self._promoted(key, entry, source)
                )
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
        self._landing.append(_Landing(landing, items, entries, started))
        for tc, entry in zip(tagged, entries[len(copies) :], strict=True):
            self._staged[tc.tag] = (entry, landing)

    def name(self, meta: HybridKVMetadata) -> None:
        """Store the entries tagged in earlier steps that the scheduler side names now,
        under their keys, and drop the ones it drops."""
        try:
            for job in meta.stores:
                for n in job.named:
                    entry, landing = self._staged.pop(n.tag, (None, None))
                    if n.key is not None:  # a name finding no entry reports it lost
                        item = _Store(n.key, entry, n.cpu, n.below)
                        self._landing.append(_Landing(landing or LANDED, [item]))
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
        with self._lock:
            report, self._report = self._report, WorkerReport()
            report.epoch = self.epoch
            if disk is not None:
                report.disk.extend(disk.take_changes())
        if disk is not None:
            disk.rescan_if_stale()
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
        }
        counters["evictions"]["cpu"] += self.stats.cpu_evictions
        gauges = {
            "occupancy_bytes": {name: s.bytes_used for name, s in tiers.items()},
            "tier_up": {t.name: int(t.up) for t in self.store.tiers},
        }
        with self._lock:  # promotion threads add to these
            counters["loaded_bytes"] = dict(self.stats.read_bytes)
            counters["stored_bytes"] = dict(self.store.stored_bytes)
            latencies, self._latencies = self._latencies, {}
        return counters, gauges, latencies

    def transfer_results(self) -> TransferResults:
        """Loads finished since the last call: failed ones are received too (vLLM must
        release the request from its wait either way)."""
        self._finish_loads()
        out = TransferResults(self._received | self._failed, self._failed)
        self._received, self._failed = set(), set()
        return out

    def close(self) -> None:
        self._land(wait=True)
        self._promoter.shutdown(wait=True)
        self.store.close()
