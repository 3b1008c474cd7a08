"""The GPU path's Triton row kernel, run on the CPU by Triton's interpreter (CI has no
GPU): for random batches of stores and loads over every group of the fake cache and pages
of every word size, it moves exactly the bytes the native host copy moves.
(`test_copy_engine_cuda.py` runs it on a real GPU.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SEED

from hybridkv.core.cuda_rows import word_bytes

SCRIPT = r"""
import random, sys
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_canonical import NB, make_cache
from hybridkv.core.canonical import build_canonical, row_table
from hybridkv.core.cuda_rows import copy_rows_cuda
from hybridkv.core.row_copy import copy_rows

cpu = torch.device("cpu")
for seed in range(int(sys.argv[2])):
    rng = random.Random(seed)
    a, b = make_cache(seed), make_cache(seed)
    kv_a = build_canonical(a.kv_caches, a.group_layers, NB)
    kv_b = build_canonical(b.kv_caches, b.group_layers, NB)
    g = rng.randrange(3)
    n = rng.randint(1, 4)
    entries = [torch.randint(-128, 128, (n * kv_a.block_bytes(g),), dtype=torch.int8)
               for _ in range(2)]
    dst = rng.sample(range(NB), 2 * n)
    slots = [rng.sample(range(n), n), rng.sample(range(n), n)]
    ids = [dst[:n], dst[n:]]
    # load: entries -> blocks; store: blocks -> fresh entries
    copy_rows(row_table(kv_a, g, entries, slots, ids, True))
    programs = rng.choice([0, 1, 3, 16])  # one per piece, or a few looping over them
    copy_rows_cuda(row_table(kv_b, g, entries, slots, ids, True), cpu, programs)
    assert torch.equal(a.buf, b.buf), ("load", seed)
    src = rng.sample(range(NB), n)
    outs = [torch.zeros(n * kv_a.block_bytes(g), dtype=torch.int8) for _ in range(2)]
    copy_rows(row_table(kv_a, g, outs[:1], [range(n)], [src], False))
    copy_rows_cuda(row_table(kv_b, g, outs[1:], [range(n)], [src], False), cpu, programs)
    assert torch.equal(outs[0], outs[1]), ("store", seed)
print("ok")
"""


def _interpreted(script: str, *args: str) -> None:
    """Run `script` in a new interpreter with Triton's interpreter on (it must be set
    before Triton is imported); it prints "ok" when its checks hold. NumPy's warning for
    an array taken as an int is an error there, as it is from NumPy 2.5 on: Triton 3.6's
    interpreter, on the lent GPU machine, failed the kernel's old `range` over program
    ids that way."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=os.environ
        | {
            "TRITON_INTERPRET": "1",
            "PYTHONWARNINGS": "error:Conversion of an array with ndim:DeprecationWarning",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_the_triton_row_kernel_moves_what_the_native_copy_moves():
    _interpreted(SCRIPT, str(Path(__file__).parent), "12")


LONG_ROWS = r"""
import random, sys
import numpy as np, torch
from hybridkv.core.cuda_rows import _PER_PROGRAM, copy_rows_cuda

rng = random.Random(int(sys.argv[1]))
# Rows of up to four pieces, the last one partial, in a table of 8-byte words.
sizes = [8 * rng.randint(1, 4 * _PER_PROGRAM) for _ in range(5)]
src = [torch.randint(-128, 128, (n,), dtype=torch.int8) for n in sizes]
for programs in (0, 1, 3):
    dst = [torch.zeros(n, dtype=torch.int8) for n in sizes]
    table = np.array([[d.data_ptr(), s.data_ptr(), n] for d, s, n in zip(dst, src, sizes)])
    copy_rows_cuda(table, torch.device("cpu"), programs)
    assert all(torch.equal(d, s) for d, s in zip(dst, src)), (programs, sizes)
print("ok")
"""


def test_rows_of_several_pieces_are_copied_whole_by_any_number_of_programs():
    print(f"row sizes drawn with seed {SEED}")
    _interpreted(LONG_ROWS, str(SEED))


@pytest.mark.parametrize(
    ("rows", "word"),
    [
        ([[4096, 8192, 512]], 8),
        ([[4096, 8192, 512], [4100, 8196, 300]], 4),
        ([[4096, 8192, 302]], 2),
        ([[4096, 8193, 512]], 1),
        ([], 8),
    ],
)
def test_the_word_is_the_widest_every_address_and_size_aligns_to(rows, word):
    assert word_bytes(np.array(rows, dtype=np.int64).reshape(-1, 3)) == word
