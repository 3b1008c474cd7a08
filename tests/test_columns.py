"""The native paged `Column` (src/hybridkv/_columns.c) against a Python list: the same
items after any mix of appends, writes, pops, extends and clears, across page edges
(4,096 items a page), for every kind; and what it refuses, refused without a change."""

from __future__ import annotations

import tracemalloc

import pytest
from hybridkv._columns import Column
from hypothesis import given, settings
from hypothesis import strategies as st

PAGE = 4096

VALUES = {
    "q": st.integers(-(2**63), 2**63 - 1),
    "d": st.floats(allow_nan=False),
    "b": st.integers(-128, 127),
    "k": st.binary(max_size=23),
}


def ops(kind: str):
    value = VALUES[kind]
    return st.lists(
        st.one_of(
            st.tuples(st.just("append"), value),
            st.tuples(st.just("extend"), st.lists(value, max_size=3 * PAGE // 2)),
            st.tuples(st.just("set"), st.integers(), value),
            st.tuples(st.just("pop")),
            st.tuples(st.just("clear")),
        ),
        max_size=30,
    )


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_a_column_holds_what_a_list_holds(kind: str):
    @settings(max_examples=60, deadline=None)
    @given(ops(kind))
    def check(history):
        col, model = Column(kind), []
        for op, *args in history:
            if op == "append":
                col.append(args[0])
                model.append(args[0])
            elif op == "extend":
                col.extend(args[0])
                model.extend(args[0])
            elif op == "set" and model:
                i = args[0] % (2 * len(model)) - len(model)  # negative ones too
                col[i] = args[1]
                model[i] = args[1]
            elif op == "pop" and model:
                assert col.pop() == model.pop()
            elif op == "clear":
                col.clear()
                model.clear()
            assert len(col) == len(model)
        assert list(col) == model
        assert [col[i] for i in range(-len(model), 0)] == model

    check()


def test_refusals_change_nothing():
    with pytest.raises(ValueError, match="kind"):
        Column("x")
    with pytest.raises(ValueError, match="not 'qq'"):
        Column(kind="qq")
    b = Column("b")
    b.append(5)
    with pytest.raises(OverflowError):
        b.append(128)
    with pytest.raises(OverflowError):
        b[0] = -129
    k = Column("k")
    k.append(b"x" * 23)
    with pytest.raises(ValueError, match="23 bytes"):
        k.append(b"y" * 24)
    with pytest.raises(TypeError):
        k[0] = "text"
    q = Column("q")
    with pytest.raises(TypeError):
        q.append(1.5)
    with pytest.raises(OverflowError):
        q.append(2**63)
    for col in (b, k, q):
        with pytest.raises(IndexError):
            col[len(col)]
        with pytest.raises(IndexError):
            col[-len(col) - 1]
        with pytest.raises(TypeError):
            del col[0]
    with pytest.raises(IndexError):
        q.pop()
    assert (list(b), list(k), len(q)) == ([5], [b"x" * 23], 0)
    b.extend(b)  # its own items, taken before it grows
    assert list(b) == [5, 5]


def test_a_value_whose_conversion_changes_the_column_lands_where_the_column_is_now():
    """Converting a value can run Python code (`__index__`), which could clear or grow
    the column: the item's place is found only after, so nothing is written into freed
    pages or past the end."""
    col = Column("q")
    col.extend(range(5))

    class Clears:
        def __index__(self) -> int:
            col.clear()
            return 7

    with pytest.raises(IndexError):
        col[1] = Clears()
    assert len(col) == 0

    class Grows:
        def __index__(self) -> int:
            col.extend(range(5000))  # a new page
            return -1

    col.append(Grows())
    assert len(col) == 5001 and col[4999] == 4999 and col[5000] == -1
    col[4096] = Grows()
    assert len(col) == 10001 and col[4096] == -1 and col[10000] == 4999


def test_memory_is_the_items_and_traced():
    """8 bytes an item in whole pages, allocated through Python's allocator (what the
    memory bench's tracemalloc counts), and given back by `clear`."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        col = Column("q")
        col.extend(range(10 * PAGE + 1))
        held = tracemalloc.get_traced_memory()[0] - base
        assert 11 * PAGE * 8 <= held < 11 * PAGE * 8 + 4096
        col.clear()
        assert tracemalloc.get_traced_memory()[0] - base < 1024
    finally:
        tracemalloc.stop()
