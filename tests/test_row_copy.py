"""The native row copy: every row lands whole, whatever its size and alignment, on one
thread or several, with stores cached or streamed."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import _rowcopy
from hybridkv.core import row_copy


def _table(src: np.ndarray, dst: np.ndarray, rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(
        [(dst.ctypes.data + d, src.ctypes.data + s, n) for d, s, n in rows], dtype=np.int64
    ).reshape(-1, 3)


def _rows(draw, size: int, max_row: int) -> list[tuple[int, int, int]]:
    """Rows at any offset, with destinations that do not overlap."""
    rows, used = [], np.zeros(size, dtype=bool)
    for _ in range(draw(st.integers(0, 12))):
        n = draw(st.integers(1, max_row))
        d = draw(st.integers(0, size - n))
        if used[d : d + n].any():
            continue
        used[d : d + n] = True
        rows.append((d, draw(st.integers(0, size - n)), n))
    return rows


@settings(max_examples=200, deadline=None)
@given(data=st.data(), nontemporal=st.booleans())
def test_every_row_is_copied_exactly(data, nontemporal):
    size = 4096
    src = np.random.default_rng(data.draw(st.integers(0, 2**16))).integers(
        0, 256, size, dtype=np.uint8
    )
    dst = np.zeros(size, dtype=np.uint8)
    rows = _rows(data.draw, size, 640)
    _rowcopy.copy(_table(src, dst, rows), nontemporal)
    expect = np.zeros(size, dtype=np.uint8)
    for d, s, n in rows:
        expect[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expect)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_batch_split_over_threads_copies_every_row(threads):
    """Big enough to stream and to split; rows of 64-byte multiples (the streamed loop)
    and odd ones (memcpy), aligned and not."""
    rng = np.random.default_rng(threads)
    row = 32 << 10
    count = 2 * (row_copy.NONTEMPORAL_BYTES // row) + 7
    src = rng.integers(0, 256, (count, row), dtype=np.uint8)
    dst = np.zeros_like(src)
    order = rng.permutation(count)
    rows = []
    for i, o in enumerate(order):
        n = row - (i % 3) * 64 - (i % 7 == 0)  # whole 64-byte lines, or not
        shift = 8 if i % 3 and i % 5 == 0 else 0  # a destination off 16-byte alignment
        rows.append((int(o) * row + shift, i * row, n))
    table = _table(src.reshape(-1), dst.reshape(-1), rows)
    assert table[:, 2].sum() >= row_copy.NONTEMPORAL_BYTES
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        row_copy.copy_rows(table)
    finally:
        torch.set_num_threads(before)
    flat_src, expect = src.reshape(-1), np.zeros(src.size, dtype=np.uint8)
    for d, s, n in rows:
        expect[d : d + n] = flat_src[s : s + n]
    assert np.array_equal(dst.reshape(-1), expect)


def test_a_malformed_table_is_refused():
    buf = np.zeros(16, dtype=np.int64)
    for bad in (buf.reshape(4, 4), buf[:15].astype(np.int32).reshape(5, 3), buf.reshape(2, 8)):
        with pytest.raises(ValueError, match="int64"):
            _rowcopy.copy(bad, False)
    with pytest.raises(ValueError):
        _rowcopy.copy(np.zeros((4, 6), dtype=np.int64)[:, :3], False)  # not contiguous
    assert not buf.any()
    src, dst = np.arange(8, dtype=np.int8), np.zeros(8, dtype=np.int8)
    rows = np.array([[dst.ctypes.data, src.ctypes.data, 8], [0, 0, -1]], dtype=np.int64)
    with pytest.raises(ValueError, match="negative"):  # memcpy took it for ~2**64 bytes
        _rowcopy.copy(rows, False)
    assert not dst.any()  # checked before any row is copied


def test_a_forked_child_copies_on_threads_of_its_own():
    """vLLM may fork its workers after the parent already copied: the child must not hand
    work to the parent's threads, which do not exist there."""
    rows = 2 * row_copy.THREAD_BYTES // 4096
    src = np.random.default_rng(0).integers(0, 256, (rows, 4096), dtype=np.uint8)
    dst = np.zeros_like(src)
    table = _table(
        src.reshape(-1), dst.reshape(-1), [(i * 4096, i * 4096, 4096) for i in range(rows)]
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        row_copy.copy_rows(table)  # starts the parent's threads
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the copy completes, killed after 30 s
            signal.alarm(30)
            dst[:] = 0
            row_copy.copy_rows(table)
            os._exit(0 if np.array_equal(dst, src) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(before)
    assert os.waitstatus_to_exitcode(status) == 0
