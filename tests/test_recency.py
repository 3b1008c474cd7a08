"""core/recency.py against a plain list in recency order: adds, uses (one or many),
discards (one or many), holds and choices that stop part way, on random histories. A held key is
never a candidate, and the candidates are the unheld keys, least recently used first.
And core/linked_keys.py's `LruMap` (the tiers' maps) against an `OrderedDict`."""

from __future__ import annotations

import gc
import tracemalloc
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.linked_keys import LruMap
from hybridkv.core.recency import RecencyQueue


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    *("add", "add", "use", "use_all", "discard", "discard_all"),
                    *("hold", "release", "choose"),
                ]
            ),
            st.integers(0, 15),  # a key, or how many candidates a choice takes
        ),
        max_size=120,
    )
)
def test_recency_queue_equals_a_list(ops):
    queue, order, held = RecencyQueue(), [], set()
    for op, n in ops:
        key = bytes([n])
        if op == "add" or (op == "use" and key in order):
            if key in order:
                order.remove(key)
            order.append(key)
            queue.add(key) if op == "add" else queue.use(key)
        elif op == "use":
            queue.use(key)  # not here: nothing happens
        elif op == "use_all":  # keys n, n + 1, n + 2 (in order; those here move)
            keys = [bytes([n + i]) for i in range(3)]
            for k in keys:
                if k in order:
                    order.remove(k)
                    order.append(k)
            queue.use_all(keys)
        elif op == "discard":
            if key in order:
                order.remove(key)
            queue.discard(key)
        elif op == "discard_all":  # keys n, n + 1, n + 2 and n again (here, held or not)
            keys = [bytes([n + i]) for i in (0, 1, 2, 0)]
            order = [k for k in order if k not in keys]
            queue.discard_all(keys)
        elif op in ("hold", "release"):
            (held.add if op == "hold" else held.discard)(key)
            queue.hold([key], op == "hold")
        else:  # a choice takes the first n candidates and evicts them
            taken = []
            for cand in queue.candidates(held.__contains__):
                if len(taken) == n:
                    break
                taken.append(cand)
            assert taken == [k for k in order if k not in held][:n]
            order = [k for k in order if k not in taken]
            queue.discard_all(taken)  # one eviction
        assert len(queue) == len(order)
        assert all(k in queue for k in order) and bytes([99]) not in queue
    assert list(queue.candidates(held.__contains__)) == [k for k in order if k not in held]
    queue.clear()
    assert len(queue) == 0 and list(queue.candidates(held.__contains__)) == []


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["set", "set", "get", "pop", "del", "popitem", "move", "clear"]),
            st.integers(0, 11),  # a key
            st.integers(-(1 << 63), (1 << 63) - 1),  # a value
            st.booleans(),  # popitem's `last`
        ),
        max_size=150,
    ),
    items=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 1 << 40)), max_size=8),
)
def test_lru_map_equals_an_ordered_dict(ops, items):
    """Same values, same order, same errors; slots handed out again after removals."""
    start = [(bytes([k]) * 18, v) for k, v in items]
    lru, od = LruMap(start), OrderedDict(start)
    for op, n, value, last in ops:
        key = bytes([n]) * 18
        if op == "set":
            lru[key] = od[key] = value
        elif op == "get":
            assert lru.get(key) == od.get(key) and lru.get(key, -1) == od.get(key, -1)
            assert (key in lru) == (key in od)
            if key in od:
                assert lru[key] == od[key]
        elif op == "pop":
            assert lru.pop(key, None) == od.pop(key, None)
        elif op in ("del", "move") and key not in od or op == "popitem" and not od:
            with pytest.raises(KeyError):
                if op == "del":
                    del lru[key]
                elif op == "move":
                    lru.move_to_end(key)
                else:
                    lru.popitem(last)
        elif op == "del":
            del lru[key], od[key]
        elif op == "move":
            lru.move_to_end(key)
            od.move_to_end(key)
        elif op == "popitem":
            assert lru.popitem(last) == od.popitem(last)
        else:
            lru.clear()
            od.clear()
        assert len(lru) == len(od) and list(lru) == list(od)


def test_lru_map_holds_no_object_per_key():
    """What the tiers' maps are built for: a full collection follows no reference per
    key (it follows two per key of an `OrderedDict`), and an entry costs less than in
    one (about 120 bytes against 190 at this size)."""
    keys = [i.to_bytes(18, "big") for i in range(100_000)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        lru = LruMap((key, 4160) for key in keys)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held / len(keys) < 150
    assert sum(len(gc.get_referents(part)) for part in vars(lru).values()) < 10
    assert len(lru) == len(keys) and lru[keys[-1]] == 4160 and next(iter(lru)) == keys[0]
