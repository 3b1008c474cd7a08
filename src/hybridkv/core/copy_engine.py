"""Moves blocks between an engine's KV cache and host entries, on whatever device it is.

How a block's bytes are addressed is in `canonical.py`; this module decides where the
bytes travel and how the copies are ordered against the engine's own work.

* CPU cache: all copies of a call become one table of row copies, run natively across
  threads (`row_copy.py`) straight between cache and entries, before the call returns.
* CUDA cache: the same table, run by one Triton kernel (`cuda_rows.py`) on a side stream
  straight between device pages and pinned host entries. The stream first waits for the
  compute stream, so it sees what the engine wrote (KV of this step for a store; vLLM's
  zeroing of newly allocated blocks for a load). Neither direction blocks the CPU:
  - a store (`gather_async`) returns its entries with a `Landing` that says when their
    bytes are complete (the caller hands them to the tiers only then), and the compute
    stream waits for the copy on the GPU, so no later work of the engine (a forward,
    Model Runner V2's state pre-copy, the zeroing of a reallocated block) can overwrite
    a block before the copy has read it. Model Runner V2 runs its state pre-copy before
    the first connector hook of a step, so a per-block flush decided at that hook (vLLM's
    own offloading connector) would come too late for recurrent blocks; the GPU-side
    wait is right by construction and costs the copy's time on the GPU, never a CPU
    stall.
  - a load (`scatter`) returns a `Landing` too, and the compute stream does not wait
    for it: the blocks belong to a request that vLLM keeps out of every forward until
    the connector reports its load finished, which the worker does only once the
    landing is done (and an aborted request's blocks are not freed before that report
    either). A large restore thus overlaps the forwards of the requests decoding
    meanwhile. An entry stays referenced until the copy that reads it has run.
  Loads and stores share the side stream, so a load that reads an entry whose store
  has not landed yet still reads complete bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridkv.core.canonical import CanonicalKV, row_table
from hybridkv.core.host_pool import HostPool
from hybridkv.core.planner import EntryCopy
from hybridkv.core.row_copy import copy_rows


class Landing:
    """When a copy's bytes are complete: a store's host entries, a load's blocks (at
    once on a CPU cache)."""

    def __init__(self, event: torch.cuda.Event | None = None):
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


LANDED = Landing()


class CopyEngine:
    def __init__(self, kv: CanonicalKV, pool: HostPool | None = None):
        self.kv = kv
        self.device = kv.tensors[0].device if kv.tensors else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.pool = pool or HostPool(pin=self.cuda)
        if self.cuda and not self.pool.pin:
            raise ValueError("a GPU engine's entries need a pinned host pool")
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        if self.cuda:
            # Triton comes with vLLM's GPU builds; CPU engines never import it.
            from hybridkv.core.cuda_rows import copy_rows_cuda

            self._copy_rows_cuda = copy_rows_cuda
        # Loads still running on the GPU, with the host entries they read: an entry's
        # slot must not be reused (a disk read writes from the CPU) before the copy ends.
        self._inflight: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []

    def gather(self, copies: Sequence[EntryCopy]) -> list[torch.Tensor]:
        """`gather_async`, returning once the entries are complete."""
        outs, landing = self.gather_async(copies)
        landing.wait()
        return outs

    def gather_async(self, copies: Sequence[EntryCopy]) -> tuple[list[torch.Tensor], Landing]:
        """One new host entry per copy: its group's blocks `block_ids`, layer-major; their
        bytes are complete once the `Landing` is done."""
        outs = [self.pool.empty(len(c.block_ids) * self.kv.block_bytes(c.group)) for c in copies]
        # A new entry holds its blocks in order: row k is block_ids[k].
        table = self._host_table(copies, outs, to_engine=False)
        if not self.cuda:
            copy_rows(table)
            return outs, LANDED
        stream = self._stream
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            self._copy_rows_cuda(table, self.device)
        done = torch.cuda.Event()
        done.record(stream)
        compute.wait_event(done)
        return outs, Landing(done)

    def scatter(self, loads: Sequence[tuple[EntryCopy, torch.Tensor]]) -> Landing:
        """Write rows `slots` of each entry into engine blocks `block_ids`; the blocks
        hold them once the `Landing` is done."""
        if not self.cuda:
            copy_rows(self._host_table([c for c, _ in loads], [e for _, e in loads], True))
            return LANDED
        self._inflight = [(ev, held) for ev, held in self._inflight if not ev.query()]
        if not loads:
            return LANDED
        # The kernel reads host entries in place, which the GPU can only do in pinned
        # memory. Entries from the pool are pinned; any other is pinned as a copy.
        entries = [e if e.is_pinned() else e.pin_memory() for _, e in loads]
        table = self._host_table([c for c, _ in loads], entries, to_engine=True)
        stream = self._stream
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            self._copy_rows_cuda(table, self.device)
        done = torch.cuda.Event()
        done.record(stream)
        self._inflight.append((done, entries))
        return Landing(done)

    def _host_table(
        self, copies: Sequence[EntryCopy], entries: Sequence[torch.Tensor], to_engine: bool
    ) -> np.ndarray:
        """One row-copy table for all copies; a store's entries take rows in block order."""
        tables = []
        for g in sorted({c.group for c in copies}):
            pairs = [(c, e) for c, e in zip(copies, entries, strict=True) if c.group == g]
            slots = [c.slots if to_engine else range(len(c.block_ids)) for c, _ in pairs]
            ids = [c.block_ids for c, _ in pairs]
            tables.append(row_table(self.kv, g, [e for _, e in pairs], slots, ids, to_engine))
        return np.concatenate(tables) if tables else np.empty((0, 3), dtype=np.int64)
