"""CPU-memory admission and eviction for layouts with recurrent groups (core/index.py,
core/eviction.py): orphans first, whole boundaries by utility, budgets and pins kept."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.boundary_graph import NO_NEEDS, NONE
from hybridkv.core.ghosts import GHOSTS_MIN, GHOSTS_PER_ENTRY
from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import group_key

ATTN, STATE = 0, 1  # group ids: one attention group, one recurrent group (two in `states`)


def chunk(chain: int, c: int, g: int = ATTN) -> bytes:
    return group_key((chain * 1000 + c).to_bytes(16, "little"), g)


def states(chain: int, c: int) -> list[tuple[bytes, int]]:
    """Two recurrent groups' states at the end of chunk c, 100 bytes each."""
    return [(chunk(chain, c, STATE), 100), (chunk(chain, c, STATE + 1), 100)]


def chunks(index: StoreIndex, chain: int, n: int) -> None:
    """Chunks 0..n-1 of a chain, 50 bytes each."""
    for c in range(n):
        assert index.admit(chunk(chain, c), 50)


def add_chain(index: StoreIndex, chain: int, n: int, at: int | None = None) -> bool:
    """Chunks 0..n-1 of a chain and a boundary after chunk `at` (default the last)."""
    chunks(index, chain, n)
    at = n - 1 if at is None else at
    needs = [chunk(chain, c) for c in range(at + 1)]
    return index.admit_boundary(states(chain, at), needs, (at + 1) * 10, 200 + 50 * (at + 1))


def evicted(index: StoreIndex) -> set[bytes]:
    return set(index.take_orders().evict)


def test_orphans_go_before_any_boundary():
    index = StoreIndex(cpu_capacity=1000, recurrent=True)
    assert add_chain(index, 1, 4)  # 200 + 400 bytes
    for c in range(4):  # a suffix no boundary needs, newer than chain 1
        index.admit(chunk(2, c), 50)
    index.take_orders()
    assert index.admit(chunk(3, 0), 550)  # 400 free: 150 more
    assert evicted(index) == {chunk(2, 0), chunk(2, 1), chunk(2, 2)}
    assert index.boundary_id(chunk(1, 3, STATE))
    assert index.stats.evicted_orphans == 3 and index.stats.evicted_boundaries == 0


def test_a_large_index_evicts_exactly_what_it_needs():
    """A choice costs O(log n) per victim, so no room is freed ahead any more (it was 1/64
    of the budget from 256 boundaries on, when choosing sorted every boundary)."""
    n = 256
    index = StoreIndex(cpu_capacity=250 * n + 6400, recurrent=True)
    for chain in range(n):
        assert add_chain(index, chain, 1)  # a chunk and two states each: 250 bytes
    for c in range(128):
        assert index.admit(chunk(1000, c), 50)  # the rest: orphans
    index.take_orders()
    assert index.admit(chunk(2000, 0), 50)
    assert evicted(index) == {chunk(1000, 0)}
    index.pin([k for k in index.ledger.sizes if k != chunk(1000, 127)])
    assert index.admit(chunk(3000, 0), 50)  # only one can go: it is enough
    assert evicted(index) == {chunk(1000, 127)}


def test_a_small_index_evicts_exactly_what_it_needs():
    index = StoreIndex(cpu_capacity=6400, recurrent=True)
    for c in range(128):
        assert index.admit(chunk(1, c), 50)
    index.take_orders()
    assert index.admit(chunk(2, 0), 50)
    assert evicted(index) == {chunk(1, 0)}


def test_a_boundary_leaves_whole_with_the_chunks_only_it_needed():
    index = StoreIndex(cpu_capacity=1000, recurrent=True)
    # Chains 1 and 2 share nothing; chain 1 is older and equally efficient.
    assert add_chain(index, 1, 2) and add_chain(index, 2, 2)
    index.take_orders()
    assert index.admit(chunk(3, 0), 500)  # 400 free: one boundary goes
    out = evicted(index)
    assert out == {k for k, _ in states(1, 1)} | {chunk(1, 0), chunk(1, 1)}
    assert index.boundary_id(chunk(1, 1, STATE)) is None
    assert index.boundary_id(chunk(2, 1, STATE))


def test_a_shared_head_stays_while_a_boundary_needs_it():
    index = StoreIndex(cpu_capacity=900, recurrent=True)
    for c in range(2):
        index.admit(chunk(1, c), 50)
    head = [chunk(1, 0), chunk(1, 1)]
    # Two boundaries on one chain: after chunk 0 and after chunk 1.
    assert index.admit_boundary(states(1, 0), head[:1], 10, 250)
    assert index.admit_boundary(states(1, 1), head, 20, 250)
    index.touch(k for k, _ in states(1, 1))  # the longer one was used since
    index.take_orders()
    assert index.admit(chunk(9, 0), 500)  # 400 free: one boundary goes
    out = evicted(index)
    assert out == {k for k, _ in states(1, 0)}  # chunk 0 is still needed by the other
    assert index.in_cpu(chunk(1, 0))


def test_a_new_boundary_keeps_the_chunks_it_reads_while_room_is_made():
    """Chain 1's boundary after chunk 1 is the only candidate when its longer boundary,
    after chunk 3, is admitted; the new one reads chunks 0 and 1 too, so only the old
    one's states go."""
    index = StoreIndex(cpu_capacity=500, recurrent=True)
    assert add_chain(index, 1, 2)  # 100 + 200 bytes
    for c in (2, 3):
        assert index.admit(chunk(1, c), 50)
    index.pin([chunk(1, 2), chunk(1, 3)])  # the storing request's own chunks
    index.take_orders()
    assert boundary(index, 1, 3, parent=1)  # 100 free, 200 needed
    assert evicted(index) == {k for k, _ in states(1, 1)}
    assert all(index.in_cpu(chunk(1, c)) for c in range(4))
    assert index.boundary_id(chunk(1, 3, STATE))


def test_a_boundary_a_chunk_of_which_is_nowhere_is_not_admitted():
    index = StoreIndex(cpu_capacity=1000, recurrent=True)
    chunks(index, 1, 2)
    needs = [chunk(1, c) for c in range(3)]  # chunk 2 was never stored
    assert not index.admit_boundary(states(1, 2), needs, 30, 350)
    assert index.stats.unservable == 1
    assert not index.in_cpu(chunk(1, 2, STATE)) and index.ledger.used == 100
    index.apply(0, WorkerReport(epoch=index.epoch, disk=[(chunk(1, 2), True)]))
    assert index.admit_boundary(states(1, 2), needs, 30, 350)  # on disk: a hit promotes it


def boundary(index: StoreIndex, chain: int, at: int, parent: int | None = None) -> bool:
    """A boundary after chunk `at` of a chain whose chunks are admitted already;
    `parent`: the chunk of the chain's previous boundary."""
    needs = [chunk(chain, c) for c in range(at + 1)]
    pid = None if parent is None else index.boundary_id(chunk(chain, parent, STATE))
    return index.admit_boundary(states(chain, at), needs, (at + 1) * 10, 250, pid)


def test_a_superseded_boundary_goes_before_older_ones():
    index = StoreIndex(cpu_capacity=1000, recurrent=True)
    chunks(index, 2, 1)
    assert boundary(index, 2, 0)  # the oldest: another conversation
    chunks(index, 1, 2)
    assert boundary(index, 1, 0)  # turn 1 of a conversation
    assert boundary(index, 1, 1, parent=0)  # turn 2 extends it
    index.take_orders()
    assert index.admit(chunk(9, 0), 300)  # 150 free: 150 more
    assert evicted(index) == {k for k, _ in states(1, 0)}  # only its states: chunk 0 is needed
    assert index.boundary_id(chunk(2, 0, STATE)) and index.boundary_id(chunk(1, 1, STATE))
    assert index.stats.evicted_superseded == 1 and index.stats.evicted_boundaries == 0


def test_a_branch_point_is_not_superseded():
    index = StoreIndex(cpu_capacity=1100, recurrent=True)
    chunks(index, 2, 1)
    assert boundary(index, 2, 0)  # the oldest, another chain
    chunks(index, 1, 2)
    assert boundary(index, 1, 0)  # the fork
    assert boundary(index, 1, 1, parent=0)  # one branch...
    index.admit(chunk(3, 0), 50)  # (the other branch's own chunk)
    fork = index.boundary_id(chunk(1, 0, STATE))
    assert index.admit_boundary(states(3, 0), [chunk(1, 0), chunk(3, 0)], 20, 250, fork)
    index.take_orders()
    assert index.admit(chunk(9, 0), 200)  # 100 free: 100 more
    assert evicted(index) == {*(k for k, _ in states(2, 0)), chunk(2, 0)}  # by utility
    assert index.boundary_id(chunk(1, 0, STATE)) == fork
    assert index.stats.evicted_superseded == 0 and index.stats.evicted_boundaries == 1


def test_a_branch_point_outlasts_newer_leaves():
    index = StoreIndex(cpu_capacity=1100, recurrent=True)
    chunks(index, 1, 1)
    assert boundary(index, 1, 0)  # the fork: the oldest, and the least efficient
    fork = index.boundary_id(chunk(1, 0, STATE))
    for chain in (3, 4):  # two branches, each with its own chunk
        index.admit(chunk(chain, 0), 50)
        assert index.admit_boundary(states(chain, 0), [chunk(1, 0), chunk(chain, 0)], 20, 250, fork)
    index.take_orders()
    assert index.admit(chunk(9, 0), 400)  # 350 free: 50 more; one branch goes first
    out = evicted(index)
    assert out in ({*(k for k, _ in states(c, 0)), chunk(c, 0)} for c in (3, 4))
    assert index.boundary_id(chunk(1, 0, STATE)) == fork


def test_a_junction_stored_below_a_boundary_becomes_its_parent():
    """A second question on a document stores a state where it forks from the first
    (inside the document), after the first's boundary: both are then its children, and
    it is a branch point, not a boundary superseded by the newer question."""
    index = StoreIndex(cpu_capacity=850, recurrent=True)
    chunks(index, 1, 4)
    assert boundary(index, 1, 3)  # the first question's boundary, past the fork
    index.admit(chunk(2, 3), 50)  # the second question's own last chunk
    assert boundary(index, 1, 2)  # the junction, after chunk 2 (no parent held)
    junction = index.boundary_id(chunk(1, 2, STATE))
    needs = [chunk(1, c) for c in range(3)] + [chunk(2, 3)]
    assert index.admit_boundary(states(2, 3), needs, 40, 250, junction)
    rows = index.graph.rows
    first = index.graph.boundary(chunk(1, 3, STATE))
    assert rows.bid(rows.parent[first]) == junction and rows.kids[rows.parent[first]] == 2
    assert rows.own_bytes[first] == 200 + 50  # its states and the one chunk past the junction
    # Full: a question's boundary goes first (a leaf), not the junction's states.
    index.capacity = index.gauges()["cpu_bytes"]
    assert index.admit(chunk(9, 0), 250)
    assert index.boundary_id(chunk(1, 2, STATE)) == junction
    assert index.stats.evicted_superseded == 0 and index.stats.evicted_boundaries == 1


def test_children_follow_their_parent_when_it_leaves():
    index = StoreIndex(cpu_capacity=1000, recurrent=True)
    chunks(index, 1, 3)
    assert boundary(index, 1, 0)
    assert boundary(index, 1, 1, parent=0)
    assert boundary(index, 1, 2, parent=1)
    index.touch([chunk(1, 0, STATE)])  # the middle one is now the least recently used
    index.take_orders()
    assert index.admit(chunk(9, 0), 300)  # 250 free: 50 more
    assert evicted(index) == {k for k, _ in states(1, 1)}
    index.pin([chunk(9, 0)])  # (an orphan: it would go first)
    # The last one's parent is now the first, which it alone extends: superseded too.
    assert index.admit(chunk(9, 1), 200)  # 150 free: 50 more
    assert evicted(index) == {k for k, _ in states(1, 0)}
    assert index.boundary_id(chunk(1, 2, STATE))
    assert index.stats.evicted_superseded == 2


def test_rank_prefers_recent_and_efficient_boundaries():
    """At one scale a boundary's efficiency is worth up to alpha of the recency range
    (core/eviction.py): by recency alone (alpha 0) the old boundaries go first; with
    alpha 2 an old short one goes first and an old long one outlasts a newer short one."""

    def order(alpha: float) -> list[int]:
        index = StoreIndex(cpu_capacity=800, recurrent=True, alpha=alpha)
        assert index.admit_boundary(states(0, 0), [], 640, 1000)  # the recency range's start
        index.pin([chunk(0, 0, STATE)])
        for _ in range(10):
            index.touch([])
        assert index.admit_boundary(states(1, 0), [], 6400, 1000)  # old and long
        assert index.admit_boundary(states(2, 0), [], 640, 1000)  # old and short
        for _ in range(7):
            index.touch([])
        assert index.admit_boundary(states(3, 0), [], 640, 1000)  # newer, short
        index.take_orders()
        out = []
        for i in range(3):
            assert index.admit(chunk(9, i), 200)
            index.pin([chunk(9, i)])
            gone = evicted(index)
            out += [c for c in (1, 2, 3) if chunk(c, 0, STATE) in gone]
        return out

    assert order(0.0) == [1, 2, 3]
    assert order(2.0) == [2, 3, 1]


def visit(index: StoreIndex, chain: int, n: int = 4) -> bool:
    """A request for a chain's n chunks (400 bytes with its states): a hit if its
    boundary is held (a use), else its chunks and boundary are stored, the chunks pinned
    meanwhile as the scheduler side pins a request's stores."""
    sts, needs = states(chain, n - 1), [chunk(chain, c) for c in range(n)]
    if index.boundary_id(sts[0][0]):
        index.touch([k for k, _ in sts] + needs)
        return True
    for key in needs:
        assert index.admit(key, 50)
        index.pin([key])
    index.admit_boundary(sts, needs, n * 10, 200 + 50 * n)
    index.unpin(needs)
    return False


def held(index: StoreIndex, chain: int, n: int = 4) -> bool:
    return index.boundary_id(states(chain, n - 1)[0][0]) is not None


def test_a_reused_leaf_outlasts_newer_ones_never_reused():
    index = StoreIndex(cpu_capacity=2000, recurrent=True)  # five chains
    for chain in (1, 1, 2, 3, 4, 5, 6):  # chain 1 stored, then hit
        visit(index, chain)
    assert held(index, 1) and not held(index, 2)


def test_reused_leaves_beyond_the_protected_share_go_like_fresh_ones():
    from hybridkv.core.eviction import PROTECTED

    index = StoreIndex(cpu_capacity=2400, recurrent=True)  # six chains
    assert 4 * 400 <= PROTECTED * 2400 < 5 * 400
    for chain in (1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6):  # five reused; 1 the oldest
        visit(index, chain)
    visit(index, 7)
    assert not held(index, 1) and held(index, 6)


def test_a_few_returns_leave_eviction_by_recency():
    """A chain evicted and stored again among many new ones (a chat a little over its
    budget) does not make the index evict the newest first."""
    index = StoreIndex(cpu_capacity=2000, recurrent=True)  # five chains
    for chain in (0, 1, 2, 3, 4, 5, 0, 6):  # 5 evicts 0, which comes back and evicts 1
        visit(index, chain)
    assert held(index, 0) and held(index, 6) and not held(index, 2)


def test_a_loop_longer_than_memory_keeps_a_fixed_set_and_lets_it_go_after():
    """Least-recently-used eviction hits nothing in a loop over more chains than fit.
    Once most chunks stored are ones evicted before, live boundaries are evicted newest
    first, so a fixed set stays and hits every round; once the loop moves to other
    chains, the old set dies (idle for several return gaps) and the new loop settles the
    same way."""
    index = StoreIndex(cpu_capacity=2000, recurrent=True)  # five chains

    def rounds(chains: range, n: int) -> list[int]:
        return [sum(visit(index, c) for c in chains) for _ in range(n)]

    first = rounds(range(7), 6)
    assert first[0] == 0 and min(first[-3:]) >= 3
    second = rounds(range(10, 17), 10)
    assert min(second[-3:]) >= 3
    assert not any(held(index, c) for c in range(7))


def test_lost_state_drops_its_boundary_and_its_sibling_becomes_an_orphan():
    index = StoreIndex(cpu_capacity=10_000, recurrent=True)
    add_chain(index, 1, 2)
    from hybridkv.core.index import WorkerReport

    index.apply(0, WorkerReport(lost=[chunk(1, 1, STATE)]))
    assert index.boundary_id(chunk(1, 1, STATE + 1)) is None
    index.take_orders()
    assert index.admit(chunk(2, 0), 10_000)  # everything else is now an orphan
    assert chunk(1, 1, STATE + 1) in evicted(index)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["chain", "chunk", "pin", "unpin", "touch"]),
            st.integers(0, 6),
            st.integers(1, 5),
        ),
        max_size=40,
    ),
    capacity=st.integers(300, 2000),
    alpha=st.sampled_from([0.0, 1.0, 4.0]),
)
def test_budget_pins_and_whole_boundaries_hold_under_any_sequence(ops, capacity, alpha):
    index = StoreIndex(cpu_capacity=capacity, recurrent=True, alpha=alpha)
    pinned: list[bytes] = []
    for op, chain, n in ops:
        before = {k: index.in_cpu(k) for k in pinned}
        if op == "chain":
            for c in range(n):
                if not index.known(chunk(chain, c)):
                    index.admit(chunk(chain, c), 50)
            at = n - 1
            if all(index.in_cpu(chunk(chain, c)) for c in range(n)):
                needs = [chunk(chain, c) for c in range(n)]
                parent = next(
                    (
                        b
                        for c in range(at - 1, -1, -1)
                        if (b := index.boundary_id(chunk(chain, c, STATE)))
                    ),
                    None,
                )
                index.admit_boundary(states(chain, at), needs, n * 10, 200 + 50 * n, parent)
        elif op == "chunk":
            index.admit(chunk(chain + 10, n), 50 * n)
        elif op == "pin":
            keys = [k for k in (chunk(chain, 0), chunk(chain, n - 1, STATE)) if index.in_cpu(k)]
            index.pin(keys)
            pinned += keys
        elif op == "unpin" and pinned:
            index.unpin([pinned.pop()])
        elif op == "touch":
            index.touch([chunk(chain, n - 1, STATE)])
        gauges = index.gauges()
        assert gauges["cpu_bytes"] <= capacity
        # A pinned entry is never evicted.
        assert all(index.in_cpu(k) for k, was in before.items() if was and k in pinned)
        graph = index.graph
        rows, segs = graph.rows, graph.segments
        boundaries = set(graph.state_of.values())
        assert graph.count == len(boundaries) == len(rows.states)
        for b in boundaries:
            # Every boundary counted has all its states in CPU memory, and is theirs.
            assert all(index.in_cpu(k) and graph.state_of[k] == b for k in rows.state_keys(b))
            # The chain tree links only boundaries in CPU memory, both ways.
            parent = rows.parent[b]
            assert parent == NONE or (parent in boundaries and b in rows.children(parent))
            assert all(rows.parent[c] == b for c in rows.children(b))
            assert rows.kids[b] == len(rows.children(b))
        # A segment's references are the boundaries that end on it and the live segments
        # that extend it; each attention entry counts the live segments that hold it, so
        # it is needed exactly when a boundary needs it. Only live segments keep a row.
        live = {s for b in boundaries for s in segs.path(rows.needs[b]) if segs.keys[s]}
        assert set(segs.keys.rows()) == live | {NO_NEEDS}
        ends = Counter(rows.needs[b] for b in boundaries)
        assert all(segs.refs[s] == ends[s] + sum(segs.up[t] == s for t in live) for s in live)
        assert {k: n for k, n in graph.needers.items() if n} == Counter(
            k for s in live for k in segs.own(s)
        )
        assert set(graph.needers) >= {k for b in boundaries for k in segs.all_keys(rows.needs[b])}
        # The shared table keeps a key only while it is in CPU memory or needed.
        table = index.ledger.table
        assert len(table.slots) + len(table.away) == len(
            set(index.ledger.sizes) | set(graph.needers)
        )
        # The eviction order sees every orphan, and nothing else as one.
        orphans = [k for k in index.ledger.sizes if graph.is_orphan(k)]
        assert all(k in index.policy._orphans for k in orphans)
        assert len(index.policy._orphans) == len(orphans)
        # Evicted chunks are remembered within bounds.
        ghosts = len(index.policy.ghosts)
        assert ghosts <= max(GHOSTS_MIN, GHOSTS_PER_ENTRY * len(index.ledger.sizes))
    index.take_orders()


SAME_TRACE = """
import hashlib
from hybridkv.core.index import StoreIndex
from hybridkv.core.keys import group_key
docs, room = 9000, 7000  # boundaries of one chunk and one state; room for `room`
index = StoreIndex(room * 2 * 100, recurrent=True)
digest = hashlib.sha256()
def key(d, g):
    return group_key(hashlib.blake2b(str(d).encode(), digest_size=16).digest(), g)
for _ in range(4):
    for d in range(docs):
        chunk, state = key(d, 0), key(d, 1)
        if index.boundary_id(state) and index.in_cpu(chunk):
            index.touch([chunk, state])
            continue
        if not index.in_cpu(chunk):
            index.admit(chunk, 100)
        index.admit_boundary([(state, 100)], [chunk], 256, 200)
        for e in index.take_orders().evict:
            digest.update(e)
print(digest.hexdigest(), index.policy.ghosts._mask)
"""


def test_evictions_do_not_depend_on_the_hash_seed():
    """Above SAMPLED_FROM remembered evictions the ghost list keeps a sample of keys:
    chosen by the keys' own bits, the same trace evicts the same entries in processes
    with other hash seeds (Python's `hash` of bytes differs with each; replays and
    benchmarks could not be repeated)."""
    import os
    import subprocess
    import sys

    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", SAME_TRACE], env=env, capture_output=True, text=True, check=True
        )
        runs.append(out.stdout.split())
    assert runs[0] == runs[1]
    assert int(runs[0][1]) > 0  # the list was sampled


def test_a_boundary_with_malformed_keys_changes_nothing():
    """State keys of two lengths (a caller's error): refused before anything is counted,
    so no state is left in the ledger outside every order, where nothing could evict it."""
    index = StoreIndex(cpu_capacity=1000, recurrent=True)
    a = chunk(1, 0)
    assert index.admit(a, 50)
    with pytest.raises(ValueError, match="one length"):
        index.admit_boundary([(chunk(2, 0, STATE), 100), (b"short-state", 100)], [a], 10, 250)
    assert (index.ledger.used, index.graph.count) == (50, 0)
    assert index.make_room(1000)  # everything there can go


def _conversation(i: int, n: int) -> list[bytes]:
    """The chunks of conversation `i` up to chunk n: a 4-chunk system prompt all share
    (chain 0), then its own."""
    return [chunk(0, c) for c in range(min(n, 4))] + [chunk(i, c) for c in range(4, n)]


def _boundary(index: StoreIndex, i: int, n: int, parent: bytes | None) -> bytes:
    needs = _conversation(i, n)
    for key in needs:
        assert index.admit(key, 50)
    chain = 0 if n <= 4 else i
    assert index.admit_boundary(states(chain, n - 1), needs, n * 10, 200, parent)
    return states(chain, n - 1)[0][0]


def test_a_junction_looks_only_at_the_siblings_that_share_its_branch(monkeypatch):
    """A junction under a shared system prompt's boundary, below one conversation's
    boundary: it adopts that one, looking at no other child of the prompt's boundary
    (thousands in production: it looked at each), also after the conversation's
    boundary was re-parented to the prompt's (its own parent forgotten)."""
    index = StoreIndex(cpu_capacity=10**9, recurrent=True)
    graph = index.graph
    prompt = _boundary(index, 0, 4, None)
    for i in range(1, 200):
        _boundary(index, i, 16, prompt)
    middle = _boundary(index, 7, 8, prompt)  # conversation 7's earlier turn: a parent
    last = _boundary(index, 7, 20, middle)
    index.lost(index.epoch, middle)  # its state lost: `last` now follows the prompt
    b_last = graph.boundary(last)
    assert graph.rows.parent[b_last] == graph.boundary(prompt)
    looked: list[int] = []
    holds = graph.segments.holds
    monkeypatch.setattr(graph.segments, "holds", lambda s, k: looked.append(s) or holds(s, k))
    junction = _boundary(index, 7, 12, prompt)  # a second question, forking at chunk 12
    assert graph.rows.parent[b_last] == graph.boundary(junction)
    assert graph.rows.parent[graph.boundary(states(7, 15)[0][0])] == graph.boundary(junction)
    assert len(looked) <= 3, len(looked)
