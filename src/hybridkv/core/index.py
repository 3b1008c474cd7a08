"""What the workers hold, as the scheduler side knows it: the one place hits, CPU-tier
admission and CPU-tier eviction are decided.

The bytes live in the workers (one per tensor-parallel rank, each in its own process on
a GPU server), which only do what the step's orders say. The index is therefore exact for
the CPU tier: an entry is in every rank's memory from the step that stores it until the
step that evicts it, and nothing else evicts it. So a hit whose entries are all in CPU
memory is reported at once and its load cannot miss.

The disk tier keeps its own budget and may be shared with other engines, so for it the
index is a hint built from the workers' reports: a key is on disk once every rank has
reported it. A shared tier (Redis) is written by other replicas too: for it the hint
comes from probes the scheduler side makes off its thread (`hint`), and lapses. A hit
that needs a lower tier's entry is never reported from a hint: the entry is
first *promoted* (read by every rank in the background, verified, put in CPU memory) and
the lookup answers "ask again" meanwhile, so the scheduler never waits on a read and a
damaged file is a miss before the hit is reported, never a failed load.

`StoreIndex` joins four parts, each in its own module:
- the byte ledger and pins (core/ledger.py): every entry in CPU memory with its bytes,
  the budget, and the entries that may not be evicted (pinned by a pending hit or load
  or a running request, or being promoted);
- the boundary graph (core/boundary_graph.py), with recurrent groups: the boundaries in
  CPU memory, what each needs, the chain tree between them, and the orphans;
- the eviction policy (core/eviction.py): LRU, or boundaries by segment and rank with
  recurrent groups; told every change, asked for victims when an admission needs room;
- the lower tiers (core/lower_tiers.py): disk entries from the workers' reports, shared
  tiers from probes.
The scheduler side calls it on vLLM's scheduler thread, where every millisecond stalls
every running request, so no call passes over everything it holds: each costs O(log n)
(or O(1)) per entry it touches (bench/lookup.py, docs/benchmarks.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.core.boundary_graph import BoundaryGraph, check_keys
from hybridkv.core.eviction import BoundaryPolicy, EvictionPolicy, LruPolicy
from hybridkv.core.keytable import first_found
from hybridkv.core.ledger import Ledger
from hybridkv.core.lower_tiers import LowerTiers


class IndexListener(Protocol):
    """Told of every change to what a hit may read (KV cache events follow it): an entry
    entering or leaving CPU memory (ready to read: a promotion counts once it is done)
    or the disk tier (every rank holds it), and a clear of both."""

    def changed(self, tier: str, key: bytes, present: bool) -> None: ...

    def cleared(self) -> None: ...


@dataclass
class IndexStats:
    """Monotonic counters (they only ever grow)."""

    cpu_evictions: int = 0
    promotions: int = 0  # entries read from a lower tier into every rank's memory
    failed_promotions: int = 0  # a rank could not read or verify the entry
    lost: int = 0  # entries a rank reported it does not hold after all (a failed store)
    cpu_full: int = 0  # entries not admitted to CPU memory: the rest of it was pinned
    unservable: int = 0  # boundaries not admitted: a chunk a hit there reads is nowhere
    evicted_orphans: int = 0  # attention chunks evicted because no boundary needed them
    evicted_boundaries: int = 0  # boundaries evicted for their low utility
    evicted_superseded: int = 0  # boundaries evicted because one longer one served past them


@dataclass
class Orders:
    """What the workers must do to follow the index, gathered until the next step."""

    evict: list[bytes] = field(default_factory=list)  # drop from CPU memory only
    # Drop from CPU memory, written to no tier below: worth nothing (a staged state replaced).
    delete: list[bytes] = field(default_factory=list)
    # Write to the lower tiers what CPU memory alone held so far (a finished request's last
    # decode-time state), as a store would have.
    persist: list[bytes] = field(default_factory=list)
    # (key, tier): read from that tier into CPU memory
    promote: list[tuple[bytes, str]] = field(default_factory=list)
    clear: bool = False  # drop everything this engine stored (before the rest)


@dataclass
class WorkerReport:
    """What one worker tells the index after a step (through vLLM's worker metadata)."""

    epoch: int = 0  # of the orders the worker followed last
    promoted: list[tuple[int, bytes, bool]] = field(default_factory=list)  # (epoch, key, ok)
    disk: list[tuple[bytes, bool]] = field(default_factory=list)  # key entered/left the disk
    lost: list[bytes] = field(default_factory=list)  # CPU entries it does not hold after all
    listed: bool = False  # `disk` lists every entry on its disk (its first report)
    # Its tiers that are down now (a dead Redis), when that changed since its last
    # report; None: unchanged.
    down: list[str] | None = None

    def __bool__(self) -> bool:
        return bool(self.promoted or self.disk or self.lost or self.listed or self.down is not None)

    def merge(self, later: WorkerReport) -> WorkerReport:
        return WorkerReport(
            later.epoch,
            self.promoted + later.promoted,
            self.disk + later.disk,
            self.lost + later.lost,
            self.listed or later.listed,
            self.down if later.down is None else later.down,
        )


class StoreIndex:
    def __init__(
        self,
        cpu_capacity: int,
        ranks: int = 1,
        disk: bool = False,
        recurrent: bool = False,
        alpha: float = 0.25,
    ):
        """`cpu_capacity`: bytes of CPU memory for entries, over all ranks. `ranks`: how
        many workers must report an entry before it counts as theirs. `disk`: the
        workers have a disk tier, and the index is not `ready` until each has listed
        it. `recurrent`: hits need boundaries (core/eviction.py); `alpha` weighs prefill
        saved per byte against recency when evicting them."""
        self.ranks = ranks
        self.recurrent = recurrent
        self.alpha = alpha
        self.ledger = Ledger(cpu_capacity, ranks)
        self._boundaries = BoundaryPolicy(self.ledger, alpha) if recurrent else None
        self.graph: BoundaryGraph | None = self._boundaries and self._boundaries.graph
        self.policy: EvictionPolicy = self._boundaries or LruPolicy(self.ledger)
        self.ledger.watcher = self.policy
        self.lower = LowerTiers(ranks)
        self._listed: set[int] | None = set() if disk else None
        self._sources: dict[bytes, str] = {}  # promotions under way: key -> tier read
        self.promoted_from: Counter[str] = Counter()  # promotions done, by tier
        self.failed_from: Counter[str] = Counter()  # promotions failed, by tier
        self.epoch = 0  # advanced by `clear`: reports from an older epoch are stale
        self.orders = Orders()  # what the next step's metadata carries (evict, delete: below)
        # This step's evictions and deletions, in order (an entry stored again leaves them).
        self._evict: dict[bytes, None] = {}
        self._delete: dict[bytes, None] = {}
        self.stats = IndexStats()
        self.listener: IndexListener | None = None

    @property
    def capacity(self) -> int:
        return self.ledger.capacity

    @capacity.setter
    def capacity(self, nbytes: int) -> None:
        self.ledger.capacity = nbytes
        self.policy.resize()

    # ---- questions ------------------------------------------------------------------------
    @property
    def has_disk(self) -> bool:
        """The workers have a disk tier (its entries are reported here)."""
        return self._listed is not None

    def ready(self) -> bool:
        """Every rank has listed its disk (always, without one): until then a lookup
        would miss what an earlier process stored."""
        return self._listed is None or len(self._listed) >= self.ranks

    def in_cpu(self, key: bytes) -> bool:
        return key in self.ledger.sizes and key not in self.ledger.promoting

    def present(self, keys: Iterable[bytes]) -> list[bytes]:
        """Of `keys`, those counted in CPU memory (or on their way there): one call."""
        return self.ledger.sizes.present(keys)

    def promoting(self, key: bytes) -> bool:
        return key in self.ledger.promoting

    def any_promoting(self, keys: Iterable[bytes]) -> bool:
        """Whether any of `keys` is being promoted (none is, nearly always: one test)."""
        promoting = self.ledger.promoting
        return bool(promoting) and any(key in promoting for key in keys)

    def not_ready(self, keys: list[bytes]) -> list[bytes]:
        """Of `keys`, in their order, those not `in_cpu` (absent, or being promoted): one
        call for a hit's hundreds."""
        promoting, sizes = self.ledger.promoting, self.ledger.sizes
        if not promoting:
            return sizes.missing(keys)
        return [key for key in keys if key in promoting or key not in sizes]

    def on_disk(self, key: bytes) -> bool:
        return self.lower.on_disk(key)

    def boundary_id(self, key: bytes) -> bytes | None:
        """The id of the boundary `key` is a state of, if its states are all in CPU memory."""
        b = self.graph.boundary(key) if self.graph is not None else None
        return self.graph.rows.bid(b) if b is not None else None

    def nearest_boundary(self, keys: list[bytes]) -> tuple[int, bytes] | None:
        """The first of `keys` that is a state of a boundary in CPU memory, as its place
        in `keys` and the boundary's id (`boundary_id`); None if none is. One call for
        a chain's chunks, nearest first."""
        if self.graph is None:
            return None
        state_of = self.graph.state_of

        def held(block: Sequence[bytes]) -> list[bytes]:
            rows = state_of.get_many(block, None)
            return [key for key, b in zip(block, rows, strict=True) if b is not None]

        i = first_found(keys, held)
        return (i, self.graph.rows.bid(state_of[keys[i]])) if i < len(keys) else None

    def on_tier(self, key: bytes, tier: str) -> bool:
        """In a tier below CPU memory, as far as the index knows."""
        if tier == "disk":
            return self.on_disk(key)
        return self.lower.on_tier(key, tier)

    def known(self, key: bytes) -> bool:
        """Held somewhere, or on its way: worth planning a hit around."""
        return (
            key in self.ledger.sizes
            or self.on_disk(key)
            or any(self.lower.on_tier(key, tier) for tier in self.lower.tiers)
        )

    def unknown(self, keys: Iterable[bytes]) -> list[bytes]:
        """Of `keys`, those not `known`: one call for a store's dozens."""
        lower = self.lower
        keys = [key for key in self.ledger.sizes.missing(keys) if not lower.on_disk(key)]
        for tier in lower.tiers:
            keys = lower.not_hinted(tier, keys)
        return keys

    def known_in(self, key: bytes, tier: str | None) -> bool:
        """In CPU memory (or on its way there), or in `tier`."""
        if key in self.ledger.sizes:
            return True
        if tier is None:
            return False
        return self.lower.on_disk(key) if tier == "disk" else self.lower.on_tier(key, tier)

    def unknown_in(self, keys: Iterable[bytes], tier: str) -> list[bytes]:
        """Of `keys`, those neither in CPU memory (or on their way) nor in `tier`:
        `known_in` for all the keys of a lookup at once."""
        keys = self.ledger.sizes.missing(keys)
        if tier == "disk":
            return [key for key in keys if not self.lower.on_disk(key)]
        return self.lower.not_hinted(tier, keys)

    def known_run(self, keys: list[bytes], tier: str | None) -> int:
        """How many of `keys`, from the first, are `known_in` `tier` (None: CPU memory
        alone): a lookup's run of chunks in one call. The keys are distinct (a chain's)."""
        if tier is None:
            return first_found(keys, self.ledger.sizes.missing)
        return first_found(keys, lambda block: self.unknown_in(block, tier))

    def hint(self, tier: str, keys: Iterable[bytes], until: float) -> None:
        """A probe found `keys` in a shared tier: trust it until `until` (monotonic)."""
        self.lower.hint(tier, keys, until)

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> None:
        self.ledger.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Release one pin of each key (a key no longer pinned is evictable again)."""
        self.ledger.unpin(keys)

    def pinned(self) -> int:
        return self.ledger.pinned

    # ---- CPU memory -------------------------------------------------------------------------
    def touch(self, keys: Iterable[bytes]) -> None:
        self.policy.touch(self.ledger.sizes.present(keys))

    def admit_boundary(
        self,
        states: list[tuple[bytes, int]],
        needs: list[bytes],
        tokens: int,
        own_bytes: int,
        parent: bytes | None = None,
    ) -> bool:
        """Count in the states of one boundary (key, bytes on one rank), all or none.
        `needs`: the attention entries a hit at `tokens` also reads; `own_bytes`: what
        keeping the boundary costs beyond what shorter boundaries of its chain already
        cost (its states and the chunks after the previous boundary); `parent`: that
        previous boundary's id (`boundary_id`), if any. Without recurrent groups the
        states are entries like any other. States all in CPU memory already but not as
        a boundary (promoted) become one."""
        if self._boundaries is not None:
            check_keys([key for key, _ in states], needs)
        new = [(key, n * self.ranks) for key, n in states if key not in self.ledger.sizes]
        # States in CPU memory as plain entries (promoted one by one for a hit from a
        # lower tier) are counted in as the boundary they are.
        if not new and (self.graph is None or self.graph.state_of.get(states[0][0]) is not None):
            self.touch(key for key, _ in states)
            return True
        missing = self.ledger.sizes.missing(needs)
        if missing and self.unknown(missing):
            # A chunk a hit here reads is nowhere (not admitted, or spilled this step and
            # not reported yet): the states would hold budget and serve nothing.
            self.stats.unservable += 1
            return False
        # Kept while room is made for the new states: the states held already (left by a
        # boundary one state of which was lost: evicting one would admit the boundary
        # short) and the chunks a hit here reads (the chain's previous boundary, a leaf,
        # would otherwise go with them and leave this one unservable).
        held = [key for key, _ in states if key in self.ledger.sizes]
        if not self._make_room(sum(n for _, n in new), held + needs):
            self.stats.cpu_full += len(new)
            return False
        for key, nbytes in new:
            self._insert(key, nbytes)
        if self._boundaries is not None:
            self._boundaries.add_boundary(
                [key for key, _ in states],
                [key for key, _ in new],
                needs,
                tokens,
                own_bytes * self.ranks,
                parent,
            )
        else:
            for key, _ in new:
                self.policy.entered(key)
        return True

    def admit(self, key: bytes, nbytes: int) -> bool:
        """Make room for a new entry (evicting by the policy) and count it in; False, and
        nothing evicted, if it cannot fit."""
        if key in self.ledger.sizes:
            self.policy.used(key)
            return True
        nbytes *= self.ranks
        if not self._make_room(nbytes):
            self.stats.cpu_full += 1
            return False
        self._insert(key, nbytes)
        self.policy.entered(key)
        return True

    def _insert(self, key: bytes, nbytes: int) -> None:
        self.ledger.insert(key, nbytes)
        if self.listener is not None and key not in self.ledger.promoting:
            self.listener.changed("cpu", key, True)
        # Dropped earlier this step and stored again: the workers' copy stays good.
        self._evict.pop(key, None)
        self._delete.pop(key, None)

    def fits(self, nbytes: int) -> bool:
        """Whether entries of `nbytes` on one rank fit without evicting."""
        return self.ledger.capacity - self.ledger.used >= nbytes * self.ranks

    def make_room(self, nbytes: int) -> bool:
        """Evict (by the policy) until entries of `nbytes` on one rank fit, ahead of
        their admissions; False, and nothing evicted, if they cannot."""
        return self._make_room(nbytes * self.ranks)

    def _make_room(self, nbytes: int, keep: list[bytes] | None = None) -> bool:
        """Evict until `nbytes` more fit, never one of `keep`; False, and nothing evicted,
        if they cannot."""
        ledger = self.ledger
        if nbytes > ledger.capacity:
            return False
        free = ledger.capacity - ledger.used
        if free >= nbytes:
            return True
        if keep:  # pinned only now: nearly every admission fits without evicting
            ledger.pin(keep)
            try:
                choice = self.policy.victims(nbytes - free)
            finally:
                ledger.unpin(keep)
        else:
            choice = self.policy.victims(nbytes - free)
        if choice is None:
            return False
        self._evict_keys(choice.keys)
        self.stats.evicted_orphans += choice.orphans
        self.stats.evicted_superseded += choice.superseded
        self.stats.evicted_boundaries += choice.boundaries
        return True

    def evict_all(self) -> int:
        """Evict every unpinned entry from CPU memory (what stays below is still found);
        how many."""
        victims = [key for key in self.ledger.sizes if not self.ledger.held(key)]
        self._evict_keys(victims)
        return len(victims)

    def _evict_keys(self, keys: list[bytes]) -> None:
        """Drop `keys` from CPU memory as one eviction, the workers told to."""
        self._drop_cpu(keys)
        self._evict.update(dict.fromkeys(keys))
        self.stats.cpu_evictions += len(keys)

    def _drop_cpu(self, keys: Sequence[bytes]) -> None:
        """Forget entries that leave CPU memory together (an eviction, or one), each
        layer told once for all of them: no layer needs telling apart when an eviction
        ends (one call per layer was not measurably faster than one per key in
        bench/lookup.py's stream: docs/benchmarks.md)."""
        if self.listener is not None:
            for key in keys:
                if self.in_cpu(key):
                    self.listener.changed("cpu", key, False)
        self.ledger.remove(keys)
        if self._sources:
            for key in keys:
                self._sources.pop(key, None)
        self.policy.left(keys)

    def withdraw(self, keys: list[bytes]) -> None:
        """Forget entries admitted for stores that were never sent (planning them failed):
        no worker holds them, but one may still hold an older copy it was told to evict
        earlier this step, before the admission undid that order."""
        keys = self.present(keys)
        self._drop_cpu(keys)
        self._evict.update(dict.fromkeys(keys))

    def delete(self, key: bytes) -> None:
        """Forget an entry worth nothing any more (a decode-time state its request staged,
        then replaced): the workers drop it from CPU memory, and no tier below ever had
        it. A pinned entry (a pending hit reads it) stays."""
        if self.ledger.is_pinned(key):
            return
        self._drop_cpu([key])
        self._delete[key] = None

    def persist(self, keys: Iterable[bytes]) -> None:
        """Have the workers write entries CPU memory alone held (a finished request's last
        decode-time state) to the lower tiers."""
        self.orders.persist.extend(k for k in keys if k in self.ledger.sizes)

    # ---- promotions -----------------------------------------------------------------------
    def promote(self, key: bytes, nbytes: int, tier: str = "disk") -> bool:
        """Have every rank read an entry from `tier` into CPU memory; False if there is
        no room (the hit then stops short of it). A promotion under way is not started
        again."""
        if key in self.ledger.sizes:
            return True
        self.ledger.start_promotion(key)  # first: not ready to read while it is read in
        if not self.admit(key, nbytes):
            self.ledger.cancel_promotion(key)
            return False
        self._sources[key] = tier
        self.orders.promote.append((key, tier))
        return True

    def source(self, epoch: int, key: bytes) -> str | None:
        """The tier the promotion of `key` under way (in `epoch`) reads from, if any."""
        if epoch != self.epoch or key not in self.ledger.promoting:
            return None
        return self._sources.get(key)

    def promoted(self, epoch: int, rank: int, key: bytes, ok: bool) -> None:
        """A rank's report on a promotion. Any rank's failure fails it for all (ranks that
        read it are told to drop it); it is in CPU memory once every rank has it."""
        if epoch != self.epoch or key not in self.ledger.promoting:
            return
        if not ok:
            self.stats.failed_promotions += 1
            tier = self._sources.get(key, "disk")
            self.failed_from[tier] += 1
            self._drop_cpu([key])
            self._evict[key] = None
            # Damaged or gone there: never planned around again (a probe may find it anew).
            if tier == "disk":
                self._forget_disk(key)
            else:
                self.lower.forget_hint(tier, key)
            return
        if self.ledger.promoted_on(key, rank):
            self.stats.promotions += 1
            self.promoted_from[self._sources.pop(key, "disk")] += 1
            if self.listener is not None:
                self.listener.changed("cpu", key, True)

    # ---- worker reports -------------------------------------------------------------------
    def disk_changed(self, epoch: int, rank: int, key: bytes, present: bool) -> None:
        if epoch != self.epoch:
            return
        before = self.on_disk(key)
        self.lower.disk_changed(rank, key, present)
        if self.listener is not None and self.on_disk(key) != before:
            self.listener.changed("disk", key, not before)

    def _forget_disk(self, key: bytes) -> None:
        """Plan no hit around `key` on disk again (a read of it failed)."""
        if self.listener is not None and self.on_disk(key):
            self.listener.changed("disk", key, False)
        self.lower.forget_disk(key)

    def lost(self, epoch: int, key: bytes) -> None:
        """A rank does not hold an entry the index has in CPU memory (its store failed)."""
        if epoch == self.epoch and self.in_cpu(key):
            self.stats.lost += 1
            self._drop_cpu([key])
            self._evict[key] = None

    def apply(self, rank: int, report: WorkerReport) -> None:
        if report.listed and report.epoch == self.epoch and self._listed is not None:
            self._listed.add(rank)
        for epoch, key, ok in report.promoted:
            self.promoted(epoch, rank, key, ok)
        for key, present in report.disk:
            self.disk_changed(report.epoch, rank, key, present)
        for key in report.lost:
            self.lost(report.epoch, key)

    # ---- steps ----------------------------------------------------------------------------
    def take_orders(self) -> Orders:
        orders, self.orders = self.orders, Orders()
        orders.evict, orders.delete = list(self._evict), list(self._delete)
        self._evict, self._delete = {}, {}
        return orders

    def clear(self) -> None:
        """Forget everything; the workers drop what this engine stored. Pins stay (their
        requests release them) but protect nothing any more."""
        self.ledger.clear()
        self.policy.clear()
        self.lower.clear()
        self._sources.clear()
        self.epoch += 1
        self.orders = Orders(clear=True)
        self._evict, self._delete = {}, {}
        if self.listener is not None:
            self.listener.cleared()

    def gauges(self) -> dict[str, int]:
        return {
            "cpu_entries": len(self.ledger.sizes),
            "cpu_bytes": self.ledger.used,
            "cpu_capacity_bytes": self.capacity,
            "disk_entries": self.lower.disk_entries,
            "promoting": len(self.ledger.promoting),
            "cpu_boundaries": self.graph.count if self.graph is not None else 0,
            "held_entries": self.pinned(),
        }
