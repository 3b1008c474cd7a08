"""The index at scale (core/index.py, issue 27): on long random serving histories (chains
that share heads, turns that extend them, questions that fork them, requests that pin
what they read and own, promotions, lost entries, deletions, clears) the budget is never
exceeded, a pinned entry is never evicted, and the step's orders, replayed into a
simulated worker, leave it holding exactly what the index says it holds. Against the
slow reference (tests/reference_index.py, the index before the change) the choices,
orders, counters and listener notifications are the same once the reference is given the
policy as it is now (core/eviction.py): boundaries ranked when admitted or used instead
of min-max utility at each choice, no room freed ahead, orphans listed exactly (the
reference left stale entries in its list until a scan passed them, which only moved
where an orphan came back in the LRU order). The rank's documented bound against min-max
utility holds at every step."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any
from unittest import mock

import reference_eviction
import reference_index
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.boundary_graph import NO_NEEDS, Boundaries
from hybridkv.core.boundary_order import DEAD, LIVE, PROTECTED_DEAD, BoundaryOrder
from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import group_key

ATTN, STATES = 0, (1, 2, 3)
ATTN_BYTES, STATE_BYTES = 64, 96  # per rank


def chain_keys(prompt: tuple[int, ...]) -> list[bytes]:
    """A chain key per chunk of a prompt of chunk ids (a hash of everything up to it)."""
    return [
        hashlib.blake2b(bytes(prompt[: c + 1]), digest_size=16).digest() for c in range(len(prompt))
    ]


class Recorder:
    """An index listener that keeps what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def changed(self, tier: str, key: bytes, present: bool) -> None:
        self.events.append((tier, key, present))

    def cleared(self) -> None:
        self.events.append(("cleared",))


class Reference:
    """The slow reference driven like the index, with the policy as it is now (the module
    docstring): after each call its boundaries admitted, used or adopted then are ranked
    as core/eviction.py ranks them, and the orphans it no longer has leave its list."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.index = reference_index.StoreIndex(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.index, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "admit_boundary":
                # As the index does now (a fix): the states held already stay while room
                # is made for the others. The reference could evict one (an orphan) and
                # admit the boundary without it.
                held = [key for key, _ in args[0] if key in self.index._cpu]
                self.index.pin(held)
                try:
                    out = attr(*args, **kwargs)
                finally:
                    self.index.unpin(held)
            else:
                out = attr(*args, **kwargs)
            self._rank()
            self._purge()
            return out

        return call

    def _rank(self) -> None:
        ix = self.index
        bounds = ix._boundaries
        new = {bid for bid, b in bounds.items() if not hasattr(b, "rank")}
        scored = [
            b
            for b in bounds.values()
            if not hasattr(b, "rank") or b.used != b.ranked_used or b.parent in new
        ]
        if not scored:
            return
        oldest = min(b.used for b in bounds.values())
        best = max(b.tokens / (b.own_bytes or 1) for b in bounds.values())
        scale = ix.alpha * max(ix._tick - oldest, 1) / best if best > 0 else 0.0
        for b in scored:
            b.rank = b.used + scale * (b.tokens / (b.own_bytes or 1))
            b.ranked_used = b.used

    def _purge(self) -> None:
        ix = self.index
        for key in [
            k for k in ix._loose if k not in ix._cpu or k in ix._boundary_of or ix._needed_by.get(k)
        ]:
            del ix._loose[key]


def ranked_reference() -> Any:
    """Patches that give the reference the policy as it is now."""
    return mock.patch.multiple(
        reference_eviction, by_utility=lambda cands, alpha: sorted(cands, key=lambda b: b.rank)
    ), mock.patch.object(reference_index, "AHEAD_FROM", 1 << 62)


def plain(value: Any) -> Any:
    """A dataclass as a dict (the reference has its own classes), anything else as is."""
    return vars(value) if hasattr(value, "__dataclass_fields__") else value


class Pair:
    """The index and the reference, called alike; every answer must agree."""

    def __init__(self, capacity: int, ranks: int, alpha: float):
        self.new = StoreIndex(capacity, ranks=ranks, disk=True, recurrent=True, alpha=alpha)
        self.ref = Reference(capacity, ranks=ranks, disk=True, recurrent=True, alpha=alpha)
        self.new.listener, self.ref.index.listener = Recorder(), Recorder()
        self.ledger = self.new.ledger

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.new, name)
        if not callable(attr):
            assert plain(getattr(self.ref.index, name)) == plain(attr), name
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(list(a) if isinstance(a, list) else a for a in args)
            out = attr(*args, **kwargs)
            assert getattr(self.ref, name)(*args, **kwargs) == out, name
            return out

        return call

    def check(self, keys: set[bytes]) -> None:
        new, ref = self.new, self.ref.index
        assert plain(new.take_orders()) == plain(ref.take_orders())
        assert plain(new.stats) == plain(ref.stats)
        assert new.gauges() == ref.gauges()
        assert new.listener.events == ref.listener.events
        for key in keys:
            assert new.in_cpu(key) == ref.in_cpu(key)
            assert new.boundary_id(key) == ref.boundary_id(key)


@dataclass
class Worker:
    """What a worker holds, following the orders as steps 4-5 of docs/design.md do:
    a clear first, then the step's stores and promotions, then evictions and deletions."""

    held: set[bytes] = field(default_factory=set)

    def step(self, orders: Any, stored: set[bytes]) -> None:
        if orders.clear:
            self.held.clear()
        self.held |= stored
        self.held |= {key for key, _ in orders.promote}
        self.held -= set(orders.evict) | set(orders.delete)


class Serving:
    """A serving history, drawn from a seeded generator: prompts are chains of chunk ids;
    a new one continues an earlier one (a next turn), forks it (another question, a
    regenerated answer) or starts on one of a few shared heads (system prompts). Each
    request looks up its longest stored boundary (pins and touches what a hit reads),
    stores its chunks (pinned while it runs) and the boundary at its end, with a junction
    where it left the chunks stored before; requests finish a few steps later."""

    def __init__(
        self,
        index: Any,
        rng: random.Random,
        rounds: float = 0.0,
        loop: int = 0,
        attention: tuple[int, ...] = (ATTN,),
    ):
        self.index = index
        self.rng = rng
        # Attention groups: a boundary needs each one's chunks in turn, as the scheduler
        # side lists them (with two, a parent's needs are no prefix of its child's).
        self.attention = attention
        # The share of requests that go round a fixed set of `loop` prompts, in turn.
        self.rounds, self.loop = rounds, loop
        self.round: list[tuple[int, ...]] = []
        self.prompts: list[tuple[int, ...]] = [(h,) * 3 for h in range(1, 6)]
        self.running: list[tuple[int, list[bytes]]] = []  # (finish at step, its pins)
        self.step = 0
        self.stored: set[bytes] = set()  # admitted this step
        self.keys: dict[bytes, None] = {}  # every key used, in order (for the checks)
        self.pinned: list[bytes] = []

    def prompt(self) -> tuple[int, ...]:
        if self.rng.random() >= self.rounds:
            return self.new_prompt()
        if len(self.round) < self.loop:  # documents asked about in turn: a loop
            document = tuple(self.rng.randrange(256) for _ in range(self.rng.randrange(8, 16)))
            self.round.append(self.new_prompt() + document)
        else:
            self.round.append(self.round.pop(0))
        return self.round[-1]

    def new_prompt(self) -> tuple[int, ...]:
        rng = self.rng
        base = self.prompts[-rng.randrange(1, min(len(self.prompts), 64) + 1)]
        what = rng.random()
        if what < 0.5:  # a next turn
            out = base + tuple(rng.randrange(256) for _ in range(rng.randrange(1, 5)))
        elif what < 0.8 and len(base) > 2:  # a fork
            cut = rng.randrange(1, len(base))
            out = base[:cut] + tuple(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        else:  # a new conversation on a shared head
            out = self.prompts[rng.randrange(5)][:3] + (rng.randrange(256),)
        self.prompts.append(out)
        return out

    def admit(self, key: bytes, nbytes: int) -> bool:
        new = key not in self.index.ledger.sizes
        ok = self.index.admit(key, nbytes)
        if ok and new:
            self.stored.add(key)
        return ok

    def request(self) -> None:
        ix, rng = self.index, self.rng
        keys = chain_keys(self.prompt())
        attn = [[group_key(k, g) for g in self.attention] for k in keys]  # per chunk
        states = [[group_key(k, g) for g in STATES] for k in keys]
        self.keys.update(
            dict.fromkeys([*(k for a in attn for k in a), *(k for s in states for k in s)])
        )
        # The hit: the longest boundary whose chunks are all in CPU memory.
        hit = next(
            (
                c + 1
                for c in range(len(keys) - 2, -1, -1)
                if ix.boundary_id(states[c][0])
                and all(ix.in_cpu(k) for a in attn[: c + 1] for k in a)
            ),
            0,
        )
        pins: list[bytes] = []
        if hit:
            wanted = self.needs(attn, hit) + states[hit - 1]
            ix.pin(wanted)
            ix.touch(wanted)
            pins += wanted
        # Stores: its chunks past the hit, a junction where it leaves what is stored, and
        # the boundary at its end.
        reach = hit
        while reach < len(keys) - 1 and all(ix.known(k) for k in attn[reach]):
            reach += 1
        ends = {len(keys)} | ({reach} if hit < reach < len(keys) else set())
        for c in range(hit, len(keys)):
            for key in attn[c]:
                if not ix.known(key) and self.admit(key, ATTN_BYTES):
                    ix.pin([key])
                    pins.append(key)
        for end in sorted(ends):
            self.boundary(keys, attn, states, end)
        self.running.append((self.step + rng.randrange(1, 4), pins))

    def needs(self, attn: list[list[bytes]], end: int) -> list[bytes]:
        """What a hit after chunk `end` reads besides its states: each attention group's
        chunks in turn."""
        return [chunk[i] for i in range(len(self.attention)) for chunk in attn[:end]]

    def boundary(
        self, keys: list[bytes], attn: list[list[bytes]], states: list[list[bytes]], end: int
    ) -> None:
        ix = self.index
        previous, parent = next(
            ((c + 1, bid) for c in range(end - 2, -1, -1) if (bid := ix.boundary_id(states[c][0]))),
            (0, None),
        )
        own = len(STATES) * STATE_BYTES + (end - previous) * ATTN_BYTES * len(self.attention)
        new = {k for k in states[end - 1] if k not in ix.ledger.sizes}
        sizes = [(k, STATE_BYTES) for k in states[end - 1]]
        if ix.admit_boundary(sizes, self.needs(attn, end), end * 256, own, parent):
            self.stored |= new

    def other(self) -> None:
        """Something else that happens to entries: a promotion, a lost store, a staged
        state deleted, an entry pinned or released, vLLM's own hit touching a chain."""
        ix, rng = self.index, self.rng
        what = rng.random()
        if not self.keys:
            return
        key = rng.choice(list(islice(reversed(self.keys), 512))[::-1])  # the last 512 used
        if what < 0.3 and not ix.known(key):
            ix.apply(0, WorkerReport(epoch=ix.epoch, disk=[(key, True)]))
            for rank in range(1, ix.ranks):
                ix.apply(rank, WorkerReport(epoch=ix.epoch, disk=[(key, True)]))
            if ix.promote(key, STATE_BYTES, "disk"):
                self.running.append((self.step + 1, ["promote", key, rng.random() < 0.8]))
        elif what < 0.4 and ix.in_cpu(key):
            ix.apply(0, WorkerReport(epoch=ix.epoch, lost=[key]))
        elif what < 0.5 and ix.in_cpu(key):
            ix.delete(key)
        elif what < 0.7 and ix.in_cpu(key):
            ix.pin([key])
            self.pinned.append(key)
        elif what < 0.8 and self.pinned:
            ix.unpin([self.pinned.pop(rng.randrange(len(self.pinned)))])
        else:
            ix.touch([key])

    def finish(self) -> None:
        """Release what requests finished this step hold; report promotions."""
        still = []
        for at, pins in self.running:
            if at > self.step:
                still.append((at, pins))
            elif pins and pins[0] == "promote":
                _, key, ok = pins
                for rank in range(self.index.ranks):
                    report = WorkerReport(
                        epoch=self.index.epoch, promoted=[(self.index.epoch, key, ok)]
                    )
                    self.index.apply(rank, report)
            else:
                self.index.unpin(pins)
        self.running = still
        self.step += 1


def run(
    serving: Serving, steps: int, after_step: Callable[[set[bytes]], None], clear_every: int = 0
) -> None:
    """`steps` steps of 1-3 requests or other events each; after every event the budget
    holds and no pinned entry left CPU memory (a lost one excepted: no pin keeps what a
    worker does not hold)."""
    rng, ledger = serving.rng, serving.index.ledger
    for step in range(steps):
        if clear_every and step % clear_every == clear_every - 1:
            serving.index.clear()
            serving.stored.clear()
        for _ in range(rng.randrange(1, 4)):
            pinned = [k for k in ledger._pins if k in ledger.sizes]
            lost = serving.index.stats.lost
            if rng.random() < 0.6:
                serving.request()
            else:
                serving.other()
            if serving.index.stats.lost == lost:
                assert all(k in ledger.sizes for k in pinned)
            assert ledger.used <= ledger.capacity
        serving.finish()
        stored, serving.stored = serving.stored, set()
        after_step(stored)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    boundaries=st.integers(4, 40),
    ranks=st.sampled_from([1, 2]),
    alpha=st.sampled_from([0.0, 0.25, 1.0, 4.0]),
    rounds=st.sampled_from([0.0, 0.5, 0.9]),
    attention=st.sampled_from([(ATTN,), (ATTN, 4)]),
)
def test_choices_orders_and_notifications_equal_the_reference(
    seed, boundaries, ranks, alpha, rounds, attention
):
    """Two attention groups too: a boundary's needs then list one group's chunks, then
    the other's, so a parent's are no prefix of its child's."""
    per = ranks * (len(STATES) * STATE_BYTES + 3 * ATTN_BYTES * len(attention))
    pair = Pair(boundaries * per, ranks, alpha)
    serving = Serving(pair, random.Random(seed), rounds, 2 * boundaries, attention)
    patches = ranked_reference()
    with patches[0], patches[1]:
        run(serving, 120, lambda stored: pair.check(serving.keys), clear_every=97)


def rank_excess(order: Any, alpha: float) -> tuple[float, float]:
    """For the unprotected boundaries of an order (all of it, first, while the workload
    does not loop): how far the min-max utility of the first by rank is above the lowest,
    and the bound core/eviction.py documents, 2 * max |lambda_i - lambda| * e_i / span."""
    rows = order.rows
    cands = [*order._ranked[DEAD].rows(), *order._ranked[LIVE].rows()]
    if len(cands) < 2:
        return 0.0, 0.0
    used = [rows.used[b] for b in cands]
    eff = [rows.efficiency(b) for b in cands]
    rank = [rows.rank[b] for b in cands]
    low = min(used)
    span = max(max(used) - low, 1)
    best = max(eff) or 1.0
    utility = [(u - low) / span + alpha * e / best for u, e in zip(used, eff, strict=True)]
    first = min(range(len(cands)), key=lambda i: (rank[i], rows.seq[cands[i]]))
    scale = alpha * span / best
    drift = max(abs((r - u) / e - scale) * e for r, u, e in zip(rank, used, eff, strict=True))
    return utility[first] - min(utility), 2 * drift / span


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    ranks=st.sampled_from([1, 2]),
    rounds=st.sampled_from([0.0, 0.7]),
)
def test_at_scale_budget_pins_and_the_workers_view_hold(seed, ranks, rounds):
    """Thousands of boundaries: the orders replayed into a worker leave it holding what
    the index holds, every step; and the rank's bound against min-max utility holds."""
    boundaries = 1000
    per = ranks * (len(STATES) * STATE_BYTES + 3 * ATTN_BYTES)
    index = StoreIndex(boundaries * per, ranks=ranks, disk=True, recurrent=True)
    serving = Serving(index, random.Random(seed), rounds, 2 * boundaries)
    worker = Worker()

    def after_step(stored: set[bytes]) -> None:
        worker.step(index.take_orders(), stored)
        if serving.step % 20 == 0:
            assert worker.held == set(index.ledger.sizes)
            if not index.policy.looping:
                for order in (index.policy._leaves, index.policy._forks):
                    excess, bound = rank_excess(order, index.alpha)
                    assert excess <= bound + 1e-9

    run(serving, 2000, after_step)
    assert worker.held == set(index.ledger.sizes)
    assert index.stats.evicted_boundaries > 0


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "add", "remove", "sync"]),
            st.integers(0, 12),  # a last use (ties are common), or a cutoff
            st.booleans(),  # reused
            st.integers(1, 4),  # own bytes
            st.integers(0, 5),  # a rank (distinct: floats computed from uses rarely tie)
        ),
        max_size=60,
    ),
    room=st.integers(0, 12),
)
def test_boundary_order_equals_the_reference_order(ops, room):
    """One `BoundaryOrder` (core/boundary_order.py) under adds, removals and a cutoff
    moving both ways: its order, looping or not, is the reference's (the reference given
    the ranks), and each boundary is filed dead exactly when last used before the cutoff."""
    rows = Boundaries()
    order = BoundaryOrder(rows, 0, room)
    held: list[int] = []
    seq = 0
    for op, value, reused, own, rank in ops:
        if op == "add":
            seq += 1
            b = rows.new((bytes([seq]),), NO_NEEDS, 1, own, value, seq)
            rows.reused[b] = reused
            rows.rank[b] = rank + seq / 1000
            order.add(b)
            held.append(b)
        elif op == "remove" and held:
            b = held.pop(value % len(held))
            order.remove(b)
            rows.free(b)  # (its row is handed out again)
        elif op == "sync":
            order.sync(value - 0.5)
        for b in held:
            dead = rows.place[b] - order.base in (DEAD, PROTECTED_DEAD)
            assert dead == (rows.used[b] < order.cutoff)
        ref = [
            reference_eviction.Boundary(
                1, (rows.bid(b),), (), rows.own_bytes[b], rows.used[b], reused=rows.reused[b]
            )
            for b in held
        ]
        now = 100
        for looping in (False, True):
            live_for = now - order.cutoff if looping else None
            with ranked_reference()[0]:
                for r, b in zip(ref, held, strict=True):
                    r.rank = rows.rank[b]  # type: ignore[attr-defined]
                want = reference_eviction.eviction_order(ref, 0.0, room, now, live_for)
            assert [rows.bid(b) for b in order.order(looping)] == [r.states[0] for r in want]
