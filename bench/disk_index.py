"""How long the disk tier takes to rebuild its index at start, and to answer `contains`.

Writes `--files` entry files of `--entry-bytes` payload each straight through the file
format (`write_entry`, under the names DiskTier uses, with DiskTier-style fan-out), then:

- constructs a fresh DiskTier on the directory `--repeats` times (scan + index + writability
  probe + start of the writer threads) and reports min and median, and times `rescan()`
  (the directory scan and index rebuild alone) in each;
- times `contains` per call for keys in the index and for absent keys (one `stat` each);
- measures the memory a worker's DiskTier holds per entry (`memory_per_entry`): built by
  scanning the files (a restart), and after writing `--writes` entries itself (a running
  engine, which also remembers the file it renamed into place for each).

Prints a table and writes JSON (default bench/results/disk_index.json). Entry files that
already exist with the right size are reused, so a second run on the same --dir is fast.

    .venv/bin/python bench/disk_index.py --files 100000 --entry-bytes 4096
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from hybridkv.core.keys import KEY_BYTES, group_key
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.core.tiers.entry_file import HEADER_BYTES, write_entry

FINGERPRINT = bytes.fromhex("b3c1d2e4f5a6978899aabbccddeeff00")
DESCRIPTION = {"bench": "disk_index"}


def bench_key(i: int) -> bytes:
    """Keys spread evenly over the 256 fan-out directories, like real blake3 keys."""
    chunk = (i * 0x9E3779B97F4A7C15 % (1 << 64)).to_bytes(8, "big") + i.to_bytes(8, "big")
    assert len(chunk) == KEY_BYTES
    return group_key(chunk, i % 3)


def populate(layout_dir: Path, n: int, entry_bytes: int) -> tuple[int, float]:
    """Write the entry files that are missing; returns (files written, seconds)."""
    entry = torch.randint(-128, 128, (entry_bytes,), dtype=torch.int8)
    size = HEADER_BYTES + entry_bytes
    for sub in range(256):
        (layout_dir / f"{sub:02x}").mkdir(parents=True, exist_ok=True)
    written = 0
    start = time.perf_counter()
    for i in range(n):
        k = bench_key(i)
        name = k.hex()
        path = layout_dir / name[:2] / f"{name}.kv"
        try:
            if path.stat().st_size == size:
                continue
        except FileNotFoundError:
            pass
        with open(path, "wb") as f:
            write_entry(f, FINGERPRINT, k, entry)
        written += 1
    return written, time.perf_counter() - start


def time_startups(root: Path, repeats: int, expect: int) -> tuple[list[float], list[float]]:
    """Seconds to construct a DiskTier, and to rescan() in an existing one (the scan alone)."""
    startups, rescans = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        tier = DiskTier(root, FINGERPRINT, DESCRIPTION, 1 << 62)
        startups.append(time.perf_counter() - start)
        start = time.perf_counter()
        tier.rescan()
        rescans.append(time.perf_counter() - start)
        entries = tier.stats().entries
        tier.close()
        if entries != expect:
            sys.exit(f"index holds {entries} entries, expected {expect}")
    return startups, rescans


def summary(times: list[float]) -> dict:
    return {
        "min": round(min(times), 4),
        "median": round(statistics.median(times), 4),
        "all": [round(t, 4) for t in times],
    }


def time_contains(root: Path, n_files: int, calls: int) -> dict[str, float]:
    """µs per call: keys in the index, and keys with no file (each costs a stat)."""
    tier = DiskTier(root, FINGERPRINT, DESCRIPTION, 1 << 62)
    try:
        present = [bench_key(i * 7919 % n_files) for i in range(calls)]
        absent = [bench_key(n_files + i) for i in range(calls)]
        out = {}
        for name, keys, want in (("present", present, True), ("absent", absent, False)):
            start = time.perf_counter()
            found = [tier.contains(k) for k in keys]
            out[name] = (time.perf_counter() - start) / calls * 1e6
            if any(f != want for f in found):
                sys.exit(f"contains() gave a wrong answer for {name} keys")
        return out
    finally:
        tier.close()


def held_per_entry(build: Callable[[], DiskTier], entries: int, traced: bool) -> dict:
    """Bytes per entry the tier `build` returns holds once built, in this process (run it
    in a fresh one: memory freed by earlier work would be reused): with `traced`,
    tracemalloc's count of what is still allocated of what was allocated meanwhile, and
    the five allocation sites holding the most; without, the growth of resident memory,
    which adds what the allocator keeps of memory freed meanwhile (such as a directory
    scan's), and which tracemalloc's own tables would inflate.

    Left out of the traced count: allocations made in pathlib, which are transient here
    (the tier keeps no paths) but include the interpreter's table of interned strings.
    pathlib interns every file name it parses, and that table, which holds every interned
    string of the process (vLLM's and torch's identifiers), is reallocated whole when it
    grows: whichever call grows it would be charged with all of it (769 B an entry in a
    first run of 5,000 writes, which keep no name alive)."""
    gc.collect()
    if not traced:
        proc = psutil.Process()
        rss = proc.memory_info().rss
        tier = build()
        gc.collect()
        grown = proc.memory_info().rss - rss
        tier.close()
        return {"rss_bytes_per_entry": round(grown / entries, 1)}
    tracemalloc.start()
    try:
        tier = build()
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    tier.close()
    stats = snapshot.filter_traces([tracemalloc.Filter(False, pathlib.__file__)]).statistics(
        "lineno"
    )
    return {
        "traced_bytes_per_entry": round(sum(st.size for st in stats) / entries, 1),
        "top_sites": [f"{st.traceback[0]}: {st.size / entries:.1f} B/entry" for st in stats[:5]],
    }


def build_tier(root: Path, how: str, writes: int, entry_bytes: int) -> Callable[[], DiskTier]:
    """A tier built on the files under `root` ("scanned"), or a new one in a directory of
    its own that writes `writes` entries, watched as the worker watches it (its journal
    of changes drained every 64 puts, as each step's report drains it)."""
    if how == "scanned":
        return lambda: DiskTier(root, FINGERPRINT, DESCRIPTION, 1 << 62)
    entry = torch.zeros(entry_bytes, dtype=torch.int8)

    def write() -> DiskTier:
        shutil.rmtree(root / "writes", ignore_errors=True)
        tier = DiskTier(root / "writes", FINGERPRINT, DESCRIPTION, 1 << 62)
        tier.take_changes()  # from now on it journals what comes and goes
        for i in range(writes):
            tier.put(bench_key(i), entry)
            if i % 64 == 63:
                tier.take_changes()
        tier.flush()
        tier.take_changes()
        return tier

    return write


def memory_per_entry(root: Path, files: int, writes: int, entry_bytes: int) -> dict[str, dict]:
    """What a worker's disk tier holds per entry (`held_per_entry`), each figure from a
    fresh process: built on `files` existing files, and after writing `writes` entries."""
    out: dict[str, dict] = {}
    for how, entries in (("scanned", files), ("written", writes)):
        out[how] = {"entries": entries}
        for traced in (False, True):
            argv = [sys.executable, __file__, "--memory-child", how, "--dir", str(root)]
            argv += ["--files", str(files), "--writes", str(writes)]
            argv += ["--entry-bytes", str(entry_bytes)] + (["--traced"] if traced else [])
            child = subprocess.run(argv, capture_output=True, text=True, check=True)
            out[how].update(json.loads(child.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--entry-bytes", type=int, default=4096)
    p.add_argument("--dir", type=Path, default=None, help="default: a new temporary directory")
    p.add_argument("--repeats", type=int, default=5, help="tier constructions to time")
    p.add_argument("--calls", type=int, default=20_000, help="contains() calls per kind")
    p.add_argument("--writes", type=int, default=20_000, help="entries put for the memory figure")
    p.add_argument("--memory-child", choices=["scanned", "written"], help=argparse.SUPPRESS)
    p.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results/disk_index.json")
    args = p.parse_args()
    if args.memory_child:  # one figure of `memory_per_entry`, as a line of JSON
        entries = args.files if args.memory_child == "scanned" else args.writes
        build = build_tier(args.dir, args.memory_child, args.writes, args.entry_bytes)
        print(json.dumps(held_per_entry(build, entries, args.traced)))
        return

    root = args.dir or Path(tempfile.mkdtemp(prefix="hybridkv-bench-"))
    layout_dir = root / FINGERPRINT.hex()
    try:
        written, write_s = populate(layout_dir, args.files, args.entry_bytes)
        # Only our files count, whatever else --dir holds under this fingerprint.
        on_disk = sum(1 for sub in layout_dir.iterdir() if sub.is_dir() for _ in sub.iterdir())
        if on_disk != args.files:
            sys.exit(f"{layout_dir} holds {on_disk} files, expected {args.files}; use a new --dir")
        startups, rescans = time_startups(root, args.repeats, args.files)
        contains_us = time_contains(root, args.files, min(args.calls, args.files))
        memory = memory_per_entry(root, args.files, args.writes, args.entry_bytes)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    result = {
        "files": args.files,
        "entry_bytes": args.entry_bytes,
        "file_bytes": HEADER_BYTES + args.entry_bytes,
        "files_written": written,
        "write_seconds": round(write_s, 3),
        "startup_seconds": summary(startups),
        "rescan_seconds": summary(rescans),
        "startup_us_per_file": round(min(startups) / args.files * 1e6, 3),
        "contains_us_per_call": {k: round(v, 3) for k, v in contains_us.items()},
        "memory": memory,
        "dir": str(root),
        "dir_removed": args.dir is None,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
    }
    rows = [
        ("files", f"{args.files:,} x {HEADER_BYTES + args.entry_bytes:,} B"),
        ("populate (written / s)", f"{written:,} / {write_s:.2f} s"),
        ("startup min", f"{min(startups) * 1e3:.1f} ms"),
        ("startup median", f"{statistics.median(startups) * 1e3:.1f} ms"),
        ("startup per file", f"{result['startup_us_per_file']:.2f} µs"),
        (
            "rescan min / median",
            f"{min(rescans) * 1e3:.1f} / {statistics.median(rescans) * 1e3:.1f} ms",
        ),
        ("contains, present", f"{contains_us['present']:.2f} µs/call"),
        ("contains, absent", f"{contains_us['absent']:.2f} µs/call"),
        *(
            (
                f"memory, {how} ({m['entries']:,})",
                f"{m['traced_bytes_per_entry']:.0f} B/entry traced, "
                f"{m['rss_bytes_per_entry']:.0f} resident",
            )
            for how, m in memory.items()
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for how, m in memory.items():
        print(f"where the {how} tier's memory is:", *m["top_sites"], sep="\n  ")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
