"""The index's native key table and its block search (core/keytable.py), its per-key
table of sizes and needers (core/entry_table.py) and its lapsing answers
(core/lapsing.py): each behaves as the plain structures (or the scan) it stands for, under
any sequence of operations."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import MutableMapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.entry_table import EntryTable
from hybridkv.core.keytable import KeyTable, first_found
from hybridkv.core.lapsing import Lapsing

KEYS = st.binary(min_size=1, max_size=3)
TABLE_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "remove", "need", "unneed", "clear_sizes", "clear_needers"]),
        KEYS,
        st.integers(1, 40),  # more distinct sizes than the size classes hold
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=TABLE_OPS, asked=st.lists(KEYS, max_size=10))
def test_entry_table_is_two_dicts(ops, asked):
    """The packed table answers as a dict of sizes and a dict of needer counts would
    (sizes past the classes included), and holds no key neither counts."""
    t = EntryTable()
    sizes: dict[bytes, int] = {}
    needers: dict[bytes, int] = {}

    def unneeded(key: bytes) -> bool:
        return key in sizes and key not in needers

    for op, key, value in ops:
        if op == "insert":
            assert t.insert(key, value * 1000) == (key not in sizes)
            sizes.setdefault(key, value * 1000)
        elif op == "remove":
            assert t.remove([key, key]) == [sizes.pop(key, None), None]
        elif op == "need":
            was = unneeded(key)
            needers[key] = needers.get(key, 0) + 1
            assert t.need(key) == was
        elif op == "unneed" and key in needers:
            needers[key] -= 1
            if not needers[key]:
                del needers[key]
            assert t.unneed(key) == unneeded(key)
        elif op == "clear_sizes":
            t.clear_sizes()
            sizes.clear()
        elif op == "clear_needers":
            t.clear_needers()
            needers.clear()
        assert dict(t.sizes) == sizes and dict(t.needers) == needers
        assert len(t.sizes) == len(sizes) and len(t.needers) == len(needers)
        assert len(t.slots) + len(t.away) == len(sizes.keys() | needers.keys())
        assert len(t.odd) <= len(sizes)
    assert t.sizes.missing(asked) == [k for k in asked if k not in sizes]
    for key in asked:
        assert t.sizes.get(key) == sizes.get(key) and t.needers.get(key) == needers.get(key, 0)
        assert t.unneeded(key) == unneeded(key)


TABLE_KEYS = st.one_of(KEYS, st.binary(min_size=0, max_size=24))  # 24 bytes: too long


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["set", "del", "pop", "setdefault", "clear", "get"]),
            TABLE_KEYS,
            st.integers(-(2**63), 2**63 - 1),
        ),
        max_size=80,
    ),
    asked=st.lists(TABLE_KEYS, max_size=40),
)
def test_keytable_is_a_dict(ops, asked):
    """The native table answers as a dict of ints would, its bulk calls as a scan; a key
    too long to store is refused when set and absent when asked."""
    t = KeyTable()
    d: dict[bytes, int] = {}
    for op, key, value in ops:
        if len(key) > 23:
            if op in ("set", "setdefault"):
                with pytest.raises(ValueError, match="at most 23 bytes"):
                    t[key] = value
            assert key not in t and t.get(key) is None and t.pop(key, 7) == 7
            continue
        if op == "set":
            t[key] = d[key] = value
        elif op == "del":
            if key in d:
                del t[key], d[key]
            else:
                with pytest.raises(KeyError):
                    del t[key]
        elif op == "pop":
            assert t.pop(key, None) == d.pop(key, None)
        elif op == "setdefault":
            assert t.setdefault(key, value) == d.setdefault(key, value)
        elif op == "clear":
            t.clear()
            d.clear()
        else:
            assert t.get(key) == d.get(key) and t.get(key, 5) == d.get(key, 5)
        assert len(t) == len(d) and bool(t) == bool(d)
    assert sorted(t.items()) == sorted(d.items()) and sorted(t) == sorted(d)
    assert sorted(t.keys()) == sorted(d) and sorted(t.values()) == sorted(d.values())
    assert t.missing(asked) == [k for k in asked if k not in d]
    assert t.present(asked) == [k for k in asked if k in d]
    assert t.get_many(asked, -1) == [d.get(k, -1) for k in asked]
    assert t.missing(iter(asked)) == t.missing(tuple(asked))
    assert isinstance(t, MutableMapping)


def test_keytable_grows_and_shrinks_as_a_dict():
    """A long seeded history on few keys (so probe runs form, grow past many resizes and
    are shifted back on deletion), checked against a dict throughout."""
    seed = 4242
    print("seed", seed)
    rng = random.Random(seed)
    pool = [rng.randbytes(18) for _ in range(5000)]
    t, d = KeyTable(), {}
    for step in range(200_000):
        key = rng.choice(pool)
        if rng.random() < 0.55:
            t[key] = d[key] = step
        else:
            assert t.pop(key, None) == d.pop(key, None)
        if step % 20_000 == 0:
            assert dict(t.items()) == d
    assert dict(t.items()) == d and len(t) == len(d)
    assert t.get_many(pool, None) == [d.get(k) for k in pool]
    # Popped in batches over probe runs the erasures shift, a key asked twice popped once.
    half = pool[: len(pool) // 2] * 2
    assert t.pop_many(half, -1) == [d.pop(k, -1) for k in half]
    assert dict(t.items()) == d
    for key in list(d):
        del t[key]
    assert len(t) == 0 and t.missing(pool) == pool


def test_keytable_refuses_what_it_cannot_hold():
    t = KeyTable()
    with pytest.raises(TypeError, match="bytes"):
        t["text"] = 1
    with pytest.raises(TypeError, match="bytes"):
        t.missing([b"k", 3])
    with pytest.raises(OverflowError):
        t[b"k"] = 2**63
    with pytest.raises(TypeError):
        t[b"k"] = 1.5
    assert len(t) == 0


def test_a_listing_is_the_table_as_it_was_whatever_a_collection_runs():
    """Making `items`' tuples may run a collection, and a finaliser it runs may grow the
    table (a part rehashes): the listing used to walk the new layout on, listing keys
    twice."""
    import gc

    t = KeyTable()
    for i in range(2000):
        t[b"k%d" % i] = i
    grown = []

    class Grows:
        def __del__(self):
            for i in range(2000, 40000):
                t[b"k%d" % i] = i
            grown.append(True)

    g = Grows()
    g.cycle = g  # freed by a collection, not at once
    del g
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        items = t.items()
    finally:
        gc.set_threshold(*threshold)
    assert grown and len(t) == 40000  # the finaliser ran while the tuples were made
    keys = [k for k, _ in items]
    assert len(set(keys)) == len(keys) == 2000


def test_keytable_bytes_per_key():
    """What a million-entry tier costs per key: 32-byte slots at a load of 3/8 to 3/4."""
    t = KeyTable()
    n = 100_000
    for _ in range(n):
        t[os.urandom(18)] = 1
    assert t.__sizeof__() / n < 2 * 32 / 0.75 + 1


@settings(max_examples=200, deadline=None)
@given(
    answers=st.lists(st.tuples(KEYS, st.integers(1, 20), st.booleans()), max_size=30),
    now=st.integers(0, 22),
    asked=st.lists(KEYS, max_size=10),
)
def test_lapsing_answers_hold_until_their_time_and_the_latest_wins(answers, now, asked):
    laps = Lapsing()
    latest: dict[bytes, tuple[int, bool]] = {}
    # Given in time order, as answers with one time to live are.
    for key, until, yes in sorted(answers, key=lambda a: a[1]):
        laps.put(key, float(until), yes)
        latest[key] = (until, yes)
    laps.drop_lapsed(float(now))

    def expected(key):
        until, yes = latest.get(key, (0, False))
        return yes if until > now else None

    for key in set(asked) | set(latest):
        assert laps.get(key, float(now)) == expected(key)
    yes, unknown = laps.split(asked, float(now))
    assert yes == [k for k in asked if expected(k) is True]
    assert unknown == [k for k in asked if expected(k) is None]
    assert laps.without_yes(asked, float(now)) == [k for k in asked if expected(k) is not True]
    # Dropped: every answer lapsed by `now`, and only those.
    assert set(laps) == {k for k, (until, _) in latest.items() if until > now}


def test_lapsing_answers_are_no_objects_the_garbage_collector_tracks():
    """A lookup records hundreds of answers that live for seconds: as tuples they would
    pile up in the collector's youngest generation and make its collections long."""
    laps = Lapsing()
    keys = [os.urandom(18) for _ in range(20_000)]
    gc.collect()
    before = len(gc.get_objects())
    for i, key in enumerate(keys):
        laps.put(key, 1e9, i % 2 == 0)
    assert len(gc.get_objects()) - before < 100


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 300), picked=st.sets(st.integers(0, 299), max_size=5))
def test_first_found_is_a_scan(n, picked):
    """`first_found` over blocks equals a key-by-key scan, wherever the first pick lies."""
    keys = [i.to_bytes(2, "big") for i in range(n)]
    chosen = {keys[i] for i in picked if i < n}
    calls: list[int] = []

    def pick(block):
        calls.append(len(block))
        return [key for key in block if key in chosen]

    want = next((i for i, key in enumerate(keys) if key in chosen), n)
    assert first_found(keys, pick) == want
    assert sum(calls) <= max(2 * want + 16, 16) and len(calls) <= 6
