"""Where a GPU copy batch's time goes when it is one kernel launch: the host's parts
(pool entries, row table, upload and launch) against the copy on the GPU. Needs torch,
Triton and a CUDA device, not vLLM.

The same 1 GiB store and load batches as `bench/gpu_copy.py` (32 entries of 16 blocks x
32 layers x 64 KiB, random block ids), each part timed on the host clock, the kernel
(with its table's upload) by CUDA events on the copy's stream, and a pinned `copy_` of
the same bytes beside it in every round; 12 rounds, the first 2 dropped, medians. Then
the store's kernel alone at several program counts. This is what showed a batch's host
work (about 1.8 ms on an H200) running before its copy began, which is why
`copy_engine.LAUNCH_BYTES` now cuts a batch into launches (docs/benchmarks.md).

    python bench/gpu_copy_parts.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from common import FakeCopies

ROUNDS, DROPPED = 12, 2


def main() -> None:
    if not torch.cuda.is_available():
        print("gpu_copy_parts: no CUDA device here; nothing measured")
        sys.exit(0)
    from hybridkv.core.cuda_rows import LOAD_PROGRAMS, STORE_PROGRAMS, copy_rows_cuda

    dev = torch.device("cuda")
    fake = FakeCopies.make(64 << 10, 32, 16, 32, device="cuda")
    eng = fake.engine
    entries = eng.gather(fake.stores)
    nbytes = sum(e.numel() for e in entries)
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.int8, device=dev)
    torch.cuda.synchronize()
    parts: dict[str, list[float]] = {}

    def note(name: str, ms: float) -> None:
        parts.setdefault(name, []).append(ms)

    def clock(name: str, fn) -> None:
        t = time.perf_counter()
        fn()
        note(name, (time.perf_counter() - t) * 1e3)

    def kernel(stream: torch.cuda.Stream, table, programs: int, prefix: str) -> None:
        """Launch on `stream`, then wait: host time of each, GPU time between events."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            start.record()
            copy_rows_cuda(table, dev, programs)
            end.record()
        t1 = time.perf_counter()
        end.synchronize()
        t2 = time.perf_counter()
        note(f"{prefix}launch", (t1 - t0) * 1e3)
        note(f"{prefix}wait", (t2 - t1) * 1e3)
        note(f"{prefix}gpu", start.elapsed_time(end))

    def sizes() -> list[int]:
        return [len(c.block_ids) * eng.kv.block_bytes(c.group) for c in fake.stores]

    for _ in range(ROUNDS):
        clock(
            "store: pinned copy_",
            lambda: (host.copy_(on_device, non_blocking=True), torch.cuda.synchronize()),
        )
        begun = t = time.perf_counter()
        outs = [eng.pool.empty(n) for n in sizes()]
        note("store: pool entries", (time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        table = eng._host_table(fake.stores, outs, to_engine=False)
        note("store: row table", (time.perf_counter() - t) * 1e3)
        eng._stores.wait_stream(torch.cuda.current_stream(dev))
        kernel(eng._stores, table, STORE_PROGRAMS, "store: ")
        note("store: all, host clock", (time.perf_counter() - begun) * 1e3)
        del outs
        clock(
            "load: pinned copy_",
            lambda: (on_device.copy_(host, non_blocking=True), torch.cuda.synchronize()),
        )
        begun = t = time.perf_counter()
        table = eng._host_table(fake.loads, entries, to_engine=True)
        note("load: row table", (time.perf_counter() - t) * 1e3)
        kernel(eng._loads, table, LOAD_PROGRAMS, "load: ")
        note("load: all, host clock", (time.perf_counter() - begun) * 1e3)
    for name, v in parts.items():
        v = v[DROPPED:]
        print(
            f"{name:22} median {statistics.median(v):7.3f} ms  min {min(v):7.3f}  max {max(v):7.3f}"
        )

    table = eng._host_table(fake.stores, [eng.pool.empty(n) for n in sizes()], to_engine=False)
    for programs in (STORE_PROGRAMS, 16, 32, 0):
        gpu: list[float] = []
        for _ in range(8):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy_rows_cuda(table, dev, programs)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        ms = statistics.median(gpu[DROPPED:])
        print(
            f"store kernel alone, {programs} programs (0: one a piece): {ms:.3f} ms, "
            f"{nbytes / 2**30 / (ms / 1e3):.2f} GiB/s"
        )


if __name__ == "__main__":
    main()
