"""Copy-path throughput against plain copies of the same bytes (issue 4, target 3).

CPU tier: the worker's `CopyEngine` storing (engine blocks -> new host entries) and
loading (entries -> engine blocks) over random, non-contiguous block ids of a canonical
KV cache, one batch of entries per call as in a step, against `torch` copying the same
number of bytes between two preallocated contiguous tensors. Beside them, in the same
rounds: the same copies through torch's index kernels (what the CPU path ran before the
native row copy, and the GPU path before its Triton kernel), and the native row copy on
one thread with cached against streamed (non-temporal) stores.

Disk tier: `DiskTier.get` (read + verify) of every entry file against a plain sequential
read of the same files (`readinto` a preallocated buffer), each with the files dropped
from the page cache first (`posix_fadvise(DONTNEED)`, which needs no privileges; the
device may still cache) and with them cached; `get_many` also with `direct_io` (O_DIRECT,
past the page cache).

    .venv/bin/python bench/copy_path.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from common import RESULTS, FakeCopies, interleaved, torch_gather, torch_scatter

from hybridkv import _rowcopy
from hybridkv.core.canonical import row_table
from hybridkv.core.host_pool import HostPool
from hybridkv.core.keys import group_key
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.engine import drop_page_cache


def cpu_tier(args: argparse.Namespace) -> dict:
    """Store and load `--entries` entries of `--blocks-per-entry` random blocks each, as the
    connector does per (group, chunk), against one plain copy of the same total bytes."""
    page, layers, per = args.page_bytes, args.layers, args.blocks_per_entry
    fake = FakeCopies.make(page, layers, per, args.entries)
    engine, stores, loads = fake.engine, fake.stores, fake.loads
    entries = engine.gather(stores)
    nbytes = args.entries * per * page * layers
    src_plain = torch.randint(-128, 127, (nbytes,), dtype=torch.int8)
    dst_plain = torch.empty_like(src_plain)

    def store() -> None:
        engine.gather(stores)

    def load() -> None:
        engine.scatter(list(zip(loads, entries, strict=True)))

    def store_torch() -> None:
        for c, out in zip(stores, entries, strict=True):
            torch_gather(engine.kv, 0, list(c.block_ids), out)

    def load_torch() -> None:
        for c, entry in zip(loads, entries, strict=True):
            torch_scatter(engine.kv, 0, entry, c.slots, c.block_ids)

    load_table = row_table(
        engine.kv, 0, entries, [c.slots for c in loads], [c.block_ids for c in loads], True
    )
    fns = {
        "plain": lambda: dst_plain.copy_(src_plain),
        "store": store,
        "load": load,
        "store_torch": store_torch,
        "load_torch": load_torch,
        "load_1thread_cached": lambda: _rowcopy.copy(load_table, False),
        "load_1thread_streamed": lambda: _rowcopy.copy(load_table, True),
    }
    t = interleaved(fns, args.repeats)
    gib = nbytes / 2**30
    out = {"bytes": nbytes, "entry_bytes": per * page * layers, "threads": torch.get_num_threads()}
    out |= {f"{name}_gib_s": gib / secs for name, secs in t.items()}
    out |= {f"{name}_ratio": t["plain"] / secs for name, secs in t.items() if name != "plain"}
    for path in ("", "_torch"):
        out[f"store_load{path}_ratio"] = 2 * t["plain"] / (t[f"store{path}"] + t[f"load{path}"])
    return out


def disk_tier(args: argparse.Namespace, root: Path) -> dict:
    fp = bytes(range(16))
    pool = HostPool(pin=False)  # reads land in recycled host memory, as in the engine
    tier = DiskTier(
        root, fp, {"bench": "copy_path"}, 1 << 40, queue_bytes=1 << 40, alloc=pool.empty
    )
    # The same files read past the page cache (`disk_direct_io`).
    direct = DiskTier(root, fp, {"bench": "copy_path"}, 1 << 40, direct_io=True, alloc=pool.empty)
    keys = [group_key(i.to_bytes(16, "big"), 0) for i in range(args.files)]
    entry = torch.randint(-128, 127, (args.file_bytes,), dtype=torch.int8)
    for k in keys:
        tier.put(k, entry)
    tier.flush()
    paths = [tier.path_of(k) for k in keys]
    os.sync()
    buf = torch.empty(max(p.stat().st_size for p in paths), dtype=torch.int8)
    view = memoryview(buf.numpy())

    def plain() -> None:
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.readinto(view)

    def one_by_one() -> None:
        for k in keys:
            assert tier.get(k) is not None

    def batched(tier: DiskTier = tier) -> None:  # as a hit reads: `get_many`, in parallel
        assert all(e is not None for e in tier.get_many(keys))

    out = {"files": args.files, "file_bytes": args.file_bytes}
    gib = sum(p.stat().st_size for p in paths) / 2**30
    for label, drop in (("uncached", True), ("cached", False)):

        def cold(fn: Callable[[], None], drop: bool = drop) -> Callable[[], None]:
            return (lambda: (drop_page_cache(paths), fn())) if drop else fn

        fns = {
            "plain": cold(plain),
            "get": cold(one_by_one),
            "get_many": cold(batched),
            "get_many_direct": cold(lambda: batched(direct)),
        }
        t = interleaved(fns, args.repeats)
        out[label] = {f"{name}_gib_s": gib / secs for name, secs in t.items()}
        out[label] |= {f"{name}_ratio": t["plain"] / t[name] for name in fns if name != "plain"}
    out["direct_io"] = direct.direct_io  # False where the filesystem refused O_DIRECT
    tier.close()
    direct.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-bytes", type=int, default=32 << 10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks-per-entry", type=int, default=16)
    p.add_argument("--entries", type=int, default=64)
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--file-bytes", type=int, default=4 << 20)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dir", help="directory for the disk files (default: a temporary one)")
    p.add_argument("--json", type=Path, default=RESULTS / "copy_path.json")
    args = p.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    cpu = cpu_tier(args)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hybridkv-bench-") as d:
        disk = disk_tier(args, Path(d))
    print(
        f"CPU tier: {args.entries} entries of {cpu['entry_bytes'] / 2**20:.1f} MiB, "
        "random block ids"
    )
    print(f"  plain torch copy ({cpu['threads']} threads)  {cpu['plain_gib_s']:6.2f} GiB/s")
    for name, label in (
        ("store", "store (gather)"),
        ("load", "load (scatter)"),
        ("store_torch", "store, torch index kernels"),
        ("load_torch", "load, torch index kernels"),
        ("load_1thread_cached", "load, 1 thread, cached stores"),
        ("load_1thread_streamed", "load, 1 thread, streamed stores"),
    ):
        print(f"  {label:32} {cpu[f'{name}_gib_s']:6.2f} GiB/s  {cpu[f'{name}_ratio']:.2f}x plain")
    print(
        f"  store + load                     {cpu['store_load_ratio']:.2f}x plain "
        f"(torch index kernels {cpu['store_load_torch_ratio']:.2f}x)"
    )
    print(f"disk tier: {disk['files']} files of {disk['file_bytes'] / 2**20:.1f} MiB")
    for label in ("uncached", "cached"):
        d = disk[label]
        print(
            f"  {label:9} plain sequential read {d['plain_gib_s']:5.2f} GiB/s | get "
            f"{d['get_gib_s']:5.2f} GiB/s {d['get_ratio']:.2f}x | get_many "
            f"{d['get_many_gib_s']:5.2f} GiB/s {d['get_many_ratio']:.2f}x | get_many with "
            f"direct_io={disk['direct_io']} {d['get_many_direct_gib_s']:5.2f} GiB/s "
            f"{d['get_many_direct_ratio']:.2f}x"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"cpu_tier": cpu, "disk_tier": disk, "args": vars(args) | {"json": str(args.json)}},
            indent=2,
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
