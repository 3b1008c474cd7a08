"""core/recency.py against a plain list in recency order: adds, uses (one or many),
discards, holds and choices that stop part way, on random histories. A held key is
never a candidate, and the candidates are the unheld keys, least recently used first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core.recency import RecencyQueue


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(
                ["add", "add", "use", "use_all", "discard", "hold", "release", "choose"]
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
            for cand in taken:
                order.remove(cand)
                queue.discard(cand)
        assert len(queue) == len(order)
        assert all(k in queue for k in order) and bytes([99]) not in queue
    assert list(queue.candidates(held.__contains__)) == [k for k in order if k not in held]
    queue.clear()
    assert len(queue) == 0 and list(queue.candidates(held.__contains__)) == []
