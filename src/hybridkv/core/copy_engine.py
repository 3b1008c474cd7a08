"""Moves blocks between an engine's KV cache and host entries, on whatever device it is.

How a block's bytes are addressed is in `canonical.py`; this module decides where the
bytes travel and how the copies are ordered against the engine's own work.

* CPU cache: all copies of a call become one table of row copies, run natively across
  threads (`row_copy.py`) straight between cache and entries, before the call returns.
* CUDA cache: the same table, run by a Triton kernel (`cuda_rows.py`) straight between
  device pages and pinned host entries, one launch per `LAUNCH_BYTES` of copies (the GPU
  starts on the first while the host builds the rest), on one of two side streams:
  stores on one, loads on the other, so a store never queues behind a load. Each first
  waits for the compute stream, so it sees what the engine wrote (KV of this step for a
  store; vLLM's zeroing of newly allocated blocks for a load). Nothing blocks the CPU,
  and the compute stream waits for neither:
  - a store (`gather_async`) returns its entries with a `Landing` that says when their
    bytes are complete (the caller hands them to the tiers only then). The blocks it
    reads must stay intact until then; what keeps each kind of block intact (vLLM's
    delayed free, a wait of the compute stream where nothing else does) is decided by
    the worker from what vLLM frees when (`vllm/worker_side.py`), which orders the
    compute stream behind a store with `hold_compute` where it must.
  - a load (`scatter`) returns a `Landing` too: its blocks belong to a request that vLLM
    keeps out of every forward until the connector reports its load finished, which the
    worker does only once the landing is done, failed or not (vLLM frees or reuses the
    blocks of a failed load once it is reported). A large restore thus overlaps the
    forwards of the requests decoding meanwhile, and the next forward never waits for
    it. An entry stays referenced until the copy that reads it has run; a load that
    reads an entry whose store has not landed yet waits for that store (`after`).
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
        """Block the calling thread until the copy is complete."""
        if self._event is not None:
            self._event.synchronize()

    def order(self, stream: torch.cuda.Stream) -> None:
        """Make work queued on `stream` from now on wait for the copy, on the GPU."""
        if self._event is not None:
            stream.wait_event(self._event)


LANDED = Landing()

# Bytes one kernel launch copies at most on a GPU. On an H200 a 1 GiB store spent 1.8 ms
# on the host (its entries, its table, the upload and launch) before a 21 ms copy began,
# 8 % of its time (docs/benchmarks.md, "GPU copy"): cut into launches, the copy starts
# after the first one's share and the rest of the host's work runs beside it.
LAUNCH_BYTES = 64 << 20


def check_device(device: torch.device) -> None:
    """Refuse caches where no copy path has run: another accelerator (the CPU path would
    memcpy device addresses: a crash, not an error) or a ROCm GPU (torch calls it "cuda";
    the Triton kernel has run on NVIDIA GPUs only)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"hybridkv copies KV caches on CPU and CUDA, not {device}")
    if device.type == "cuda" and torch.version.hip:
        raise ValueError("hybridkv's GPU copies have run on NVIDIA GPUs only, not on ROCm")


class CopyEngine:
    def __init__(
        self, kv: CanonicalKV, pool: HostPool | None = None, cuda_programs: int | None = None
    ):
        """`cuda_programs`: programs every CUDA batch runs on (benchmarks sweep it); None:
        `cuda_rows.STORE_PROGRAMS` for stores, `LOAD_PROGRAMS` for loads."""
        self.kv = kv
        self.device = kv.tensors[0].device if kv.tensors else torch.device("cpu")
        check_device(self.device)
        self.cuda = self.device.type == "cuda"
        self.pool = pool or HostPool(pin=self.cuda)
        if self.cuda and not self.pool.pin:
            raise ValueError("a GPU engine's entries need a pinned host pool")
        self._stores = torch.cuda.Stream(self.device) if self.cuda else None
        self._loads = torch.cuda.Stream(self.device) if self.cuda else None
        if self.cuda:
            # Triton comes with vLLM's GPU builds; CPU engines never import it.
            from hybridkv.core.cuda_rows import LOAD_PROGRAMS, STORE_PROGRAMS, copy_rows_cuda

            self._copy_rows_cuda = copy_rows_cuda
            self._store_programs = STORE_PROGRAMS if cuda_programs is None else cuda_programs
            self._load_programs = LOAD_PROGRAMS if cuda_programs is None else cuda_programs
        # Loads still running on the GPU, with the host entries they read: an entry's
        # slot must not be reused (a disk read writes from the CPU) before the copy ends.
        self._inflight: list[tuple[Landing, list[torch.Tensor]]] = []

    def gather(self, copies: Sequence[EntryCopy]) -> list[torch.Tensor]:
        """`gather_async`, returning once the entries are complete."""
        outs, landing = self.gather_async(copies)
        landing.wait()
        return outs

    def gather_async(self, copies: Sequence[EntryCopy]) -> tuple[list[torch.Tensor], Landing]:
        """One new host entry per copy: its group's blocks `block_ids`, layer-major; their
        bytes are complete once the `Landing` is done. The engine's later work does not
        wait for it (see `hold_compute`)."""
        outs = [self.pool.empty(len(c.block_ids) * self.kv.block_bytes(c.group)) for c in copies]
        if not self.cuda:
            # A new entry holds its blocks in order: row k is block_ids[k].
            copy_rows(self._host_table(copies, outs, to_engine=False))
            return outs, LANDED
        return outs, self._run(self._stores, copies, outs, False, self._store_programs)

    def scatter(
        self, loads: Sequence[tuple[EntryCopy, torch.Tensor]], after: Sequence[Landing] = ()
    ) -> Landing:
        """Write rows `slots` of each entry into engine blocks `block_ids` once the stores
        `after` (whose entries it reads) have landed; the blocks hold them once the
        returned `Landing` is done."""
        if not self.cuda:
            for landing in after:
                landing.wait()
            copy_rows(self._host_table([c for c, _ in loads], [e for _, e in loads], True))
            return LANDED
        self._inflight = [(ld, held) for ld, held in self._inflight if not ld.done()]
        if not loads:
            return LANDED
        # The kernel reads host entries in place, which the GPU can only do in pinned
        # memory. Entries from the pool are pinned; any other is pinned as a copy.
        entries = [e if e.is_pinned() else e.pin_memory() for _, e in loads]
        for landing in after:
            landing.order(self._loads)
        copies = [c for c, _ in loads]
        landing = self._run(self._loads, copies, entries, True, self._load_programs)
        self._inflight.append((landing, entries))
        return landing

    def hold_compute(self, landing: Landing) -> None:
        """Make the engine's own work queued from now on (the compute stream's zeroing,
        state copies and forwards) wait for `landing`: for a store whose blocks vLLM is
        about to hand to another request. On a CPU cache the engine's work runs in the
        calling thread, which waits."""
        if self.cuda:
            landing.order(torch.cuda.current_stream(self.device))
        else:
            landing.wait()

    def _run(
        self,
        stream: torch.cuda.Stream,
        copies: Sequence[EntryCopy],
        entries: Sequence[torch.Tensor],
        to_engine: bool,
        programs: int,
    ) -> Landing:
        """Run the copies on `stream`, on `programs` programs, after what the compute
        stream has queued so far: one kernel per `LAUNCH_BYTES` of copies, each launched
        as soon as its table is built, so the GPU copies while the host builds the next.
        A table that fails its checks raises after the launches before it have run: the
        caller may then drop their entries, and a load's blocks may be half written."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            for part in _launches(
                [len(c.block_ids) * self.kv.block_bytes(c.group) for c in copies]
            ):
                table = self._host_table(
                    [copies[i] for i in part], [entries[i] for i in part], to_engine
                )
                with torch.cuda.stream(stream):
                    self._copy_rows_cuda(table, self.device, programs)
        except BaseException:
            stream.synchronize()
            raise
        done = torch.cuda.Event()
        done.record(stream)
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


def _launches(sizes: Sequence[int]) -> list[range]:
    """Consecutive runs of copies of at most `LAUNCH_BYTES` each (a larger copy alone)."""
    parts, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > LAUNCH_BYTES:
            parts.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(sizes):
        parts.append(range(start, len(sizes)))
    return parts
