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

Nodes and boundaries are rows of native columns, not Python objects: the graph has a
node per stored chunk, and with objects (a few sets and dicts each) every full collection
of the garbage collector, on the scheduler's thread, walked all of them, 60-116 ms at
30,000 entries and growing with the tier (docs/benchmarks.md). A row's kids (the child
nodes and boundaries under a node) are a linked list through its columns, an entry's
watchers a linked list of links, the counts per tier columns and the announced entries
`KeyTable`s (core/keytable.py); keys, entries and boundary ids are therefore byte strings
of at most 23 bytes (entry keys have 18: core/keys.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hybridkv.core.keytable import KeyTable, RowBytes
from hybridkv.core.rows import Rows

# Boundaries restorable nowhere are kept (their entries may arrive later: a disk write
# lands steps after the store) up to this many, the least recently registered dropped
# (none where `keep_dormant` is off). Each keeps the chunks of its chain alive.
DORMANT_LIMIT = 4096

NONE = -1  # no row: a root node's parent, a boundary that needs no chunk, a list's end
_FREE, _NODE, _BOUND = 0, 1, 2  # what a row holds
_KEY_BYTES = 23  # the most a KeyTable key holds
_PER_ROW = {
    "key": "k",
    "kind": "b",
    "up": "q",
    "first": "q",
    "next": "q",
    "prev": "q",
    "size": "q",
}
_PER_TIER = {"missing": "q", "on": "b", "cover": "q"}


@dataclass(frozen=True)
class Announcement:
    """Entries that became resumable (`stored`) or stopped being so on `tier`."""

    tier: str
    stored: bool
    entries: tuple[bytes, ...]


def _join(entries: Sequence[bytes]) -> bytes:
    """A row's entries as one byte string, each after its length."""
    return b"".join(bytes((len(e),)) + e for e in entries)


def _split(joined: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(joined):
        n = joined[i]
        out.append(joined[i + 1 : i + 1 + n])
        i += 1 + n
    return out


def _check(keys: Iterable[bytes]) -> None:
    for k in keys:
        if not isinstance(k, bytes) or len(k) > _KEY_BYTES:
            raise ValueError(f"tracked keys are bytes of at most {_KEY_BYTES}, got {k!r}")


class ResumableTracker:
    def __init__(
        self,
        tiers: Sequence[str],
        present: Callable[[str, bytes], bool],
        keep_dormant: bool = True,
    ):
        self.tiers = tuple(tiers)
        self._keep_dormant = keep_dormant
        self._tier = {tier: t for t, tier in enumerate(self.tiers)}
        self._present = present
        self._nodes = KeyTable()  # chunk key -> its row
        self._bounds = KeyTable()  # boundary id -> its row
        # A row per node or boundary: the chunk key or boundary id, what it is, a node's
        # parent node or a boundary's node (or NONE), a node's first kid (child node or
        # boundary) and the next and previous kid of the same node, how many entries;
        # per tier t, the entries absent, a node's prefix(n) or a boundary's truth, and a
        # node's cover (true boundaries at it and covered children).
        per_tier = {f"{c}{t}": k for t in range(len(self.tiers)) for c, k in _PER_TIER.items()}
        self._rows = Rows({**_PER_ROW, **per_tier})
        rows = self._rows
        self._key, self._kind, self._up = rows.key, rows.kind, rows.up
        self._first, self._next, self._prev = rows.first, rows.next, rows.prev
        self._missing = [getattr(rows, f"missing{t}") for t in range(len(self.tiers))]
        self._on = [getattr(rows, f"on{t}") for t in range(len(self.tiers))]
        self._cover = [getattr(rows, f"cover{t}") for t in range(len(self.tiers))]
        self._fresh = (0,) * len(per_tier)  # a new row's per-tier values
        self._entries = RowBytes()  # a node's full-attention entries, a boundary's needs
        # entry -> its first link; a link names one row watching the entry, and the next
        self._heads = KeyTable()
        self._links = Rows({"row": "q", "next": "q"})
        self._link_row, self._link_next = self._links.row, self._links.next
        self._shown = [KeyTable() for _ in self.tiers]  # entry -> boundaries announcing it
        self._dormant: OrderedDict[bytes, None] = OrderedDict()  # at most DORMANT_LIMIT
        self._out: list[tuple[str, bool, bytes]] = []
        self._released: list[bytes] = []  # entries no longer watched, since the last take

    # ---- rows -----------------------------------------------------------------------------
    def _new_row(self, key: bytes, kind: int, up: int, entries: Sequence[bytes]) -> int:
        """A row, first among its parent's kids, watching `entries`."""
        after = self._first[up] if up != NONE else NONE
        row = self._rows.add_row(key, kind, up, NONE, after, NONE, len(entries), *self._fresh)
        if up != NONE:
            self._first[up] = row
            if after != NONE:
                self._prev[after] = row
        self._entries[row] = _join(entries)
        self._watch(row, entries)
        return row

    def _free_row(self, row: int) -> None:
        up, before, after = self._up[row], self._prev[row], self._next[row]
        if before != NONE:
            self._next[before] = after
        elif up != NONE:
            self._first[up] = after
        if after != NONE:
            self._prev[after] = before
        self._unwatch(row, _split(self._entries[row]))
        del self._entries[row]
        self._kind[row] = _FREE
        self._rows.free_row(row)

    def _kids(self, row: int) -> list[int]:
        kids, nxt = [], self._next
        kid = self._first[row]
        while kid != NONE:
            kids.append(kid)
            kid = nxt[kid]
        return kids

    # ---- registration ---------------------------------------------------------------------
    def chunk(self, key: bytes, parent: bytes | None, entries: Sequence[bytes]) -> None:
        """A stored chunk of a chain: `key` names its position (the chain key), `parent`
        the chunk before it (registered first), `entries` its full-attention entries."""
        if key in self._nodes:
            return
        up = self._nodes.get(parent, NONE) if parent is not None else NONE
        if parent is not None and up == NONE:
            raise ValueError("a chunk's parent must be registered before it")
        _check((key, *entries))
        row = self._new_row(key, _NODE, up, entries)
        self._nodes[key] = row
        for t in range(len(self.tiers)):
            self._on[t][row] = self._missing[t][row] == 0 and (up == NONE or self._on[t][up])

    def boundary(self, bid: bytes, node: bytes | None, needs: Sequence[bytes]) -> None:
        """A boundary a hit may resume at: `node` is the chunk it ends (registered), `needs`
        the other entries a hit there reads. Registering one again refreshes it."""
        if bid in self._bounds:
            self._maybe_dormant(self._bounds[bid])  # still true nowhere: the newest dormant
            return
        at = self._nodes[node] if node is not None else NONE
        _check((bid, *needs))
        row = self._new_row(bid, _BOUND, at, needs)
        self._bounds[bid] = row
        for t in range(len(self.tiers)):
            self._settle(row, t)
        self._maybe_dormant(row)

    def _watch(self, row: int, entries: Sequence[bytes]) -> None:
        """Follow `entries` for `row`, counting those each tier lacks now."""
        heads = self._heads
        for e in entries:
            heads[e] = self._links.add_row(row, heads.get(e, NONE))
        for t, tier in enumerate(self.tiers):
            self._missing[t][row] = sum(not self._present(tier, e) for e in entries)

    def _unwatch(self, row: int, entries: Iterable[bytes]) -> None:
        heads, link_row, link_next = self._heads, self._link_row, self._link_next
        for e in entries:
            before, link = NONE, heads.get(e, NONE)
            while link != NONE and link_row[link] != row:
                before, link = link, link_next[link]
            if link == NONE:
                continue  # an entry listed twice: its link went with the first
            after = link_next[link]
            self._links.free_row(link)
            if before != NONE:
                link_next[before] = after
            elif after != NONE:
                heads[e] = after
            else:
                del heads[e]
                self._released.append(e)

    def _watchers(self, entry: bytes) -> list[int]:
        rows, link_row, link_next = [], self._link_row, self._link_next
        link = self._heads.get(entry, NONE)
        while link != NONE:
            rows.append(link_row[link])
            link = link_next[link]
        return rows

    # ---- changes --------------------------------------------------------------------------
    def changed(self, tier: str, entry: bytes, present: bool) -> None:
        """`entry` arrived on (or left) `tier`. Told only of actual changes."""
        t = self._tier[tier]
        step = -1 if present else 1
        kind, missing = self._kind, self._missing[t]
        for row in self._watchers(entry):
            if kind[row] == _FREE:
                continue  # forgotten by the dormant limit meanwhile
            missing[row] += step
            if kind[row] == _BOUND:
                self._settle(row, t)
                self._maybe_dormant(row)
            else:
                self._set_prefix(row, t)

    def clear(self, tier: str) -> None:
        """Everything left `tier` at once (a cache reset): retract what it showed."""
        t = self._tier[tier]
        kind, up, missing = self._kind, self._up, self._missing[t]
        rows = range(len(kind))
        for row in rows:
            if kind[row] != _FREE:
                missing[row] = self._rows.size[row]
        for row in [r for r in rows if kind[r] == _NODE and up[r] == NONE]:
            self._set_prefix(row, t)
        for row in [r for r in rows if kind[r] == _BOUND]:
            if kind[row] == _BOUND:  # the dormant limit may forget some
                self._settle(row, t)
                self._maybe_dormant(row)

    def _set_prefix(self, node: int, t: int) -> None:
        """Recompute prefix(node) on tier `t` and pass a change down its subtree."""
        kind, up, missing, on = self._kind, self._up, self._missing[t], self._on[t]
        stack = [node]
        while stack:
            n = stack.pop()
            if kind[n] != _NODE:
                continue  # forgotten meanwhile, by the dormant limit
            parent = up[n]
            now = missing[n] == 0 and (parent == NONE or on[parent] == 1)
            if now == on[n]:
                continue
            on[n] = now
            for kid in self._kids(n):  # boundaries now; child nodes after them
                if kind[kid] == _NODE:
                    stack.append(kid)
                elif kind[kid] == _BOUND:  # else forgotten by the dormant limit meanwhile
                    self._settle(kid, t)
                    self._maybe_dormant(kid)

    def _settle(self, b: int, t: int) -> None:
        node, on = self._up[b], self._on[t]
        now = self._missing[t][b] == 0 and (node == NONE or on[node] == 1)
        if now == on[b]:
            return
        on[b] = now
        if now and node != NONE:  # the chain's blocks before the boundary's own
            self._add_cover(node, t, 1)
        self._show(t, _split(self._entries[b]), now)
        if not now and node != NONE:
            self._add_cover(node, t, -1)

    def _add_cover(self, node: int, t: int, step: int) -> None:
        """Add `step` to node's cover; a node that becomes covered (or stops) announces
        (or retracts) its entries and tells its parent, and so on up. Announcements go
        root first (each block's parent before it), retractions leaf first."""
        cover, up = self._cover[t], self._up
        flipped = []
        while node != NONE:
            before = cover[node]
            cover[node] = before + step
            if (before > 0) == (before + step > 0):
                break
            flipped.append(node)
            node = up[node]
        for n in reversed(flipped) if step > 0 else flipped:
            self._show(t, _split(self._entries[n]), step > 0)

    def _show(self, t: int, entries: Iterable[bytes], on: bool) -> None:
        shown, tier = self._shown[t], self.tiers[t]
        for e in entries:
            n = shown.get(e, 0) + (1 if on else -1)
            if n:
                shown[e] = n
            else:
                del shown[e]
            if (on and n == 1) or (not on and n == 0):
                self._out.append((tier, on, e))

    # ---- forgetting ----------------------------------------------------------------------
    def _maybe_dormant(self, b: int) -> None:
        """A boundary true nowhere waits in the dormant list; too many: the oldest go."""
        bid = self._key[b]
        if any(on[b] for on in self._on):
            self._dormant.pop(bid, None)
            return
        self._dormant[bid] = None
        self._dormant.move_to_end(bid)
        while len(self._dormant) > (DORMANT_LIMIT if self._keep_dormant else 0):
            self.forget(next(iter(self._dormant)))

    def forget(self, bid: bytes) -> None:
        """Stop tracking a boundary (retracting what it announced), and the chunks of its
        chain that no longer lead to any tracked boundary."""
        b = self._bounds.pop(bid, None)
        if b is None:
            return
        self._dormant.pop(bid, None)
        for t in range(len(self.tiers)):
            if self._on[t][b]:
                self._missing[t][b] += 1  # it counts as gone from every tier
                self._settle(b, t)
        node = self._up[b]
        self._free_row(b)
        while node != NONE and self._first[node] == NONE:
            del self._nodes[self._key[node]]
            up = self._up[node]
            self._free_row(node)
            node = up

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
        return [e for e in released if e not in self._heads]

    def boundaries(self) -> set[bytes]:
        """The boundaries tracked (the dormant limit forgets the oldest of those true
        nowhere)."""
        return set(self._bounds.keys())

    def has_chunk(self, key: bytes) -> bool:
        return key in self._nodes

    def shown(self, tier: str) -> set[bytes]:
        """Entries currently announced on `tier`."""
        return set(self._shown[self._tier[tier]].keys())

    def sizes(self) -> dict[str, int]:
        return {
            "nodes": len(self._nodes),
            "boundaries": len(self._bounds),
            "dormant": len(self._dormant),
            "shown": sum(map(len, self._shown)),
        }
