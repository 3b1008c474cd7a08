"""Which stored prefixes this engine can resume, per tier, as entries to announce.

Routers learn where prefixes live from block-level announcements (vLLM's KV cache events),
and most of them understand full-attention blocks only. For a hybrid model a stored
attention block is worth nothing without a *restorable boundary* at or after it: every
recurrent group's state at one chunk boundary B, the sliding-window chunks before B and
every full-attention chunk in [0, B) (the hit rule, core/planner.py). So a full-attention
entry is announced on a tier only while some boundary reached through its chunk is
restorable from that tier, and retracted once none is, even though the entry itself
stays. A router that counts announced full-attention blocks along a prompt then counts
the prefix up to the last restorable boundary it shares with the prompt. The recurrent
and sliding-window entries a restorable boundary reads are announced too, for routers
that follow each group (refcounted: consecutive boundaries share window chunks).

The tracker is a small dataflow graph, updated by changes only (the scheduler's thread
must not rescan what it holds):
- a *node* per stored chunk of a chain (its full-attention entries), linked to the
  chunk before it; `prefix(n)` holds on a tier while n's entries and all its ancestors'
  are there;
- a *boundary* per stored chunk boundary a hit may resume at: it needs `prefix` of its
  node plus its own entries (states, window chunks) on the tier;
- a node is *covered* on a tier while a true boundary sits at it or below it in the
  tree (counted: own true boundaries plus covered children), and its full-attention
  entries are announced exactly while it is covered.
Entries are opaque keys and tiers opaque names: `present(tier, key)` answers for the
current state, and `changed` is told each change. Cost is proportional to what changes
(an evicted chain head retracts every prefix below it, which is what a router must hear).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

# Boundaries restorable nowhere are kept (their entries may arrive later: a disk write
# lands steps after the store) up to this many, the least recently registered dropped.
DORMANT_LIMIT = 4096


@dataclass(eq=False, slots=True)
class _Node:
    key: bytes
    parent: _Node | None
    entries: tuple[bytes, ...]  # its full-attention entries
    # None while empty (most nodes): a set is one more object for every full collection
    # of the garbage collector to walk, on the scheduler's thread.
    children: set[_Node] | None = None
    bounds: set[_Boundary] | None = None
    missing: dict[str, int] = field(default_factory=dict)  # tier -> own entries absent
    prefix: dict[str, bool] = field(default_factory=dict)  # tier -> prefix(n) holds
    cover: dict[str, int] = field(default_factory=dict)  # tier -> true bounds + covered kids


@dataclass(eq=False, slots=True)
class _Boundary:
    bid: bytes
    node: _Node | None  # None: it needs no full-attention chunk
    needs: tuple[bytes, ...]  # entries of its own: states, window chunks
    missing: dict[str, int] = field(default_factory=dict)
    true: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Announcement:
    """Entries that became resumable (`stored`) or stopped being so on `tier`."""

    tier: str
    stored: bool
    entries: tuple[bytes, ...]


class ResumableTracker:
    def __init__(self, tiers: Sequence[str], present: Callable[[str, bytes], bool]):
        self.tiers = tuple(tiers)
        self._present = present
        self._nodes: dict[bytes, _Node] = {}
        self._bounds: dict[bytes, _Boundary] = {}
        # entry -> what watches it: the one item (nearly always), or a list of them
        self._by_entry: dict[bytes, _Node | _Boundary | list[_Node | _Boundary]] = {}
        self._shown: dict[tuple[str, bytes], int] = {}  # (tier, entry) -> announcers
        self._dormant: OrderedDict[bytes, None] = OrderedDict()
        self._out: list[tuple[str, bool, bytes]] = []
        self._released: list[bytes] = []  # entries no longer watched, since the last take

    # ---- registration ---------------------------------------------------------------------
    def chunk(self, key: bytes, parent: bytes | None, entries: Sequence[bytes]) -> None:
        """A stored chunk of a chain: `key` names its position (the chain key), `parent`
        the chunk before it (registered first), `entries` its full-attention entries."""
        if key in self._nodes:
            return
        up = self._nodes.get(parent) if parent is not None else None
        if parent is not None and up is None:
            raise ValueError("a chunk's parent must be registered before it")
        node = _Node(key, up, tuple(entries))
        self._nodes[key] = node
        if up is not None:
            if up.children is None:
                up.children = set()
            up.children.add(node)
        self._watch(node, node.entries)
        for tier in self.tiers:
            node.prefix[tier] = node.missing[tier] == 0 and (up is None or up.prefix[tier])
            node.cover[tier] = 0

    def boundary(self, bid: bytes, node: bytes | None, needs: Sequence[bytes]) -> None:
        """A boundary a hit may resume at: `node` is the chunk it ends (registered), `needs`
        the other entries a hit there reads. Registering one again refreshes it."""
        if bid in self._bounds:
            self._dormant.pop(bid, None)
            return
        at = self._nodes[node] if node is not None else None
        b = _Boundary(bid, at, tuple(needs))
        self._bounds[bid] = b
        if at is not None:
            if at.bounds is None:
                at.bounds = set()
            at.bounds.add(b)
        self._watch(b, b.needs)
        for tier in self.tiers:
            b.true[tier] = False
            self._settle(b, tier)
        self._maybe_dormant(b)

    def _watch(self, item: _Node | _Boundary, entries: Sequence[bytes]) -> None:
        """Follow `entries` for `item`, counting those each tier lacks now."""
        by_entry = self._by_entry
        for e in entries:
            watchers = by_entry.get(e)
            if watchers is None:
                by_entry[e] = item
            elif isinstance(watchers, list):
                watchers.append(item)
            else:
                by_entry[e] = [watchers, item]
        for tier in self.tiers:
            item.missing[tier] = sum(not self._present(tier, e) for e in entries)

    # ---- changes --------------------------------------------------------------------------
    def changed(self, tier: str, entry: bytes, present: bool) -> None:
        """`entry` arrived on (or left) `tier`. Told only of actual changes."""
        step = -1 if present else 1
        for item in self._watchers(entry):
            if not self._live(item):
                continue  # forgotten by the dormant limit meanwhile
            item.missing[tier] += step
            if isinstance(item, _Boundary):
                self._settle(item, tier)
                self._maybe_dormant(item)
            else:
                self._set_prefix(item, tier)

    def _watchers(self, entry: bytes) -> list[_Node | _Boundary]:
        """What watches `entry`, as a list of its own (forgetting edits the map's)."""
        watchers = self._by_entry.get(entry)
        if watchers is None:
            return []
        return list(watchers) if isinstance(watchers, list) else [watchers]

    def clear(self, tier: str) -> None:
        """Everything left `tier` at once (a cache reset): retract what it showed."""
        for b in self._bounds.values():
            b.missing[tier] = len(b.needs)
        for n in self._nodes.values():
            n.missing[tier] = len(n.entries)
        for n in [n for n in self._nodes.values() if n.parent is None]:
            self._set_prefix(n, tier)
        for b in list(self._bounds.values()):  # the dormant limit may forget some
            if self._live(b):
                self._settle(b, tier)
                self._maybe_dormant(b)

    def _live(self, item: _Node | _Boundary) -> bool:
        if isinstance(item, _Boundary):
            return self._bounds.get(item.bid) is item
        return self._nodes.get(item.key) is item

    def _set_prefix(self, node: _Node, tier: str) -> None:
        """Recompute prefix(node) on `tier` and pass a change down its subtree."""
        stack = [node]
        while stack:
            n = stack.pop()
            up = n.parent
            now = n.missing[tier] == 0 and (up is None or up.prefix[tier])
            if now == n.prefix[tier]:
                continue
            n.prefix[tier] = now
            for b in list(n.bounds or ()):  # the dormant limit may forget some
                if self._live(b):
                    self._settle(b, tier)
                    self._maybe_dormant(b)
            stack.extend(n.children or ())

    def _settle(self, b: _Boundary, tier: str) -> None:
        now = b.missing[tier] == 0 and (b.node is None or b.node.prefix[tier])
        if now == b.true[tier]:
            return
        b.true[tier] = now
        if now and b.node is not None:  # the chain's blocks before the boundary's own
            self._cover(b.node, tier, 1)
        self._show(tier, b.needs, now)
        if not now and b.node is not None:
            self._cover(b.node, tier, -1)

    def _cover(self, node: _Node | None, tier: str, step: int) -> None:
        """Add `step` to node's cover; a node that becomes covered (or stops) announces
        (or retracts) its entries and tells its parent, and so on up. Announcements go
        root first (each block's parent before it), retractions leaf first."""
        flipped = []
        while node is not None:
            before = node.cover[tier]
            node.cover[tier] = before + step
            if (before > 0) == (node.cover[tier] > 0):
                break
            flipped.append(node)
            node = node.parent
        for n in reversed(flipped) if step > 0 else flipped:
            self._show(tier, n.entries, step > 0)

    def _show(self, tier: str, entries: Iterable[bytes], on: bool) -> None:
        for e in entries:
            k = (tier, e)
            n = self._shown.get(k, 0) + (1 if on else -1)
            if n:
                self._shown[k] = n
            else:
                del self._shown[k]
            if (on and n == 1) or (not on and n == 0):
                self._out.append((tier, on, e))

    # ---- forgetting ----------------------------------------------------------------------
    def _maybe_dormant(self, b: _Boundary) -> None:
        """A boundary true nowhere waits in the dormant list; too many: the oldest go."""
        if any(b.true.values()):
            self._dormant.pop(b.bid, None)
            return
        self._dormant[b.bid] = None
        self._dormant.move_to_end(b.bid)
        while len(self._dormant) > DORMANT_LIMIT:
            self.forget(next(iter(self._dormant)))

    def forget(self, bid: bytes) -> None:
        """Stop tracking a boundary (retracting what it announced), and the chunks of its
        chain that no longer lead to any tracked boundary."""
        b = self._bounds.pop(bid, None)
        if b is None:
            return
        self._dormant.pop(bid, None)
        for tier in self.tiers:
            if b.true[tier]:
                b.missing[tier] += 1  # it counts as gone from every tier
                self._settle(b, tier)
        self._unwatch(b, b.needs)
        node = b.node
        if node is not None and node.bounds is not None:
            node.bounds.discard(b)
            node.bounds = node.bounds or None
        while node is not None and not node.bounds and not node.children:
            del self._nodes[node.key]
            self._unwatch(node, node.entries)
            up = node.parent
            if up is not None and up.children is not None:
                up.children.discard(node)
                up.children = up.children or None
            node = up

    def _unwatch(self, item: _Node | _Boundary, entries: Iterable[bytes]) -> None:
        by_entry = self._by_entry
        for e in entries:
            watchers = by_entry.get(e)
            if isinstance(watchers, list):
                watchers[:] = [w for w in watchers if w is not item]
                if len(watchers) > 1:
                    continue
                if watchers:
                    by_entry[e] = watchers[0]
                    continue
            elif watchers is not item:
                continue  # not watched, or by another
            del by_entry[e]
            self._released.append(e)

    # ---- output ---------------------------------------------------------------------------
    def take(self) -> list[Announcement]:
        """What changed since the last call, one announcement per run of (tier, stored),
        in order; an entry announced and retracted within the same interval cancels out."""
        net: dict[tuple[str, bytes], bool] = {}
        for tier, on, e in self._out:
            k = (tier, e)
            if net.get(k) is (not on):
                del net[k]  # shown then hidden (or the reverse) since the last call
            else:
                net[k] = on
        self._out = []
        runs: list[tuple[str, bool, list[bytes]]] = []
        for (tier, e), on in net.items():
            if runs and runs[-1][:2] == (tier, on):
                runs[-1][2].append(e)
            else:
                runs.append((tier, on, [e]))
        return [Announcement(tier, on, tuple(entries)) for tier, on, entries in runs]

    def take_released(self) -> list[bytes]:
        """Entries nothing tracked needs any more (their retractions, if any, are in the
        last `take`'s announcements), unless something registered them again since."""
        released, self._released = self._released, []
        return [e for e in released if e not in self._by_entry]

    def boundaries(self) -> set[bytes]:
        """The boundaries tracked (the dormant limit forgets the oldest of those true
        nowhere)."""
        return set(self._bounds)

    def has_chunk(self, key: bytes) -> bool:
        return key in self._nodes

    def shown(self, tier: str) -> set[bytes]:
        """Entries currently announced on `tier`."""
        return {e for t, e in self._shown if t == tier}

    def sizes(self) -> dict[str, int]:
        return {
            "nodes": len(self._nodes),
            "boundaries": len(self._bounds),
            "dormant": len(self._dormant),
            "shown": len(self._shown),
        }
