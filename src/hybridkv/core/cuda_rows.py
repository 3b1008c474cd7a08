"""Row copies on a CUDA device: the (dst, src, bytes) table the CPU path runs natively
(`canonical.row_table`, `row_copy.py`), run by one Triton kernel per launch (a batch is
one launch per `copy_engine.LAUNCH_BYTES`).

On a GPU the engine's pages are in device memory and the entries in pinned host memory,
which the GPU addresses directly (unified virtual addressing: a pinned host pointer is a
device pointer). So one kernel moves a step's copies, every layer of every entry,
straight between the cache and the entries: no staging buffer in device memory (which
vLLM has handed to the KV cache) and no per-entry or per-layer launches. The torch index
kernels did one launch per layer per entry and a synchronous upload of block ids per
entry; on an H100 they reached 0.5x a pinned copy with 32 MiB entries, 0.2x with 8 MiB
ones (docs/benchmarks.md, GPU copy).

A row is cut into pieces of up to `_PER_PROGRAM` words; a few programs (`STORE_PROGRAMS`,
`LOAD_PROGRAMS`) take the pieces in turn. The word is the widest integer that every
address and size of the table is a multiple of.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

_BLOCK = 1024  # words a loop iteration moves
_PER_PROGRAM = 4 * _BLOCK
_WARPS = 4
# Programs a batch runs on, each looping over pieces: few enough to leave the forward
# most SMs, enough to keep the PCIe link full. Measured on an H200 (docs/benchmarks.md,
# "GPU forward stall"): one program per piece (thousands) filled every SM, so a step's
# 64 MiB of stores slowed the forward beside them by 6 %, as much as if the forward had
# waited for them. Stores (the GPU writing host memory) keep full speed on 8 programs
# (0.84-0.88x a pinned copy, as on 16) and slow the forward by 1.3-1.7 % (16: 2.7-3.3 %).
# Loads (the GPU reading host memory, each read waiting its round trip) need more in
# flight: 0.63x on 8 programs, 0.85-0.87x on 16, where a request's restore waits for them.
STORE_PROGRAMS = 8
LOAD_PROGRAMS = 16
_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _copy_rows(
    table, pieces, parts, WORD: tl.constexpr, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr
):
    # Each program takes every num_programs-th piece. A `while`, not a `range` over
    # program ids: Triton 3.6's interpreter cannot make a range of its tensors under
    # NumPy >= 2.5 (it converts a one-element array to an int).
    piece = tl.program_id(0)
    while piece < pieces:
        row = piece // parts
        dst = tl.load(table + 3 * row).to(tl.pointer_type(WORD))
        src = tl.load(table + 3 * row + 1).to(tl.pointer_type(WORD))
        words = tl.load(table + 3 * row + 2)
        first = (piece % parts).to(tl.int64) * PER_PROGRAM
        for i in tl.static_range(0, PER_PROGRAM, BLOCK):
            offs = first + i + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
        piece += tl.num_programs(0)


def word_bytes(table: np.ndarray) -> int:
    """The widest word (8, 4, 2 or 1 bytes) every address and size in `table` aligns to."""
    if not len(table):
        return 8
    bits = int(np.bitwise_or.reduce(table.ravel()))
    for w in (8, 4, 2):
        if bits % w == 0:
            return w
    return 1


def copy_rows_cuda(table: np.ndarray, device: torch.device, programs: int) -> None:
    """Run `table` on the current stream of `device`, on at most `programs` programs (0:
    one per piece). Addresses may be device memory or pinned host memory; the caller has
    bounds-checked them (`row_table`) and keeps both ends alive until the stream has run
    the copy. On a CPU device (Triton's interpreter, which tests run the kernel in) the
    addresses are host memory."""
    if not len(table):
        return
    w = word_bytes(table)
    words = table.copy()
    words[:, 2] //= w
    parts = triton.cdiv(int(words[:, 2].max()), _PER_PROGRAM)
    pieces = len(words) * parts
    grid = (min(pieces, programs) if programs else pieces,)
    # Uploaded from pinned memory: the host never waits on the stream for it, and torch
    # keeps the host copy until the upload has run.
    on_device = torch.from_numpy(words)
    if device.type == "cuda":
        on_device = on_device.pin_memory().to(device, non_blocking=True)
    _copy_rows[grid](
        on_device,
        pieces,
        parts,
        WORD=_WORDS[w],
        BLOCK=_BLOCK,
        PER_PROGRAM=_PER_PROGRAM,
        num_warps=_WARPS,
    )
