"""The slow reference for tests/test_index_scale.py: core/index.py as it was at 2cd1352,
before the index was split and made to cost O(log n) per change (issue 27). Only this
docstring, the import of its eviction module (tests/reference_eviction.py) and of the
data it shares with the index (stats, orders, reports: unchanged) differ, and
`admit_boundary`, which since refuses a boundary a chunk of which is nowhere and keeps
its held states and its chunks while it makes room (as core/index.py does).
What it keeps and why is core/index.py's and core/eviction.py's docstrings.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable

from reference_eviction import Boundary, eviction_order

from hybridkv.core.index import IndexListener, IndexStats, Orders, WorkerReport

# With recurrent groups and at least AHEAD_FROM boundaries held (a choice among them then
# takes about a millisecond), eviction frees 1/EVICT_AHEAD of the budget beyond what is
# needed. Below that, freeing ahead would only cost hits (about 2% of a 4 MiB budget's).
EVICT_AHEAD = 64
AHEAD_FROM = 256
# Leaf boundaries reused since admission keep up to this share of the budget ahead of the
# others (segmented LRU's protected segment; core/eviction.py).
PROTECTED = 0.8
# Attention chunks evicted from CPU memory are remembered (key -> last use) in a bounded
# list, GHOSTS_PER_ENTRY times as many as CPU memory holds (at least GHOSTS_MIN): one
# stored again is a *return* (core/eviction.py). While more than LOOPING_SHARE of the
# chunks admitted lately (a running mean over about RETURN_WINDOW) are returns, the
# workload is taken to loop, and a boundary idle for more than LIVE_GAPS times the
# typical return gap is dead.
GHOSTS_PER_ENTRY = 4
GHOSTS_MIN = 1024
RETURN_WINDOW = 64
LOOPING_SHARE = 0.5
LIVE_GAPS = 4.0


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
        it. `recurrent`: hits need boundaries (see the module docstring); `alpha`
        weighs prefill saved per byte against recency when evicting them."""
        self.capacity = cpu_capacity
        self.ranks = ranks
        self.recurrent = recurrent
        self.alpha = alpha
        self._tick = 0  # logical clock of uses
        self._boundaries: dict[bytes, Boundary] = {}  # by its first state key
        self._boundary_of: dict[bytes, bytes] = {}  # state key -> its boundary's id
        self._needed_by: dict[bytes, set[bytes]] = {}  # attention key -> boundary ids
        self._children: dict[bytes, set[bytes]] = {}  # boundary id -> its children's ids
        # Entries that may be orphans, LRU first (a superset: the eviction scan drops the
        # ones that are not), so that it need not look at every entry in CPU memory.
        self._loose: OrderedDict[bytes, None] = OrderedDict()
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()  # evicted chunk -> last use
        self._return_gap = 0.0  # running mean of returns' gaps, in ticks
        self._return_share = 0.0  # running share of the chunks admitted that are returns
        self._listed: set[int] | None = set() if disk else None
        self._cpu: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes, LRU first
        self._used = 0
        self._promoting: dict[bytes, set[int]] = {}  # key -> ranks that reported it read
        self._disk: dict[bytes, set[int]] = {}  # key -> ranks that reported it stored
        self._hints: dict[str, dict[bytes, float]] = {}  # tier -> key -> good until
        self._sources: dict[bytes, str] = {}  # promotions under way: key -> tier read
        self.promoted_from: Counter[str] = Counter()  # promotions done, by tier
        self._pins: Counter[bytes] = Counter()
        self.epoch = 0  # advanced by `clear`: reports from an older epoch are stale
        self.orders = Orders()
        self.stats = IndexStats()
        self.listener: IndexListener | None = None

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
        return key in self._cpu and key not in self._promoting

    def promoting(self, key: bytes) -> bool:
        return key in self._promoting

    def on_disk(self, key: bytes) -> bool:
        ranks = self._disk.get(key)
        return ranks is not None and len(ranks) >= self.ranks

    def boundary_id(self, key: bytes) -> bytes | None:
        """The id of the boundary `key` is a state of, if its states are all in CPU memory."""
        return self._boundary_of.get(key)

    def on_tier(self, key: bytes, tier: str) -> bool:
        """In a tier below CPU memory, as far as the index knows."""
        if tier == "disk":
            return self.on_disk(key)
        until = self._hints.get(tier, {}).get(key)
        return until is not None and until > time.monotonic()

    def known(self, key: bytes) -> bool:
        """Held somewhere, or on its way: worth planning a hit around."""
        return (
            key in self._cpu
            or self.on_disk(key)
            or any(self.on_tier(key, tier) for tier in self._hints)
        )

    def known_in(self, key: bytes, tier: str | None) -> bool:
        """In CPU memory (or on its way there), or in `tier`."""
        return key in self._cpu or (tier is not None and self.on_tier(key, tier))

    def hint(self, tier: str, keys: Iterable[bytes], until: float) -> None:
        """A probe found `keys` in a shared tier: trust it until `until` (monotonic)."""
        hints = self._hints.setdefault(tier, {})
        now = time.monotonic()
        for key in [k for k, t in hints.items() if t <= now]:
            del hints[key]
        hints.update(dict.fromkeys(keys, until))

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> None:
        self._pins.update(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Release one pin of each key (a key no longer pinned leaves the counter)."""
        for key in keys:
            left = self._pins[key] - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    def pinned(self) -> int:
        return sum(self._pins.values())

    # ---- CPU memory -------------------------------------------------------------------------
    def touch(self, keys: Iterable[bytes]) -> None:
        self._tick += 1
        for key in keys:
            if key in self._cpu:
                self._cpu.move_to_end(key)
                if key in self._loose:
                    self._loose.move_to_end(key)
                bid = self._boundary_of.get(key)
                if bid is not None:
                    b = self._boundaries[bid]
                    b.used, b.reused = self._tick, True

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
        previous boundary's id (`boundary_id`), if any."""
        new = [(key, n * self.ranks) for key, n in states if key not in self._cpu]
        if not new and (not self.recurrent or states[0][0] in self._boundary_of):
            self.touch(key for key, _ in states)
            return True
        if not all(self.known(key) for key in needs):
            self.stats.unservable += 1
            return False
        keep = [key for key, _ in states if key in self._cpu] + list(needs)
        self.pin(keep)
        try:
            room = self._make_room(sum(n for _, n in new))
        finally:
            self.unpin(keep)
        if not room:
            self.stats.cpu_full += len(new)
            return False
        for key, nbytes in new:
            self._insert(key, nbytes)
        bid = states[0][0]
        for key, _ in states:
            old = self._boundary_of.get(key)
            if old is not None and old != bid:
                self._forget_boundary(old)
        self._tick += 1
        parent = parent if parent in self._boundaries and parent != bid else None
        self._boundaries[bid] = Boundary(
            tokens,
            tuple(k for k, _ in states),
            tuple(needs),
            own_bytes * self.ranks,
            self._tick,
            parent,
        )
        if parent is not None:
            self._children.setdefault(parent, set()).add(bid)
        for key, _ in states:
            self._boundary_of[key] = bid
        if needs:
            self._adopt(bid, needs[-1])
        for key in needs:
            self._needed_by.setdefault(key, set()).add(bid)
        return True

    def _adopt(self, bid: bytes, last: bytes) -> None:
        """Make a new boundary the parent of the longer ones admitted before it that
        pass through it (they need its last chunk) and had its parent: a junction stored
        below a sibling's boundary is the branch point of both. (Keeping it as one after
        either child leaves served document QA more but the agent trace less:
        docs/benchmarks.md.)"""
        b = self._boundaries[bid]
        shared: set[bytes] | None = None  # b's chunks, once a boundary is adopted
        for other in self._needed_by.get(last, ()):
            o = self._boundaries[other]
            if o.parent != b.parent or o.tokens <= b.tokens:
                continue
            shared = set(b.needs) if shared is None else shared
            if o.parent is not None:
                self._children[o.parent].discard(other)
            o.parent = bid
            self._children.setdefault(bid, set()).add(other)
            o.own_bytes = sum(self._cpu[k] for k in o.states) + sum(
                self._cpu.get(k, 0) for k in o.needs if k not in shared
            )

    def admit(self, key: bytes, nbytes: int) -> bool:
        """Make room for a new entry (evicting the least recently used unpinned ones) and
        count it in; False, and nothing evicted, if it cannot fit."""
        if key in self._cpu:
            self._cpu.move_to_end(key)
            if key in self._loose:
                self._loose.move_to_end(key)
            return True
        nbytes *= self.ranks
        if not self._make_room(nbytes):
            self.stats.cpu_full += 1
            return False
        self._insert(key, nbytes)
        return True

    def _insert(self, key: bytes, nbytes: int) -> None:
        self._cpu[key] = nbytes
        self._used += nbytes
        if self.listener is not None and key not in self._promoting:
            self.listener.changed("cpu", key, True)
        if self.recurrent:
            self._loose[key] = None
            last = self._ghosts.pop(key, None)
            self._return_share += ((last is not None) - self._return_share) / RETURN_WINDOW
            if last is not None:  # a return
                gap = self._tick - last
                self._return_gap += (gap - self._return_gap) / (16 if self._return_gap else 1)
        # Dropped earlier this step and stored again: the workers' copy stays good.
        for dropped in (self.orders.evict, self.orders.delete):
            if key in dropped:
                dropped.remove(key)

    def _evictable(self, key: bytes) -> bool:
        return self._pins[key] == 0 and key not in self._promoting

    def _make_room(self, nbytes: int) -> bool:
        """Evict until `nbytes` more fit; False, and nothing evicted, if they cannot."""
        if nbytes > self.capacity:
            return False
        free = self.capacity - self._used
        if free >= nbytes:
            return True
        if self.recurrent:
            # Choosing by the policy looks at every boundary, so free a little more than
            # needed while at it: one choice then serves the next admissions (a prefill
            # stores a chunk at a time). Without that, a budget holding thousands of
            # boundaries spent milliseconds of the scheduler's thread per chunk stored.
            ahead = self.capacity // EVICT_AHEAD if len(self._boundaries) >= AHEAD_FROM else 0
            victims = self._victims(nbytes - free + ahead)
            if victims is None and ahead:
                victims = self._victims(nbytes - free)
        else:
            victims = self._lru_victims(nbytes - free)
        if victims is None:
            return False
        for key in victims:
            self._drop_cpu(key)
            self.orders.evict.append(key)
            self.stats.cpu_evictions += 1
        return True

    def _lru_victims(self, needed: int) -> list[bytes] | None:
        victims, freed = [], 0
        for key, size in self._cpu.items():
            if freed >= needed:
                break
            if self._evictable(key):
                victims.append(key)
                freed += size
        return victims if freed >= needed else None

    def _victims(self, needed: int) -> list[bytes] | None:
        """Orphans first (LRU), then whole boundaries by utility, each with the chunks it
        alone needed; None if even all that would not free `needed` bytes."""
        victims, freed, stale = [], 0, []
        for key in self._loose:  # stops as soon as enough is found: no copy of it
            if freed >= needed:
                break
            if key not in self._cpu or key in self._boundary_of or self._needed_by.get(key):
                stale.append(key)  # not an orphan (it becomes one only in _forget_boundary)
            elif self._evictable(key):
                victims.append(key)
                freed += self._cpu[key]
        for key in stale:
            del self._loose[key]
        orphans = len(victims)
        leaves: list[Boundary] = []
        superseded: list[Boundary] = []
        forks: list[Boundary] = []
        if freed < needed:
            held = self._pins.keys() | self._promoting.keys()  # not evictable
            children = self._children
            for bid, b in self._boundaries.items():  # 10,000 of them in a large budget
                if held and not held.isdisjoint(b.states):
                    continue
                kids = children.get(bid)
                if not kids:
                    leaves.append(b)
                elif len(kids) == 1:
                    superseded.append(b)
                else:
                    forks.append(b)
            superseded.sort(key=lambda b: b.used)
        gone: set[bytes] = set()
        looping = self._return_share > LOOPING_SHARE
        live_for = LIVE_GAPS * self._return_gap if looping else None
        room = PROTECTED * self.capacity
        order = [
            *superseded,
            *eviction_order(leaves, self.alpha, room, self._tick, live_for),
            *eviction_order(forks, self.alpha, room, self._tick, live_for),
        ]
        last_use = dict.fromkeys(victims, self._tick)  # orphans' chunks
        for b in order:
            if freed >= needed:
                break
            gone.add(b.states[0])
            for key in b.states:
                victims.append(key)
                freed += self._cpu[key]
            for key in b.needs:
                if key in self._cpu and self._evictable(key) and self._needed_by[key] <= gone:
                    victims.append(key)
                    freed += self._cpu[key]
                    gone.add(key)  # never added twice (no boundary id is a needed key)
                    last_use[key] = b.used
        if freed < needed:
            return None
        self._remember(last_use)
        self.stats.evicted_orphans += orphans
        n_superseded = sum(1 for b in superseded if b.states[0] in gone)
        self.stats.evicted_superseded += n_superseded
        self.stats.evicted_boundaries += (
            sum(1 for k in gone if k in self._boundaries) - n_superseded
        )
        return victims

    def _remember(self, last_use: dict[bytes, int]) -> None:
        """Add evicted attention chunks to the ghost list (bounded, oldest out first)."""
        for key, used in last_use.items():
            self._ghosts[key] = used
            self._ghosts.move_to_end(key)
        cap = max(GHOSTS_MIN, GHOSTS_PER_ENTRY * len(self._cpu))
        while len(self._ghosts) > cap:
            self._ghosts.popitem(last=False)

    def evict_all(self) -> int:
        """Evict every unpinned entry from CPU memory (what stays below is still found);
        how many."""
        victims = [k for k in self._cpu if self._pins[k] == 0 and k not in self._promoting]
        for key in victims:
            self._drop_cpu(key)
            self.orders.evict.append(key)
        self.stats.cpu_evictions += len(victims)
        return len(victims)

    def _drop_cpu(self, key: bytes) -> None:
        if self.listener is not None and self.in_cpu(key):
            self.listener.changed("cpu", key, False)
        size = self._cpu.pop(key, None)
        if size is not None:
            self._used -= size
        self._promoting.pop(key, None)
        self._sources.pop(key, None)
        self._loose.pop(key, None)
        bid = self._boundary_of.get(key)
        if bid is not None:
            self._forget_boundary(bid)

    def _forget_boundary(self, bid: bytes) -> None:
        """Stop counting a boundary (one of its states left CPU memory); its other states,
        and the chunks no other boundary needs, stay until evicted, as orphans."""
        b = self._boundaries.pop(bid)
        for key in b.states:
            self._boundary_of.pop(key, None)
            if key in self._cpu:
                self._loose[key] = None
        # Its children now follow its parent (the chain's previous boundary left).
        if b.parent is not None:
            self._children[b.parent].discard(bid)
        for child in self._children.pop(bid, ()):
            self._boundaries[child].parent = b.parent
            if b.parent is not None:
                self._children[b.parent].add(child)
        if b.parent is not None and not self._children[b.parent]:
            del self._children[b.parent]
        for key in b.needs:
            users = self._needed_by.get(key)
            if users is not None:
                users.discard(bid)
                if not users:
                    del self._needed_by[key]
                    if key in self._cpu:
                        self._loose[key] = None

    def delete(self, key: bytes) -> None:
        """Forget an entry worth nothing any more (a decode-time state its request staged,
        then replaced): the workers drop it from CPU memory, and no tier below ever had
        it. A pinned entry (a pending hit reads it) stays."""
        if self._pins[key] > 0:
            return
        self._drop_cpu(key)
        self.orders.delete.append(key)

    def persist(self, keys: Iterable[bytes]) -> None:
        """Have the workers write entries CPU memory alone held (a finished request's last
        decode-time state) to the lower tiers."""
        self.orders.persist.extend(k for k in keys if k in self._cpu)

    # ---- promotions -----------------------------------------------------------------------
    def promote(self, key: bytes, nbytes: int, tier: str = "disk") -> bool:
        """Have every rank read an entry from `tier` into CPU memory; False if there is
        no room (the hit then stops short of it). A promotion under way is not started
        again."""
        if key in self._cpu:
            return True
        self._promoting[key] = set()  # first: not ready to read while it is read in
        if not self.admit(key, nbytes):
            del self._promoting[key]
            return False
        self._sources[key] = tier
        self.orders.promote.append((key, tier))
        return True

    def promoted(self, epoch: int, rank: int, key: bytes, ok: bool) -> None:
        """A rank's report on a promotion. Any rank's failure fails it for all (ranks that
        read it are told to drop it); it is in CPU memory once every rank has it."""
        if epoch != self.epoch or key not in self._promoting:
            return
        if not ok:
            self.stats.failed_promotions += 1
            tier = self._sources.get(key, "disk")
            self._drop_cpu(key)
            self.orders.evict.append(key)
            # Damaged or gone there: never planned around again (a probe may find it anew).
            if tier == "disk":
                self._forget_disk(key)
            else:
                self._hints.get(tier, {}).pop(key, None)
            return
        ranks = self._promoting[key]
        ranks.add(rank)
        if len(ranks) >= self.ranks:
            del self._promoting[key]
            self.stats.promotions += 1
            self.promoted_from[self._sources.pop(key, "disk")] += 1
            if self.listener is not None:
                self.listener.changed("cpu", key, True)

    # ---- worker reports -------------------------------------------------------------------
    def disk_changed(self, epoch: int, rank: int, key: bytes, present: bool) -> None:
        if epoch != self.epoch:
            return
        before = self.on_disk(key)
        if present:
            self._disk.setdefault(key, set()).add(rank)
        elif key in self._disk:
            self._disk[key].discard(rank)
            if not self._disk[key]:
                del self._disk[key]
        if self.listener is not None and self.on_disk(key) != before:
            self.listener.changed("disk", key, not before)

    def _forget_disk(self, key: bytes) -> None:
        """Plan no hit around `key` on disk again (a read of it failed)."""
        if self.listener is not None and self.on_disk(key):
            self.listener.changed("disk", key, False)
        self._disk.pop(key, None)

    def lost(self, epoch: int, key: bytes) -> None:
        """A rank does not hold an entry the index has in CPU memory (its store failed)."""
        if epoch == self.epoch and key in self._cpu and key not in self._promoting:
            self.stats.lost += 1
            self._drop_cpu(key)
            self.orders.evict.append(key)

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
        return orders

    def clear(self) -> None:
        """Forget everything; the workers drop what this engine stored. Pins stay (their
        requests release them) but protect nothing any more."""
        self._cpu.clear()
        self._used = 0
        self._promoting.clear()
        self._sources.clear()
        self._hints.clear()
        self._boundaries.clear()
        self._boundary_of.clear()
        self._needed_by.clear()
        self._children.clear()
        self._loose.clear()
        self._ghosts.clear()
        self._return_gap = self._return_share = 0.0
        self._disk.clear()
        self.epoch += 1
        self.orders = Orders(clear=True)
        if self.listener is not None:
            self.listener.cleared()

    def gauges(self) -> dict[str, int]:
        return {
            "cpu_entries": len(self._cpu),
            "cpu_bytes": self._used,
            "cpu_capacity_bytes": self.capacity,
            "disk_entries": sum(1 for r in self._disk.values() if len(r) >= self.ranks),
            "promoting": len(self._promoting),
            "cpu_boundaries": len(self._boundaries),
            "held_entries": self.pinned(),
        }
