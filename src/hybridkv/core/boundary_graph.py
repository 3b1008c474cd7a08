"""The boundaries in CPU memory and the chain tree between them: the second part of the
scheduler side's index (core/index.py), kept for layouts with recurrent groups.

A hit there resumes at a *boundary*: every recurrent group's state at one chunk boundary,
plus the attention chunks before it (its *needs*). The graph records, per boundary, its
states, what it needs, what keeping it costs beyond the chain's previous boundary
(`own_bytes`), its last use on a logical clock, and its place in the chain tree: its
*parent* is the chain's previous boundary in CPU memory, its *children* the longer ones
that extend it. An attention entry in CPU memory that is neither a state of a boundary
nor needed by one is an *orphan* (it serves no hit). The graph decides nothing: it tells
a `GraphWatcher` (the eviction policy) what changed, boundary by boundary and orphan by
orphan.

Compact records, because a production CPU tier holds a million entries: a boundary's
needs are a chain of *segments*, each the keys one boundary added beyond the segment it
extends, packed into one bytes object, so the boundaries of a chain share its keys
instead of each holding a tuple of all of them. A segment counts what refers to it
(`refs`: boundaries that end on it, segments that extend it) and lives while that is
above 0; per attention entry a count of the live segments that hold it shares the byte
ledger's slot for the key (core/entry_table.py). So a boundary admitted or forgotten
below another of its chain touches only the keys of its own segment, not its whole
chain's (a 24k-token prompt's boundary needs 96 chunks; its own segment, the few chunks
of its turn), and an eviction choice counts what it frees the same way (`Segments.dies`).

Boundaries and segments are *rows*: an int id into columns of numbers, and dicts
of ints to bytes for their keys, not a Python object each. A full collection of CPython's
garbage collector follows every reference of every object it tracks, on vLLM's scheduler
thread; as objects (16 references a boundary, 4 a segment, and a boundary in each of the
state map's values) they were 2.3 million of the 2.9 million references a 190-300 ms
collection followed at a million entries (docs/benchmarks.md). Columns of numbers, and
dicts whose keys and values are bytes and ints, are not tracked at all. Children are
linked through the rows (first child, next and previous sibling), so adding or dropping
one is O(1) without a set per parent.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Protocol

from hybridkv.core.keys import KEY_BYTES
from hybridkv.core.keytable import KeyTable, RowBytes
from hybridkv.core.ledger import Ledger
from hybridkv.core.rows import Rows

KEY_WIDTH = KEY_BYTES + 2  # a group key (core/keys.py)


def check_keys(states: Sequence[bytes], needs: Sequence[bytes]) -> None:
    """What a boundary's keys must be, checked before anything is changed for it (an
    error half way would leave states counted in the ledger and in no order): its state
    keys of one length, its needs group keys."""
    if not states or any(len(key) != len(states[0]) for key in states):
        raise ValueError("a boundary has state keys, of one length")
    if any(len(key) != KEY_WIDTH for key in needs):
        raise ValueError(f"needs are group keys of {KEY_WIDTH} bytes")


NONE = -1  # no row
NO_NEEDS = 0  # the segment of a boundary that needs nothing


class Segments(Rows):
    """A boundary's needs as a chain of segments (the module docstring): row `NO_NEEDS`
    needs nothing."""

    COLUMNS = {"up": "q", "refs": "q"}  # the segment it extends (NONE: first of its chain)

    def __init__(self) -> None:
        super().__init__()
        self.keys = RowBytes()  # its own keys, KEY_WIDTH bytes each, in order
        self.clear()

    def new(self, keys: bytes, up: int) -> int:
        seg = self.add_row(up, 0)
        self.keys[seg] = keys
        return seg

    def free(self, seg: int) -> None:
        del self.keys[seg]
        self.free_row(seg)

    def clear(self) -> None:
        self.clear_rows()
        self.keys.clear()
        self.new(b"", NONE)  # NO_NEEDS

    def path(self, seg: int) -> list[int]:
        """This segment and the ones above it, the chain's first first."""
        out = []
        while seg != NONE:
            out.append(seg)
            seg = self.up[seg]
        out.reverse()
        return out

    def blob(self, seg: int) -> bytes:
        return b"".join(self.keys[s] for s in self.path(seg))

    def head(self, seg: int) -> bytes:
        """The first key of its chain."""
        while self.up[seg] != NONE:
            seg = self.up[seg]
        return self.keys[seg][:KEY_WIDTH]

    def all_keys(self, seg: int) -> list[bytes]:
        """Every key it and the segments above it hold, in chain order."""
        return [key for s in self.path(seg) for key in self.own(s)]

    def holds(self, seg: int, key: bytes) -> bool:
        while seg != NONE:
            keys = self.keys[seg]
            at = keys.find(key)
            while at >= 0:
                if at % KEY_WIDTH == 0:
                    return True
                at = keys.find(key, at + 1)
            seg = self.up[seg]
        return False

    def own(self, seg: int) -> list[bytes]:
        """Its own keys (not those of the segments above it)."""
        keys, W = self.keys[seg], KEY_WIDTH
        return [keys[i : i + W] for i in range(0, len(keys), W)]

    def dies(self, seg: int, left: dict[int, int]) -> Iterator[int]:
        """The segments that die when one reference to `seg` goes, it first, with `left`
        holding references already dropped (a choice's, not applied yet: `left` maps a
        segment to the references it has left)."""
        refs, up = self.refs, self.up
        while seg != NONE and seg != NO_NEEDS:
            n = left.get(seg, refs[seg]) - 1
            left[seg] = n
            if n:
                return
            yield seg
            seg = up[seg]


class Boundaries(Rows):
    """A boundary whose states are all in CPU memory, as a row."""

    COLUMNS = {
        "tokens": "q",  # a hit here saves the prefill of this many tokens
        "needs": "q",  # its segment: the attention entries a hit here also reads
        "own_bytes": "q",  # its states plus the chunks after the chain's previous boundary
        "used": "q",  # logical time of its last use
        "seq": "q",  # admission order (earlier first among equals)
        "parent": "q",  # the chain's previous boundary in CPU memory
        "kid": "q",  # its first child (the others follow through `next`)
        "next": "q",  # the next child of its parent
        "prev": "q",
        # The next (previous) boundary of the same branch key (`BoundaryGraph._branches`)
        "bnext": "q",
        "bprev": "q",
        "kids": "q",  # how many children
        "reused": "b",  # used again since its admission (a hit, or vLLM's own)
        "held": "q",  # its states that are pinned or promoting: it cannot go while > 0
        # Where the eviction policy filed it (core/eviction.py): its rank, the use and
        # efficiency it was ranked with, and its place (0: in no order).
        "rank": "d",
        "used_ranked": "q",
        "efficiency_ranked": "d",
        "ranked": "b",
        "place": "b",
    }

    def __init__(self) -> None:
        super().__init__()
        self.states = RowBytes()  # its states' keys, one per recurrent group
        self._width: dict[int, int] = {}  # a state key's length, when not KEY_WIDTH

    def new(
        self, states: Sequence[bytes], needs: int, tokens: int, own_bytes: int, used: int, seq: int
    ) -> int:
        width = len(states[0])
        row = self.add_row(tokens, needs, own_bytes, used, seq, *(NONE,) * 6, *(0,) * 8)
        self.states[row] = b"".join(states)
        if width != KEY_WIDTH:
            self._width[row] = width
        return row

    def free(self, row: int) -> None:
        del self.states[row]
        self._width.pop(row, None)
        self.free_row(row)

    def clear(self) -> None:
        self.clear_rows()
        self.states.clear()
        self._width.clear()

    def state_keys(self, row: int) -> list[bytes]:
        blob, W = self.states[row], self._width.get(row, KEY_WIDTH)
        return [blob[i : i + W] for i in range(0, len(blob), W)]

    def bid(self, row: int) -> bytes:
        """Its id: its first state's key."""
        return self.states[row][: self._width.get(row, KEY_WIDTH)]

    def efficiency(self, row: int) -> float:
        """Tokens of prefill a hit here saves per byte kept."""
        return self.tokens[row] / (self.own_bytes[row] or 1)

    def children(self, row: int) -> list[int]:
        return self.siblings(self.kid[row])

    def siblings(self, first: int) -> list[int]:
        """`first` and the rows linked after it."""
        out, nxt = [], self.next
        while first != NONE:
            out.append(first)
            first = nxt[first]
        return out

    def link(self, first: int, row: int) -> int:
        """Put `row` at the front of the sibling list starting at `first`: the new first."""
        self.next[row], self.prev[row] = first, NONE
        if first != NONE:
            self.prev[first] = row
        return row

    def unlink(self, first: int, row: int) -> int:
        """Take `row` out of the sibling list starting at `first`: the new first."""
        nxt, prv = self.next[row], self.prev[row]
        if prv != NONE:
            self.next[prv] = nxt
        else:
            first = nxt
        if nxt != NONE:
            self.prev[nxt] = prv
        self.next[row] = self.prev[row] = NONE
        return first

    def add_child(self, parent: int, child: int) -> None:
        self.kid[parent] = self.link(self.kid[parent], child)
        self.kids[parent] += 1
        self.parent[child] = parent

    def drop_child(self, parent: int, child: int) -> None:
        self.kid[parent] = self.unlink(self.kid[parent], child)
        self.kids[parent] -= 1
        self.parent[child] = NONE


class GraphWatcher(Protocol):
    """Told of every change to the graph, in this order for a boundary that changes:
    `unfile` before it changes, `scored` once its use or cost changed (a batch: the
    boundaries of one event), `file` after; `removed` after `unfile` for one that leaves
    (its row is then freed)."""

    def unfile(self, b: int) -> None: ...

    def scored(self, boundaries: Sequence[int]) -> None: ...

    def file(self, b: int) -> None: ...

    def removed(self, b: int) -> None: ...

    def orphaned(self, keys: Sequence[bytes], orphan: bool) -> None:
        """Entries became orphans (in CPU memory, no boundary's state, needed by no
        boundary), in their order, or stopped being ones."""


class BoundaryGraph:
    def __init__(self, ledger: Ledger, watcher: GraphWatcher):
        self.ledger = ledger
        self.watcher = watcher
        self.tick = 0  # logical clock of uses
        self.rows = Boundaries()
        self.segments = Segments()
        self.state_of = KeyTable()  # state key -> its boundary's row
        # Attention entry -> live segments that hold it (needed while listed): the ledger's
        # table, whose slot for a key holds both.
        self.table = ledger.table
        self.needers = ledger.table.needers
        # Every boundary by its *branch key*, the first key of its needs past its
        # parent's (its chain's first without a parent), linked through `bnext`: a
        # junction adopts only siblings that pass through it, and those share its branch
        # key, so it looks at those, not at every child of its parent (thousands under
        # one shared system prompt).
        self._branches = KeyTable()  # branch key -> first boundary of it
        self._branch = RowBytes()  # boundary -> its branch key
        # Parents of boundaries an eviction forgot, refiled once at its end (`left`):
        # a chain's turns evicted together would each refile their shared parent.
        self._unsettled: dict[int, None] = {}
        self._seq = 0
        self.count = 0

    def boundary(self, key: bytes) -> int | None:
        """The row of the boundary `key` is a state of."""
        return self.state_of.get(key)

    def is_orphan(self, key: bytes) -> bool:
        return self.table.unneeded(key) and key not in self.state_of

    # ---- entries --------------------------------------------------------------------------
    def entered(self, key: bytes) -> None:
        """An entry admitted on its own (an attention chunk, a promoted entry)."""
        if self.is_orphan(key):
            self.watcher.orphaned([key], True)

    def left(self, keys: Sequence[bytes]) -> None:
        """Entries left CPU memory together (the ledger no longer has them: an eviction,
        or one): each boundary one of them is a state of goes, and none is an orphan any
        more. None of them is filed as an orphan meanwhile (a boundary evicted whole
        would file its states and chunks, to take them out again); last, the parents
        their boundaries left behind are filed (in whatever order: an order's content
        does not depend on it)."""
        leaving = set(keys)
        for b in dict.fromkeys(self.state_of.get_many(keys, None)):
            if b is not None:
                self.forget(b, leaving)
        self.watcher.orphaned(keys, False)
        if self._unsettled:
            parents, self._unsettled = list(self._unsettled), {}
            self._refile(parents, [])

    # ---- uses -----------------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes]) -> None:
        """A use of `keys` (a hit, vLLM's own hit): one tick, and every boundary among
        them used now."""
        self.tick += 1
        tick, rows = self.tick, self.rows
        used: list[int] = []
        for b in self.state_of.get_many(keys, None):
            if b is not None and (rows.used[b] != tick or not rows.reused[b]):
                self.watcher.unfile(b)
                rows.used[b], rows.reused[b] = tick, True
                used.append(b)
        self._refile(used, used)

    # ---- boundaries -----------------------------------------------------------------------
    def add(
        self,
        states: Sequence[bytes],
        needs: Sequence[bytes],
        tokens: int,
        own_bytes: int,
        parent_id: bytes | None,
    ) -> int:
        """A boundary whose states are in the ledger now (see `StoreIndex.admit_boundary`).
        A longer boundary admitted before it that passes through it and had its parent
        becomes its child (a junction stored below a sibling's boundary is the branch
        point of both). (Keeping it as one after either child leaves served document QA
        more but the agent trace less: docs/benchmarks.md.)"""
        for key in states:
            old = self.state_of.get(key)
            if old is not None:
                self.forget(old)
        self.tick += 1
        rows = self.rows
        parent = self.state_of.get(parent_id) if parent_id is not None else None
        if parent is not None and rows.bid(parent) != parent_id:
            parent = None
        self._seq += 1
        seg, branch = self._segment(needs, parent)
        b = rows.new(states, seg, tokens, own_bytes, self.tick, self._seq)
        rows.held[b] = sum(1 for key in states if self.ledger.held(key))
        self.count += 1
        for key in states:
            self.state_of[key] = b
        self.watcher.orphaned(states, False)
        changed = [b]
        if parent is not None:
            self.watcher.unfile(parent)
            rows.add_child(parent, b)
            changed.append(parent)
        if branch is not None:
            self._link_branch(b, branch)
        adopted = self._adopt(b, needs[-1]) if needs else []
        self._refer(seg)
        self._refile(changed + adopted, [b, *adopted])
        return b

    def _refer(self, seg: int) -> None:
        """One more reference to `seg`; a segment that comes alive refers to the one it
        extends, and its keys count it."""
        need, state_of, segs = self.table.need, self.state_of, self.segments
        refs, up = segs.refs, segs.up
        needed: list[bytes] = []  # orphans no more
        while seg != NO_NEEDS and seg != NONE:
            refs[seg] += 1
            if refs[seg] > 1:
                break
            needed += [key for key in segs.own(seg) if need(key) and key not in state_of]
            seg = up[seg]
        self.watcher.orphaned(needed, False)

    def _segment(self, needs: Sequence[bytes], parent: int | None) -> tuple[int, bytes | None]:
        """The segment of a boundary needing `needs` under `parent`, and its branch key
        (None where it needs nothing past its parent)."""
        if not needs:
            return NO_NEEDS, None
        blob = b"".join(needs)
        segs = self.segments
        if parent is not None and self.rows.needs[parent] != NO_NEEDS:
            up = self.rows.needs[parent]
            above = segs.blob(up)
            if blob.startswith(above):
                own = blob[len(above) :]
                return (segs.new(own, up), own[:KEY_WIDTH]) if own else (up, None)
        seg = segs.new(blob, NONE)
        return seg, self._key_after(seg, self._skip(parent if parent is not None else NONE))

    def _skip(self, parent: int) -> int:
        """How many bytes of keys `parent` needs (0 for none)."""
        if parent == NONE:
            return 0
        segs = self.segments
        return sum(len(segs.keys[s]) for s in segs.path(self.rows.needs[parent]))

    def _key_after(self, seg: int, skip: int) -> bytes | None:
        """The key of the needs `seg` ends after their first `skip` bytes (a parent's
        needs: `_skip`); None if there is none."""
        segs = self.segments
        if not skip:
            return segs.head(seg) or None
        for s in segs.path(seg):
            keys = segs.keys[s]
            if skip < len(keys):
                return keys[skip : skip + KEY_WIDTH]
            skip -= len(keys)
        return None

    def _link_branch(self, b: int, key: bytes) -> None:
        rows = self.rows
        first = self._branches.get(key, NONE)
        rows.bnext[b], rows.bprev[b] = first, NONE
        if first != NONE:
            rows.bprev[first] = b
        self._branches[key] = b
        self._branch[b] = key

    def _unlink_branch(self, b: int) -> None:
        key = self._branch.pop(b)
        if key is None:
            return
        rows = self.rows
        nxt, prv = rows.bnext[b], rows.bprev[b]
        if prv != NONE:
            rows.bnext[prv] = nxt
        elif nxt != NONE:
            self._branches[key] = nxt
        else:
            del self._branches[key]
        if nxt != NONE:
            rows.bprev[nxt] = prv
        rows.bnext[b] = rows.bprev[b] = NONE

    def _rebranch(self, b: int, skip: int) -> None:
        """File `b` under the branch key its parent, needing `skip` bytes of keys, gives
        it now."""
        self._unlink_branch(b)
        key = self._key_after(self.rows.needs[b], skip)
        if key is not None:
            self._link_branch(b, key)

    def _adopt(self, b: int, last: bytes) -> list[int]:
        """The boundaries `b` adopts (see `add`); each one's cost is what it keeps beyond
        `b` now. Only a boundary that needs `b`'s last chunk passes through `b`, so when
        none does (`b` is not admitted below a longer one: nearly always) the siblings,
        thousands under one shared system prompt, are not looked at."""
        branch = self._branch.get(b)
        if branch is None or not self.needers.get(last):
            return []
        rows, segs = self.rows, self.segments
        parent = rows.parent[b]
        tokens = rows.tokens[b]
        if parent == NONE or segs.up[rows.needs[b]] == rows.needs[parent]:
            candidates = []
            o = self._branches.get(branch, NONE)
            while o != NONE:
                candidates.append(o)
                o = rows.bnext[o]
        else:
            # Its needs do not extend its parent's (several attention groups: each group's
            # keys in turn), so a key's place says nothing of the chunk: every sibling.
            candidates = rows.children(parent)
        adopted = [
            o
            for o in candidates
            if o != b
            and rows.parent[o] == parent
            and rows.tokens[o] > tokens
            and segs.holds(rows.needs[o], last)
        ]
        if not adopted:
            return []
        shared = set(segs.all_keys(rows.needs[b]))
        skip = self._skip(b)
        sizes = self.ledger.sizes
        for o in adopted:
            self.watcher.unfile(o)
            if rows.parent[o] != NONE:
                rows.drop_child(rows.parent[o], o)  # b's parent, unfiled already
            rows.own_bytes[o] = sum(sizes[k] for k in rows.state_keys(o)) + sum(
                sizes.get(k, 0) for k in segs.all_keys(rows.needs[o]) if k not in shared
            )
            rows.add_child(b, o)  # b is new: it had none
            self._rebranch(o, skip)
        return adopted

    def forget(self, b: int, leaving: Collection[bytes] = ()) -> None:
        """Stop counting a boundary (one of its states left CPU memory); its other states,
        and the chunks no other boundary needs, stay until evicted, as orphans (but those
        in `leaving`, see `left`). Its children now follow its parent (the chain's
        previous boundary left)."""
        rows, segs = self.rows, self.segments
        self.watcher.unfile(b)
        self.watcher.removed(b)
        self._unsettled.pop(b, None)
        self.count -= 1
        orphans: list[bytes] = []  # in the order they become orphans
        for key in rows.state_keys(b):
            del self.state_of[key]
            if key not in leaving and self.is_orphan(key):
                orphans.append(key)
        parent = rows.parent[b]
        if parent != NONE:
            self.watcher.unfile(parent)
            rows.drop_child(parent, b)
        # A child whose segment extends b's passes through b, so the key after b's
        # parent in its chain is b's own branch key.
        inherited, seg_b, up = self._branch.get(b), rows.needs[b], self.segments.up
        self._unlink_branch(b)
        skip = -1
        for child in rows.children(b):
            rows.drop_child(b, child)
            if parent != NONE:
                rows.add_child(parent, child)
            if inherited is not None and up[rows.needs[child]] == seg_b:
                self._unlink_branch(child)
                self._link_branch(child, inherited)
                continue
            if skip < 0:
                skip = self._skip(parent)
            self._rebranch(child, skip)
        if parent != NONE:
            if leaving:
                self._unsettled[parent] = None
            else:
                self._refile([parent], [])
        unneed = self.table.unneed
        left: dict[int, int] = {}
        dead = list(segs.dies(rows.needs[b], left))
        for seg, n in left.items():
            segs.refs[seg] = n
        rows.free(b)
        for seg in reversed(dead):  # the chain's first first, as orphans are ordered
            for key in segs.own(seg):
                if unneed(key) and key not in self.state_of and key not in leaving:
                    orphans.append(key)
            segs.free(seg)
        self.watcher.orphaned(orphans, True)

    def _refile(self, changed: Sequence[int], scored: Sequence[int]) -> None:
        if scored:
            self.watcher.scored(scored)
        for b in changed:
            self.watcher.file(b)

    def clear(self) -> None:
        self.state_of.clear()
        self.table.clear_needers()
        self._branches.clear()
        self._branch.clear()
        self._unsettled.clear()
        self.rows.clear()
        self.segments.clear()
        self.count = 0
