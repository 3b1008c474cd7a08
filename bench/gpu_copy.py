"""GPU <-> host through hybridkv's copy path against a pinned-memory torch copy of the same
bytes (issue 4, target 6). Needs only torch and a CUDA device, not vLLM.

A fake KV cache on the GPU (`common.FakeCopies`, as bench/copy_path.py uses on the CPU);
the worker's `CopyEngine` stores (`gather`: random, non-contiguous blocks -> new pinned host
entries, device->host) and loads (`scatter`: entries -> other random blocks,
host->device) `--entries` entries per call, as one step's batch. The reference copies
the same number of bytes between one contiguous device tensor and one pinned host
tensor. Every copy is synchronized before its clock stops. The loaded blocks are checked
against the stored ones.

    python bench/gpu_copy.py            # defaults: 32 layers x 64 KiB pages, 1 GiB a batch
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import RESULTS, FakeCopies, interleaved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-bytes", type=int, default=64 << 10)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks-per-entry", type=int, default=16)
    p.add_argument("--entries", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path, default=RESULTS / "gpu_copy.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_copy: no CUDA device here; nothing measured")
        sys.exit(0)

    dev = torch.device("cuda")
    page, layers, per, n = args.page_bytes, args.layers, args.blocks_per_entry, args.entries
    fake = FakeCopies.make(page, layers, per, n, device="cuda")
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

    t = interleaved(
        {"plain_d2h": plain_d2h, "store": store, "plain_h2d": plain_h2d, "load": load},
        args.repeats,
    )
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
    }
    g = result["gib_s"]
    print(
        f"{result['device']}: {n} entries of {result['entry_bytes'] / 2**20:.1f} MiB "
        f"({layers} layers, random block ids), {gib:.2f} GiB a batch"
    )
    print(f"{'':14}{'pinned torch copy':>20}{'hybridkv':>12}{'ratio':>8}")
    for name, plain, ours, ratio in (
        ("device->host", "plain_d2h", "store", "store_d2h_ratio"),
        ("host->device", "plain_h2d", "load", "load_h2d_ratio"),
    ):
        print(f"{name:14}{g[plain]:14.2f} GiB/s{g[ours]:6.2f} GiB/s{result[ratio]:7.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result | {"args": vars(args) | {"json": str(args.json)}}))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
