"""Which entries CPU memory gives up when an admission needs room: the eviction policy,
the third part of the scheduler side's index (core/index.py), as a pluggable object.

The index keeps the byte ledger (core/ledger.py) and, with recurrent groups, the boundary
graph (core/boundary_graph.py); a policy is told every change (`EvictionPolicy`) and
answers one question, `victims(needed)`: the entries to evict, or None if nothing can
free that much (then nothing is evicted). vLLM's `kv_offload` separates its manager from
its policies the same way (`CachePolicy`: LRU, ARC). Both policies here keep their order
as entries change, so a choice costs O(log n) per entry it picks, whatever CPU memory
holds (a production tier: a million entries, a hundred thousand boundaries); neither
frees more than it is asked for.

`LruPolicy`, for layouts without recurrent groups: every stored chunk serves hits at its
own boundary, so least recently used first (a hit touches every entry it reads, the
shared head of a chain included, so suffixes go first).

`BoundaryPolicy`, with recurrent groups. A hit needs a *boundary*: every recurrent
group's state at one chunk boundary plus the attention chunks before it. A boundary at B
tokens saves the prefill of B tokens and costs its states plus the attention chunks
since the chain's previous boundary kept (`own_bytes`). LRU over entries ignores both: it
evicts the shared head of a chain as readily as a useless suffix, and one state of a
boundary while keeping the others. So the policy evicts, in this order, until the new
entry fits:
1. orphans: attention chunks no boundary in CPU memory needs (least recently used
   first): without a state at or after them they serve no hit;
2. superseded boundaries, least recently used first: those with exactly one *child* (a
   longer boundary of the same chain, admitted while this one was in CPU memory). The
   child serves every request that follows the path further, so this one serves only a
   request that forks between the two; a conversation's earlier turns are the common
   case. Only their states go: the child needs their chunks;
3. whole leaf boundaries (no child), each with the chunks only it needed, in the order
   below (core/boundary_order.py);
4. branch points (two or more children: a shared system prompt, a document several
   questions fork from, a junction stored below a sibling's longer boundary), in the
   same order, last. Their `own_bytes` overstates what evicting them frees (their
   chunks stay while a child needs them) and every chain through them falls back to a
   shorter hit without them, so utility alone would evict the shared head first.
   Marconi's radix tree, likewise, only evicts nodes with one child or none.
A boundary's states are admitted, and evicted, together: one state without the others
serves nothing. A boundary with a state held (pinned, promoting) is passed over whole.

Within leaves, and within branch points: following Marconi (Pan et al., 2024), a
boundary's *utility* is recency plus alpha times efficiency (tokens saved per byte kept,
B / own_bytes). The two terms must be brought to one scale. The first version scaled both
to [0, 1] over the candidates of each choice (min-max), which makes the order depend on
the whole set at every choice: no structure can keep it, and sorting every boundary took
10-20 ms of the scheduler's thread per choice at 10,000 boundaries. Now a boundary's
utility is fixed when it is admitted or used, or its cost changes, as its *rank*:

    rank = used + alpha * span / best * efficiency

in ticks of the index's logical clock, where `span` is the ticks since the least
recently used boundary in CPU memory was used and `best` the highest efficiency among
them at that moment: the best efficiency is worth alpha of the recency range, as with
min-max scaling, at the scale in force when the boundary was last used. The lowest rank
goes first. Where the scale has not moved since two boundaries were ranked, their order
is min-max's; where it has, the first boundary evicted has a min-max utility (over the
same candidates) at most 2 * alpha * max|lambda_i / lambda - 1| above the lowest, lambda
being alpha * span / best now and lambda_i the one a boundary was ranked with
(tests/test_index_scale.py checks it on random histories). On the hit-rate replays (agent
trace at 5 MiB, document QA at 10 MiB) it served what min-max served (docs/benchmarks.md).
Prefill cost is taken as linear in B: the recurrent and MLP layers of a hybrid model
dominate, and the quadratic attention term would only favour long boundaries more.

`alpha` (config `eviction_alpha`, default 0.25) was chosen by replaying the traces of
bench/hit_rate.py at each one's tightest interesting budget (docs/benchmarks.md): 0 and
0.25 served the most on chat and document QA, 1 and 4 a little more on the agent trace
and far less on chat. Efficiency favours the longest chains, and in a chat those are the
conversations about to end. `alpha = 0` is LRU over whole boundaries.

Recency fails a working set larger than the budget that comes back in turn (documents
asked about in rounds, conversations taking turns): LRU evicts each entry just before
its next use. The policy detects that from *returns*: it remembers recently evicted
chunks (core/ghosts.py), and one stored again is a return, whose gap (ticks from its last
use to its return) estimates how long the workload takes to come back. While returns are
a minority of what is stored (a running mean over about RETURN_WINDOW admissions), the
order is by rank (recency first): a budget a little short of a recency-friendly working
set (a chat) keeps its newest entries. While they are more than LOOPING_SHARE of it, the
workload loops, and among leaves and likewise among branch points:
1. *dead* boundaries, idle for more than LIVE_GAPS typical gaps, go first, by rank;
2. then live ones, most recently used first: the one used last is the one whose next
   use is furthest away, which is Belady's choice in a loop; a fixed set then stays
   and hits every time round;
3. *protected* ones last: reused since admission (a hit, or vLLM's own), the most
   recently used of them up to PROTECTED of the budget (segmented LRU's protected
   segment; the older ones are ordered with the rest).
Switching to that order at the first return instead cost chat 13-16 % of its connector
hits at 6-8 MiB against utility alone; switching by the share of returns gained there
(docs/benchmarks.md, "Hit rate at equal CPU bytes").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridkv.core.boundary_graph import BoundaryGraph
from hybridkv.core.boundary_order import BoundaryOrder
from hybridkv.core.ghosts import Ghosts
from hybridkv.core.ledger import Ledger
from hybridkv.core.recency import RecencyQueue
from hybridkv.core.row_order import RowOrder, RowQueue

# Leaf boundaries reused since admission keep up to this share of the budget ahead of the
# others (segmented LRU's protected segment).
PROTECTED = 0.8
# While more than LOOPING_SHARE of the chunks admitted lately (a running mean over about
# RETURN_WINDOW) are returns, the workload is taken to loop, and a boundary idle for more
# than LIVE_GAPS times the typical return gap is dead.
RETURN_WINDOW = 64
LOOPING_SHARE = 0.5
LIVE_GAPS = 4.0
# Places of a boundary in `BoundaryPolicy`'s orders (Boundary.place; 0: in none).
_SUPERSEDED, _LEAVES, _FORKS = 1, 10, 20


@dataclass
class Choice:
    """Entries to evict, in order, and what they were."""

    keys: list[bytes]
    orphans: int = 0  # attention chunks no boundary needed
    superseded: int = 0  # boundaries one longer boundary served past
    boundaries: int = 0  # boundaries evicted whole (leaves, branch points)


class EvictionPolicy(Protocol):
    """What the index tells a policy, and asks of it. The ledger tells it when an entry
    in CPU memory becomes held or evictable (`hold`)."""

    def entered(self, key: bytes) -> None:
        """An entry was admitted on its own (the ledger has it)."""

    def used(self, key: bytes) -> None:
        """An entry in CPU memory was admitted again."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """A hit (or vLLM's own) read these keys."""

    def left(self, keys: Sequence[bytes]) -> None:
        """Entries left CPU memory together (an eviction, or one; the ledger has
        forgotten them)."""

    def hold(self, keys: list[bytes], held: bool) -> None: ...

    def victims(self, needed: int) -> Choice | None:
        """Entries whose eviction frees at least `needed` bytes, or None if nothing can
        (then nothing changed)."""

    def resize(self) -> None:
        """The ledger's capacity changed."""

    def clear(self) -> None: ...


class LruPolicy:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._order = RecencyQueue()

    def entered(self, key: bytes) -> None:
        self._order.add(key)

    def used(self, key: bytes) -> None:
        self._order.use(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._order.use_all(keys)

    def left(self, keys: Sequence[bytes]) -> None:
        self._order.discard_all(keys)

    def hold(self, keys: list[bytes], held: bool) -> None:
        self._order.hold(keys, held)

    def victims(self, needed: int) -> Choice | None:
        if needed > self.ledger.evictable_bytes():
            return None
        keys, freed = _take(self._order.candidates(self.ledger.held), needed, self.ledger)
        return Choice(keys) if freed >= needed else None

    def resize(self) -> None:
        pass

    def clear(self) -> None:
        self._order.clear()


def _take(candidates: Iterable[bytes], needed: int, ledger: Ledger) -> tuple[list[bytes], int]:
    """The first `candidates` that free `needed` bytes (all of them if they do not)."""
    keys, freed, sizes = [], 0, ledger.sizes
    for key in candidates:
        if freed >= needed:
            break
        keys.append(key)
        freed += sizes[key]
    return keys, freed


class BoundaryPolicy:
    """The policy for layouts with recurrent groups (the module docstring). It watches
    the boundary graph it keeps (`graph`) and the ledger, and files each boundary (a row
    of the graph's `rows`) in one of its orders: superseded ones by last use, leaves and
    branch points each in a `BoundaryOrder`; orphans in a `RecencyQueue`."""

    def __init__(self, ledger: Ledger, alpha: float):
        self.ledger = ledger
        self.alpha = alpha
        self.graph = BoundaryGraph(ledger, self)
        self.rows = self.graph.rows
        self._orphans = RecencyQueue()
        self._superseded = RowOrder()  # by last use
        self._leaves = BoundaryOrder(self.rows, _LEAVES, PROTECTED * ledger.capacity)
        self._forks = BoundaryOrder(self.rows, _FORKS, PROTECTED * ledger.capacity)
        # Every boundary, by last use and by efficiency: the scale a rank is taken at. A
        # use is the clock's latest tick, so the first is by last use in a plain queue.
        self._by_use = RowQueue()
        self._efficiencies = RowOrder()
        self.ghosts = Ghosts()
        self.return_gap = 0.0  # running mean of returns' gaps, in ticks
        self.return_share = 0.0  # running share of the sampled admissions that are returns
        # Anything that could free more since a choice failed bumps `_version`; a choice
        # for as much or more before that fails at once.
        self._version = 0
        self._failed: tuple[int, int] | None = None

    @property
    def looping(self) -> bool:
        return self.return_share > LOOPING_SHARE

    # ---- what the index tells it ----------------------------------------------------------
    def entered(self, key: bytes) -> None:
        self._count_return(key)
        self.graph.entered(key)

    def add_boundary(
        self,
        states: Sequence[bytes],
        new: Sequence[bytes],
        needs: Sequence[bytes],
        tokens: int,
        own_bytes: int,
        parent: bytes | None,
    ) -> None:
        """A boundary whose states are in the ledger now (`new`: admitted for it). Its new
        states count in the share of returns as admissions that are never returns (only
        chunks are remembered as evicted), so a loop of boundaries with as many states
        as chunks stays under LOOPING_SHARE. Counting chunks alone detected it, but cost
        chat at 4 MiB 8 % of its hits on the hit-rate bench (0.554 -> 0.507,
        docs/benchmarks.md): LOOPING_SHARE was chosen with the states counted."""
        self._version += 1  # (also with no new state: promoted states become one)
        for key in new:
            self._count_return(key)
        self.graph.add(states, needs, tokens, own_bytes, parent)

    def used(self, key: bytes) -> None:
        self._orphans.use(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.graph.touch(keys)
        self._orphans.use_all(keys)

    def left(self, keys: Sequence[bytes]) -> None:
        self.graph.left(keys)

    def hold(self, keys: list[bytes], held: bool) -> None:
        self._version += 1
        chunks = []  # not states: orphans, or chunks a boundary needs (nothing to do)
        counts = self.rows.held
        for key, b in zip(keys, self.graph.state_of.get_many(keys, None), strict=True):
            if b is None:
                chunks.append(key)
                continue
            self.unfile(b)
            counts[b] += 1 if held else -1
            self.file(b)
        self._orphans.hold(chunks, held)

    def resize(self) -> None:
        room = PROTECTED * self.ledger.capacity
        self._leaves.resize(room)
        self._forks.resize(room)

    def _count_return(self, key: bytes) -> None:
        """An entry stored: a return if it was evicted lately (core/ghosts.py)."""
        self._version += 1
        if not self.ghosts.sampled(key):
            return
        last = self.ghosts.returned(key)
        self.return_share += ((last is not None) - self.return_share) / RETURN_WINDOW
        if last is not None:
            gap = self.graph.tick - last
            self.return_gap += (gap - self.return_gap) / (16 if self.return_gap else 1)

    # ---- what the graph tells it (GraphWatcher) -------------------------------------------
    def unfile(self, b: int) -> None:
        rows = self.rows
        if rows.place[b] == _SUPERSEDED:
            self._superseded.remove(rows.used[b], rows.seq[b])
            rows.place[b] = 0
        elif self._leaves.owns(b):
            self._leaves.remove(b)
        elif self._forks.owns(b):
            self._forks.remove(b)

    def file(self, b: int) -> None:
        self._version += 1
        rows = self.rows
        if rows.held[b]:
            return
        kids = rows.kids[b]
        if kids == 1:
            rows.place[b] = _SUPERSEDED
            self._superseded.add(rows.used[b], rows.seq[b], b)
        else:
            (self._leaves if kids == 0 else self._forks).add(b)

    def scored(self, boundaries: Sequence[int]) -> None:
        """Rank boundaries admitted, used or changed in cost now (the module docstring):
        the scale is taken once, after all of them moved."""
        rows = self.rows
        used, seq, ranked = rows.used, rows.seq, rows.ranked
        used_ranked, efficiency = rows.used_ranked, rows.efficiency_ranked
        by_use, efficiencies = self._by_use, self._efficiencies
        for b in boundaries:
            now = rows.efficiency(b)
            if not ranked[b]:
                ranked[b] = True
                by_use.append(b)
                efficiencies.add(now, seq[b], b)
            else:
                if used_ranked[b] != used[b]:  # used now: the latest tick, the queue's end
                    by_use.remove(b)
                    by_use.append(b)
                if efficiency[b] != now:
                    efficiencies.remove(efficiency[b], seq[b])
                    efficiencies.add(now, seq[b], b)
            used_ranked[b], efficiency[b] = used[b], now
        span = max(self.graph.tick - used_ranked[by_use.first()], 1)
        best = self._efficiencies.last()[0]
        scale = self.alpha * span / best if best > 0 else 0.0
        for b in boundaries:
            rows.rank[b] = used[b] + scale * efficiency[b]

    def removed(self, b: int) -> None:
        rows = self.rows
        self._by_use.remove(b)
        self._efficiencies.remove(rows.efficiency_ranked[b], rows.seq[b])

    def orphaned(self, keys: Sequence[bytes], orphan: bool) -> None:
        if not orphan:
            self._orphans.discard_all(keys)
        elif keys:
            self._version += 1
            for key in keys:
                self._orphans.add(key)

    # ---- choosing -------------------------------------------------------------------------
    def victims(self, needed: int) -> Choice | None:
        """Orphans first (LRU), then whole boundaries in the policy's order, each with the
        chunks it alone needed."""
        ledger = self.ledger
        if needed > ledger.evictable_bytes():
            return None
        if self._failed is not None:
            version, at_least = self._failed
            if version == self._version and needed >= at_least:
                return None
        keys, freed = _take(self._orphans.candidates(ledger.held), needed, ledger)
        choice = Choice(keys, orphans=len(keys))
        tick = self.graph.tick
        last_use = dict.fromkeys(keys, tick)
        if freed < needed:
            freed = self._take_boundaries(choice, needed - freed, last_use) + freed
        if freed < needed:
            self._failed = (self._version, needed)
            return None
        self.ghosts.remember(last_use, len(ledger.sizes))
        return choice

    def _order(self) -> Iterator[tuple[bool, int]]:
        looping = self.looping
        if looping:
            # Only the looping order splits dead from live (core/boundary_order.py), and
            # moving the boundaries a cutoff crossed is the costly part of a choice:
            # without returns the cutoff is the clock, crossed by every boundary.
            cutoff = self.graph.tick - LIVE_GAPS * self.return_gap
            self._leaves.sync(cutoff)
            self._forks.sync(cutoff)
        for b in self._superseded.rows():
            yield True, b
        for b in self._leaves.order(looping):
            yield False, b
        for b in self._forks.order(looping):
            yield False, b

    def _take_boundaries(self, choice: Choice, needed: int, last_use: dict[bytes, int]) -> int:
        """Add boundaries to `choice` until `needed` more bytes are freed; how many were."""
        ledger, needers = self.ledger, self.graph.needers
        rows, segs = self.rows, self.graph.segments
        sizes = ledger.sizes
        left: dict[bytes, int] = {}  # needed chunk -> live segments holding it, after these
        refs: dict[int, int] = {}  # segment -> references left, after these
        freed = 0
        for superseded, b in self._order():
            if freed >= needed:
                break
            if superseded:
                choice.superseded += 1
            else:
                choice.boundaries += 1
            for key in rows.state_keys(b):
                choice.keys.append(key)
                freed += sizes[key]
            # Only the segments no boundary left after this choice refers to free chunks
            # (core/boundary_graph.py): the chain's first first, as its needs run.
            for seg in reversed(list(segs.dies(rows.needs[b], refs))):
                for key in segs.own(seg):
                    if key in sizes and not ledger.held(key):
                        n = left.get(key, needers[key]) - 1
                        left[key] = n
                        if n == 0:
                            choice.keys.append(key)
                            freed += sizes[key]
                            last_use[key] = rows.used[b]
        return freed

    def clear(self) -> None:
        self.graph.clear()
        self._orphans.clear()
        self._superseded.clear()
        self._leaves.clear()
        self._forks.clear()
        self._by_use.clear()
        self._efficiencies.clear()
        self.ghosts.clear()
        self.return_gap = self.return_share = 0.0
        self._failed = None
