"""One small store and load through the CUDA copy path, for compute-sanitizer
(`bench/gpu_checks.sh` runs it under memcheck, racecheck and synccheck).

The CUDA tests and the step-order harness keep the compute stream busy with large matrix
products, which a sanitizer slows by orders of magnitude: under racecheck one harness
case gave no result in 355 s and 377 s on an H200 (docs/benchmarks.md). This is the copy
kernel alone on a few small entries: stores on `cuda_rows.STORE_PROGRAMS` programs,
loads on `LOAD_PROGRAMS`, a batch with rows of several pieces, and every loaded block
checked against what was stored. Prints "ok". Needs torch, Triton and a CUDA device.

    compute-sanitizer --tool memcheck python bench/gpu_sanitize.py
"""

from __future__ import annotations

import sys

import torch
from common import FakeCopies


def main() -> None:
    if not torch.cuda.is_available():
        print("gpu_sanitize: no CUDA device here; nothing checked")
        sys.exit(0)
    # 4 entries of 2 blocks x 3 layers; a 48 KiB row is two pieces (32 KiB at most each).
    for page in (4 << 10, 48 << 10):
        fake = FakeCopies.make(page, 3, 2, 4, device="cuda")
        stored = fake.engine.gather(fake.stores)
        fake.engine.scatter(list(zip(fake.loads, stored, strict=True))).wait()
        torch.cuda.synchronize()
        for load, store in zip(fake.loads, fake.stores, strict=True):
            for cache in fake.caches.values():
                assert torch.equal(cache[list(load.block_ids)], cache[list(store.block_ids)])
    print("ok")


if __name__ == "__main__":
    main()
