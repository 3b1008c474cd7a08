"""The index's split dict (core/keymap.py), its per-key table of sizes and needers
(core/entry_table.py) and its lapsing answers (core/lapsing.py): each behaves as the
plain structures it stands for, under any sequence of operations."""

from __future__ import annotations

import gc
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.entry_table import EntryTable
from hybridkv.core.keymap import PARTS, KeyMap
from hybridkv.core.lapsing import Lapsing

KEYS = st.binary(min_size=1, max_size=3)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["set", "del", "pop", "setdefault", "clear"]), KEYS, st.integers(0, 9)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, asked=st.lists(KEYS, max_size=10))
def test_keymap_is_a_dict(ops, asked):
    m: KeyMap[int] = KeyMap()
    d: dict[bytes, int] = {}
    for op, key, value in ops:
        if op == "set":
            m[key] = d[key] = value
        elif op == "del" and key in d:
            del m[key], d[key]
        elif op == "pop":
            assert m.pop(key, None) == d.pop(key, None)
        elif op == "setdefault":
            assert m.setdefault(key, value) == d.setdefault(key, value)
        elif op == "clear":
            m.clear()
            d.clear()
        assert len(m) == len(d) and bool(m) == bool(d)
    assert sorted(m) == sorted(d) == sorted(m.keys())
    assert sorted(m.items()) == sorted(d.items())
    assert sorted(m.values()) == sorted(d.values())
    assert m.get_many(asked, -1) == [d.get(k, -1) for k in asked]
    assert m.missing(asked) == [k for k in asked if k not in d]
    for key in asked:
        assert (key in m) == (key in d) and m.get(key) == d.get(key)


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
            assert t.remove(key) == sizes.pop(key, None)
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
        assert sum(map(len, t.parts)) + len(t.away) == len(sizes.keys() | needers.keys())
        assert len(t.odd) <= len(sizes)
    assert t.sizes.missing(asked) == [k for k in asked if k not in sizes]
    for key in asked:
        assert t.sizes.get(key) == sizes.get(key) and t.needers.get(key) == needers.get(key, 0)
        assert t.unneeded(key) == unneeded(key)


def test_entry_table_values_are_small_ints():
    """With a layout's few sizes and a few needers, a key's packed value is one of the
    small ints CPython caches: no int object per entry."""
    t = EntryTable()
    for i in range(1000):
        key = i.to_bytes(4, "big")
        t.insert(key, (1024, 512, 512, 512)[i % 4])
        for _ in range(i % 3):
            t.need(key)
    assert all(v is int(str(v)) for part in t.parts for v in part.values())


def test_keymap_parts_fill_evenly_with_digest_keys():
    """Each part holds about a 64th of random (digest-like) keys, so a part's rebuild
    costs about a 64th of the whole table's."""
    m: KeyMap[int] = KeyMap()
    n = 64_000
    for _ in range(n):
        m[os.urandom(18)] = 1
    sizes = [len(part) for part in m._parts]
    assert len(sizes) == PARTS and sum(sizes) == n
    assert max(sizes) < 1.25 * n / PARTS  # 1000 expected; a deviation of 250 is ~8 sigma


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
