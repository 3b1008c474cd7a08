"""Batches of row copies between host buffers: native code, split over threads.

A CPU-tier store or load is many page-sized rows at scattered engine addresses. torch's
CPU index kernels move those one element at a time (0.6 x a plain copy for a store +
load); `_rowcopy` does one memcpy per row with the GIL released, so a batch can be split
over threads. It takes a table of (destination address, source address, byte count):
the addresses come from live tensors whose bounds the caller has checked.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hybridkv import _rowcopy

# From this many bytes a batch streams its stores past the cache: a batch this large
# would evict itself anyway, and without the read of each destination line one thread
# copied 1.6 times as fast (bench/copy_path.py). Smaller batches stay cached for the
# forward pass that reads them next.
NONTEMPORAL_BYTES = 4 << 20
# A thread for each this many bytes, up to torch's thread count: a thread's hand-off
# costs tens of microseconds.
THREAD_BYTES = 1 << 20

_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="hybridkv-copy")
    return _executor


def _forget_pool() -> None:
    """A forked child (vLLM may fork its workers) has none of its parent's threads: work
    handed to the parent's executor there would never run."""
    global _executor
    _executor = None


os.register_at_fork(after_in_child=_forget_pool)


def copy_rows(table: np.ndarray) -> None:
    """Copy every row of an int64 `(n, 3)` table of (dst address, src address, bytes).

    Copies run on as many threads as torch computes with (the cores an engine worker
    owns), since the engine's own work waits for them.
    """
    if not len(table):
        return
    table = np.ascontiguousarray(table, dtype=np.int64)
    sizes = np.cumsum(table[:, 2])
    total = int(sizes[-1])
    nontemporal = total >= NONTEMPORAL_BYTES
    threads = min(torch.get_num_threads(), total // THREAD_BYTES, len(table))
    if threads <= 1:
        _rowcopy.copy(table, nontemporal)
        return
    cuts = np.searchsorted(sizes, total * np.arange(1, threads) // threads)
    first, *rest = np.split(table, cuts)
    futures = [_pool().submit(_rowcopy.copy, part, nontemporal) for part in rest]
    _rowcopy.copy(first, nontemporal)
    for f in futures:
        f.result()
