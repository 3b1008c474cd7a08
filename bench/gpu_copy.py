"""GPU <-> host through hybridkv's copy path against a pinned-memory torch copy of the same
bytes (issue 4, target 6). Needs torch, Triton and a CUDA device, not vLLM.

A fake KV cache on the GPU (`common.FakeCopies`, as bench/copy_path.py uses on the CPU);
the worker's `CopyEngine` stores (`gather`: random, non-contiguous blocks -> new pinned host
entries, device->host) and loads (`scatter`: entries -> other random blocks,
host->device) `--entries` entries per call, as one step's batch. The reference copies
the same number of bytes between one contiguous device tensor and one pinned host
tensor. Beside them, in the same rounds: the same copies with the whole batch in one
kernel launch (before `copy_engine.LAUNCH_BYTES` cut it into launches that the host
builds while the GPU copies), and the path the engine ran before its Triton row kernel:
per entry, torch index kernels (one launch a layer) into a device staging buffer and one
pinned copy. Every copy is synchronized before its clock stops. The loaded
blocks are checked against the stored ones.

    python bench/gpu_copy.py            # defaults: 32 layers x 64 KiB pages, 1 GiB a batch
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    RESULTS,
    FakeCopies,
    interleaved,
    torch_gather,
    torch_scatter,
    write_result,
)

from hybridkv.core import copy_engine
from hybridkv.core.canonical import row_table
from hybridkv.core.cuda_rows import STORE_PROGRAMS, copy_rows_cuda


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-bytes", type=int, default=64 << 10)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks-per-entry", type=int, default=16)
    p.add_argument("--entries", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--copy-programs",
        type=int,
        default=None,
        help="programs a copy batch runs on (default: cuda_rows.STORE_PROGRAMS for stores, "
        "LOAD_PROGRAMS for loads; 0: one per piece)",
    )
    p.add_argument(
        "--launch-mib",
        type=int,
        default=None,
        help="cut a batch into launches of at most this many MiB (default: "
        "copy_engine.LAUNCH_BYTES)",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "gpu_copy.json")
    args = p.parse_args()
    if args.launch_mib is not None:
        copy_engine.LAUNCH_BYTES = args.launch_mib << 20
    if not torch.cuda.is_available():
        print("gpu_copy: no CUDA device here; nothing measured")
        sys.exit(0)

    dev = torch.device("cuda")
    page, layers, per, n = args.page_bytes, args.layers, args.blocks_per_entry, args.entries
    fake = FakeCopies.make(page, layers, per, n, device="cuda", cuda_programs=args.copy_programs)
    caches, engine, stores, loads = fake.caches, fake.engine, fake.stores, fake.loads
    entries = engine.gather(stores)
    assert all(e.is_pinned() for e in entries)

    nbytes = n * per * page * layers
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    device_buf = torch.empty(nbytes, dtype=torch.int8, device=dev)

    def plain_d2h() -> None:
        host.copy_(device_buf, non_blocking=True)
        torch.cuda.synchronize()

    def plain_h2d() -> None:
        device_buf.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def store() -> None:
        engine.gather(stores)  # returns once the host entries are complete

    def load() -> None:
        engine.scatter(list(zip(loads, entries, strict=True)))
        torch.cuda.synchronize()

    def one_launch(fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` with the whole batch in one kernel launch, as before `LAUNCH_BYTES`."""

        def run() -> None:
            cut, copy_engine.LAUNCH_BYTES = copy_engine.LAUNCH_BYTES, 1 << 62
            try:
                fn()
            finally:
                copy_engine.LAUNCH_BYTES = cut

        return run

    def store_torch() -> None:
        for c, out in zip(stores, entries, strict=True):
            staged = torch.empty(out.numel(), dtype=torch.int8, device=dev)
            torch_gather(engine.kv, 0, list(c.block_ids), staged)
            out.copy_(staged, non_blocking=True)
        torch.cuda.synchronize()

    def load_torch() -> None:
        for c, entry in zip(loads, entries, strict=True):
            on_device = entry.to(dev, non_blocking=True)
            torch_scatter(engine.kv, 0, on_device, c.slots, c.block_ids)
        torch.cuda.synchronize()

    fns = {"plain_d2h": plain_d2h, "store": store, "store_torch": store_torch}
    fns |= {"plain_h2d": plain_h2d, "load": load, "load_torch": load_torch}
    fns |= {"store_one": one_launch(store), "load_one": one_launch(load)}
    t = interleaved(fns, args.repeats)
    # The kernel alone, timed on the GPU: what the copies cost beyond the host's work of
    # building the table and launching (the rest of the gap to the pinned copy).
    ids = [c.block_ids for c in stores]
    table = row_table(engine.kv, 0, entries, [range(per)] * n, ids, to_engine=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    programs = STORE_PROGRAMS if args.copy_programs is None else args.copy_programs
    copy_rows_cuda(table, dev, programs)
    start.record()
    for _ in range(args.repeats):
        copy_rows_cuda(table, dev, programs)
    end.record()
    end.synchronize()
    kernel_s = start.elapsed_time(end) / 1e3 / args.repeats
    for c, s in zip(loads, stores, strict=True):
        for cache in caches.values():
            assert torch.equal(cache[list(c.block_ids)], cache[list(s.block_ids)])

    gib = nbytes / 2**30
    result = {
        "device": torch.cuda.get_device_name(dev),
        "bytes": nbytes,
        "entry_bytes": per * page * layers,
        "gib_s": {name: gib / secs for name, secs in t.items()},
        "store_d2h_ratio": t["plain_d2h"] / t["store"],
        "load_h2d_ratio": t["plain_h2d"] / t["load"],
        "store_kernel_gib_s": nbytes / 2**30 / kernel_s,
        "store_one_d2h_ratio": t["plain_d2h"] / t["store_one"],
        "load_one_h2d_ratio": t["plain_h2d"] / t["load_one"],
        "store_torch_d2h_ratio": t["plain_d2h"] / t["store_torch"],
        "load_torch_h2d_ratio": t["plain_h2d"] / t["load_torch"],
    }
    g = result["gib_s"]
    print(
        f"{result['device']}: {n} entries of {result['entry_bytes'] / 2**20:.1f} MiB "
        f"({layers} layers, random block ids), {gib:.2f} GiB a batch"
    )
    print(f"{'':26}{'pinned torch copy':>20}{'copy path':>16}{'ratio':>8}")
    for name, plain, ours, ratio in (
        ("store (Triton rows)", "plain_d2h", "store", "store_d2h_ratio"),
        ("store (one launch)", "plain_d2h", "store_one", "store_one_d2h_ratio"),
        ("store (torch index)", "plain_d2h", "store_torch", "store_torch_d2h_ratio"),
        ("load (Triton rows)", "plain_h2d", "load", "load_h2d_ratio"),
        ("load (one launch)", "plain_h2d", "load_one", "load_one_h2d_ratio"),
        ("load (torch index)", "plain_h2d", "load_torch", "load_torch_h2d_ratio"),
    ):
        print(f"{name:26}{g[plain]:14.2f} GiB/s{g[ours]:10.2f} GiB/s{result[ratio]:7.2f}x")
    kernel = result["store_kernel_gib_s"]
    print(f"store kernel alone (GPU time): {kernel:.2f} GiB/s, {kernel / g['plain_d2h']:.2f}x")
    write_result(result, args)


if __name__ == "__main__":
    main()
