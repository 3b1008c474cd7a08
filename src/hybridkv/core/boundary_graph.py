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
needs are a chain of `Segment`s, each the keys one boundary added beyond the segment it
extends, packed into one bytes object, so the boundaries of a chain share its keys
instead of each holding a tuple of all of them. A segment counts what refers to it
(`refs`: boundaries that end on it, segments that extend it) and lives while that is
above 0; per attention entry a count of the live segments that hold it shares the byte
ledger's slot for the key (core/entry_table.py). So a boundary admitted or
forgotten below another of its chain touches only the keys of its own segment, not its
whole chain's (a 24k-token prompt's boundary needs 96 chunks; its own segment, the few
chunks of its turn), and an eviction choice counts what it frees the same way (`dies`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridkv.core.keymap import KeyMap
from hybridkv.core.keys import KEY_BYTES
from hybridkv.core.ledger import Ledger

KEY_WIDTH = KEY_BYTES + 2  # a group key (core/keys.py)
# A boundary's sort keys by last use pack (use, admission order) into one int, not a
# tuple: one object per key instead of three (a tuple and a negated int), at a hundred
# thousand boundaries. Admission order stays below 2**SEQ_BITS for any real uptime.
SEQ_BITS = 48


def by_used(used: int, seq: int) -> int:
    """Sorts by last use, oldest first, then admission order."""
    return used << SEQ_BITS | seq


def by_recent(used: int, seq: int) -> int:
    """Sorts by last use, newest first, then admission order."""
    return seq - (used << SEQ_BITS)


@dataclass(eq=False, slots=True)
class Segment:
    """Keys a boundary needs beyond those of the segment it extends (`up`), KEY_WIDTH
    bytes each, in chain order."""

    keys: bytes
    up: Segment | None
    refs: int = 0  # boundaries ending on it and segments extending it: it lives while > 0

    def path(self) -> list[Segment]:
        """This segment and the ones above it, the chain's first first."""
        out = []
        seg: Segment | None = self
        while seg is not None:
            out.append(seg)
            seg = seg.up
        out.reverse()
        return out

    def blob(self) -> bytes:
        return b"".join(s.keys for s in self.path())

    def __iter__(self) -> Iterator[bytes]:
        W = KEY_WIDTH
        return iter([s.keys[i : i + W] for s in self.path() for i in range(0, len(s.keys), W)])

    def __contains__(self, key: bytes) -> bool:
        seg: Segment | None = self
        while seg is not None:
            at = seg.keys.find(key)
            while at >= 0:
                if at % KEY_WIDTH == 0:
                    return True
                at = seg.keys.find(key, at + 1)
            seg = seg.up
        return False

    def own(self) -> Iterator[bytes]:
        """Its own keys (not those of the segments above it)."""
        W = KEY_WIDTH
        return iter([self.keys[i : i + W] for i in range(0, len(self.keys), W)])

    def dies(self, left: dict[Segment, int]) -> Iterator[Segment]:
        """The segments that die when one reference to this one goes, this one first,
        with `left` holding references already dropped (a choice's, not applied yet:
        `left` maps a segment to the references it has left)."""
        seg: Segment | None = self
        while seg is not None and seg is not NO_NEEDS:
            n = left.get(seg, seg.refs) - 1
            left[seg] = n
            if n:
                return
            yield seg
            seg = seg.up


NO_NEEDS = Segment(b"", None)


@dataclass(eq=False, slots=True)
class Boundary:
    """A boundary whose states are all in CPU memory."""

    tokens: int  # a hit here saves the prefill of this many tokens
    states: tuple[bytes, ...]  # one entry per recurrent group; the first names it
    needs: Segment  # attention entries a hit here also reads
    own_bytes: int  # its states plus the chunks after the chain's previous boundary
    used: int  # logical time of its last use
    seq: int  # admission order (earlier first among equals)
    parent: Boundary | None = None  # the chain's previous boundary in CPU memory
    # Its children: the one itself, or two or more in a set (most parents have one, and
    # a set costs 216 bytes).
    _kids: Boundary | set[Boundary] | None = None
    reused: bool = False  # used again since its admission (a hit, or vLLM's own)
    held: int = 0  # its states that are pinned or promoting: it cannot go while > 0
    # Where the eviction policy filed it (core/eviction.py): its rank, the efficiency it
    # was ranked with, and its sort keys.
    rank: float = 0.0
    efficiency_ranked: float = 0.0
    place: int = 0
    by_used: int = 0  # by_used(used, seq) when ranked (0: not yet)
    by_recent: int = 0  # by_recent(used, seq)
    by_rank: tuple[float, int] = (0.0, 0)

    @property
    def bid(self) -> bytes:
        return self.states[0]

    @property
    def kids(self) -> int:
        kids = self._kids
        return 0 if kids is None else len(kids) if type(kids) is set else 1

    @property
    def children(self) -> Collection[Boundary]:
        kids = self._kids
        return () if kids is None else kids if type(kids) is set else (kids,)

    def add_child(self, child: Boundary) -> None:
        kids = self._kids
        if kids is None:
            self._kids = child
        elif type(kids) is set:
            kids.add(child)
        elif kids is not child:
            self._kids = {kids, child}

    def drop_child(self, child: Boundary) -> None:
        kids = self._kids
        if kids is child:
            self._kids = None
        elif type(kids) is set:
            kids.discard(child)
            if len(kids) == 1:
                self._kids = next(iter(kids))

    @property
    def efficiency(self) -> float:
        """Tokens of prefill a hit here saves per byte kept."""
        return self.tokens / (self.own_bytes or 1)


class GraphWatcher(Protocol):
    """Told of every change to the graph, in this order for a boundary that changes:
    `unfile` before it changes, `scored` once its use or cost changed (a batch: the
    boundaries of one event), `file` after; `removed` after `unfile` for one that leaves."""

    def unfile(self, b: Boundary) -> None: ...

    def scored(self, boundaries: Sequence[Boundary]) -> None: ...

    def file(self, b: Boundary) -> None: ...

    def removed(self, b: Boundary) -> None: ...

    def orphaned(self, key: bytes, orphan: bool) -> None: ...


class BoundaryGraph:
    def __init__(self, ledger: Ledger, watcher: GraphWatcher):
        self.ledger = ledger
        self.watcher = watcher
        self.tick = 0  # logical clock of uses
        self.state_of: KeyMap[Boundary] = KeyMap()
        # Attention entry -> live segments that hold it (needed while listed): the ledger's
        # table, whose slot for a key holds both.
        self.table = ledger.table
        self.needers = ledger.table.needers
        # Boundaries without a parent, by their chain's first key (a junction adopts from
        # these; with a parent, from its children).
        self._roots: dict[bytes, set[Boundary]] = {}
        self._seq = 0
        self.count = 0

    def boundary(self, key: bytes) -> Boundary | None:
        return self.state_of.get(key)

    def is_orphan(self, key: bytes) -> bool:
        return self.table.unneeded(key) and key not in self.state_of

    # ---- entries --------------------------------------------------------------------------
    def entered(self, key: bytes) -> None:
        """An entry admitted on its own (an attention chunk, a promoted entry)."""
        if self.is_orphan(key):
            self.watcher.orphaned(key, True)

    def left(self, key: bytes) -> None:
        """An entry left CPU memory (the ledger no longer has it): a boundary it is a
        state of goes, and it is no orphan any more."""
        b = self.state_of.get(key)
        if b is not None:
            self.forget(b)
        self.watcher.orphaned(key, False)

    # ---- uses -----------------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes]) -> None:
        """A use of `keys` (a hit, vLLM's own hit): one tick, and every boundary among
        them used now."""
        self.tick += 1
        used: list[Boundary] = []
        for key in keys:
            b = self.state_of.get(key)
            if b is not None and (b.used != self.tick or not b.reused):
                self.watcher.unfile(b)
                b.used, b.reused = self.tick, True
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
    ) -> Boundary:
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
        parent = self.state_of.get(parent_id) if parent_id is not None else None
        if parent is not None and parent.bid != parent_id:
            parent = None
        self._seq += 1
        b = Boundary(
            tokens,
            tuple(states),
            self._segment(needs, parent),
            own_bytes,
            self.tick,
            self._seq,
            parent,
        )
        b.held = sum(1 for key in states if self.ledger.held(key))
        self.count += 1
        for key in states:
            self.state_of[key] = b
            self.watcher.orphaned(key, False)
        changed = [b]
        if parent is not None:
            self.watcher.unfile(parent)
            parent.add_child(b)
            changed.append(parent)
        else:
            self._root(b, True)
        adopted = self._adopt(b, needs[-1]) if needs else []
        self._refer(b.needs)
        self._refile(changed + adopted, [b, *adopted])
        return b

    def _refer(self, seg: Segment) -> None:
        """One more reference to `seg`; a segment that comes alive refers to the one it
        extends, and its keys count it."""
        need, state_of = self.table.need, self.state_of
        while seg is not NO_NEEDS:
            seg.refs += 1
            if seg.refs > 1:
                return
            for key in seg.own():
                if need(key) and key not in state_of:
                    self.watcher.orphaned(key, False)
            if seg.up is None:
                return
            seg = seg.up

    def _segment(self, needs: Sequence[bytes], parent: Boundary | None) -> Segment:
        if not needs:
            return NO_NEEDS
        if any(len(key) != KEY_WIDTH for key in needs):
            raise ValueError(f"needs are group keys of {KEY_WIDTH} bytes")
        blob = b"".join(needs)
        if parent is not None and parent.needs is not NO_NEEDS:
            above = parent.needs.blob()
            if blob.startswith(above):
                own = blob[len(above) :]
                return Segment(own, parent.needs) if own else parent.needs
        return Segment(blob, None)

    def _adopt(self, b: Boundary, last: bytes) -> list[Boundary]:
        """The boundaries `b` adopts (see `add`); each one's cost is what it keeps beyond
        `b` now. Only a boundary that needs `b`'s last chunk passes through `b`, so when
        none does (`b` is not admitted below a longer one: nearly always) the siblings,
        thousands under one shared system prompt, are not looked at."""
        if not self.needers.get(last):
            return []
        siblings = b.parent.children if b.parent is not None else self._roots.get(self._head(b))
        adopted = [
            o for o in siblings or () if o is not b and o.tokens > b.tokens and last in o.needs
        ]
        if not adopted:
            return []
        shared = set(b.needs)
        sizes = self.ledger.sizes
        for o in adopted:
            self.watcher.unfile(o)
            if o.parent is not None:
                o.parent.drop_child(o)  # b's parent, unfiled already
            else:
                self._root(o, False)
            o.parent = b
            o.own_bytes = sum(sizes[k] for k in o.states) + sum(
                sizes.get(k, 0) for k in o.needs if k not in shared
            )
        for o in adopted:  # b is new: it had none
            b.add_child(o)
        return adopted

    def forget(self, b: Boundary) -> None:
        """Stop counting a boundary (one of its states left CPU memory); its other states,
        and the chunks no other boundary needs, stay until evicted, as orphans. Its
        children now follow its parent (the chain's previous boundary left)."""
        self.watcher.unfile(b)
        self.watcher.removed(b)
        self.count -= 1
        for key in b.states:
            del self.state_of[key]
            if self.is_orphan(key):
                self.watcher.orphaned(key, True)
        parent = b.parent
        if parent is not None:
            self.watcher.unfile(parent)
            parent.drop_child(b)
        else:
            self._root(b, False)
        for child in b.children:
            child.parent = parent
            if parent is not None:
                parent.add_child(child)
            else:
                self._root(child, True)
        if parent is not None:
            self._refile([parent], [])
        unneed = self.table.unneed
        left: dict[Segment, int] = {}
        dead = list(b.needs.dies(left))
        for seg, n in left.items():
            seg.refs = n
        for seg in reversed(dead):  # the chain's first first, as orphans are ordered
            for key in seg.own():
                if unneed(key) and key not in self.state_of:
                    self.watcher.orphaned(key, True)

    def _refile(self, changed: Sequence[Boundary], scored: Sequence[Boundary]) -> None:
        if scored:
            self.watcher.scored(scored)
        for b in changed:
            self.watcher.file(b)

    def _head(self, b: Boundary) -> bytes:
        """The first key of its chain."""
        seg = b.needs
        while seg.up is not None:
            seg = seg.up
        return seg.keys[:KEY_WIDTH]

    def _root(self, b: Boundary, present: bool) -> None:
        if b.needs is NO_NEEDS:
            return
        head = self._head(b)
        if present:
            self._roots.setdefault(head, set()).add(b)
            return
        roots = self._roots[head]
        roots.discard(b)
        if not roots:
            del self._roots[head]

    def clear(self) -> None:
        self.state_of.clear()
        self.table.clear_needers()
        self._roots.clear()
        self.count = 0
