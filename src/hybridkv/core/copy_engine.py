"""Moves blocks between an engine's KV cache and host entries, on whatever device it is.

How a block's bytes are addressed is in `canonical.py`; this module decides where the
bytes travel and how the copies are ordered against the engine's own work.

* CPU cache: all copies of a call become one table of row copies, run natively across
  threads (`row_copy.py`) straight between cache and entries, before the call returns.
* CUDA cache: every copy runs on one side stream. It first waits for the compute stream,
  so it sees what the engine wrote (KV of this step for a store; vLLM's zeroing of newly
  allocated blocks for a load). A store gathers the blocks into one device buffer and
  copies that to a pinned host entry (full PCIe speed) before returning, so the tiers
  only ever hold finished bytes. A load copies the entry to the device and scatters it,
  then makes the compute stream wait on an event: the CPU never blocks on a load, and
  the forward that reads the blocks runs after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridkv.core.canonical import CanonicalKV, gather_blocks, row_table, scatter_blocks
from hybridkv.core.host_pool import HostPool
from hybridkv.core.planner import EntryCopy
from hybridkv.core.row_copy import copy_rows


class CopyEngine:
    def __init__(self, kv: CanonicalKV, pool: HostPool | None = None):
        self.kv = kv
        self.device = kv.tensors[0].device if kv.tensors else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.pool = pool or HostPool(pin=self.cuda)
        if self.cuda and not self.pool.pin:
            raise ValueError("a GPU engine's entries need a pinned host pool")
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Loads still running on the GPU, with the host entries they read: an entry's
        # slot must not be reused (a disk read writes from the CPU) before the copy ends.
        self._inflight: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []

    def gather(self, copies: Sequence[EntryCopy]) -> list[torch.Tensor]:
        """One new host entry per copy: its group's blocks `block_ids`, layer-major."""
        outs = [self.pool.empty(len(c.block_ids) * self.kv.block_bytes(c.group)) for c in copies]
        if not self.cuda:
            # A new entry holds its blocks in order: row k is block_ids[k].
            copy_rows(self._host_table(copies, outs, to_engine=False))
            return outs
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for c, out in zip(copies, outs, strict=True):
                staged = torch.empty(out.numel(), dtype=torch.int8, device=self.device)
                gather_blocks(self.kv, c.group, c.block_ids, staged)
                out.copy_(staged, non_blocking=True)
        stream.synchronize()
        return outs

    def scatter(self, loads: Sequence[tuple[EntryCopy, torch.Tensor]]) -> None:
        """Write rows `slots` of each entry into engine blocks `block_ids`."""
        if not self.cuda:
            copy_rows(self._host_table([c for c, _ in loads], [e for _, e in loads], True))
            return
        self._inflight = [(ev, held) for ev, held in self._inflight if not ev.query()]
        if not loads:
            return
        stream = self._stream
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            for c, entry in loads:
                # Entries from the pool are pinned; any other is pinned first (torch keeps
                # that copy alive until the transfer that reads it is done).
                host = entry if entry.is_pinned() else entry.pin_memory()
                on_device = host.to(self.device, non_blocking=True)
                scatter_blocks(self.kv, c.group, on_device, c.slots, c.block_ids)
        done = torch.cuda.Event()
        done.record(stream)
        compute.wait_event(done)
        self._inflight.append((done, [entry for _, entry in loads]))

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
