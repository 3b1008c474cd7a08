"""Scheduler-side lookup cost per chunk for a long prompt (issue 4: "well under a
millisecond per chunk" at 32k tokens).

What `get_num_new_matched_tokens` does, with the same core pieces and no vLLM: chain keys
over the prompt, the hit rule (`Planner.find_hit`, asking the store per group and chunk),
and fetching every entry of the hit (`TieredStore.get_many`). The layout is Qwen3-Next's
shape (one full-attention group, three recurrent-state groups, 256-token chunks) with
small entries, so the figures are the bookkeeping, not the bytes. Cases: nothing stored;
a full hit in the CPU tier; a full hit on disk known to the index; a full hit on disk
after a restart (index rebuilt by scan).

    .venv/bin/python bench/lookup.py --prompt-tokens 32768
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import RESULTS

from hybridkv.core.keys import chain_seed, chunk_keys, group_key
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.store import TieredStore
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.core.tiers.memory import MemoryTier

BLOCK = 256


def layout() -> Layout:
    full = GroupSpec(GroupKind.FULL, BLOCK, 1024, ("attn.3",))
    states = [GroupSpec(GroupKind.STATE, BLOCK, 512, (f"gdn.{i}",)) for i in range(3)]
    return Layout("bench/lookup", (full, *states))


def lookup(planner: Planner, store: TieredStore, seed: bytes, prompt: list[int]) -> int:
    keys = chunk_keys(seed, prompt, planner.chunk_tokens)

    def present(g: int, c: int) -> bool:
        return c < len(keys) and store.contains(group_key(keys[c], g))

    boundary = planner.find_hit(len(prompt), 0, present)
    if boundary:
        wanted = [
            group_key(keys[c], g)
            for g in range(len(planner.groups))
            for c in planner.needed_chunks(g, 0, boundary)
        ]
        assert len(store.get_many(wanted)) == len(wanted)
    return boundary


def fill(planner: Planner, store: TieredStore, seed: bytes, prompt: list[int]) -> None:
    """Every full-attention chunk and the state at the best boundary, as a cold run stores."""
    keys = chunk_keys(seed, prompt, planner.chunk_tokens)
    best = planner.max_hit_chunks(len(prompt))
    for g, spec in enumerate(planner.groups):
        chunks = range(best) if spec.kind is GroupKind.FULL else [best - 1]
        for c in chunks:
            store.put(group_key(keys[c], g), torch.zeros(planner.entry_bytes(g), dtype=torch.int8))
    store.flush()


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=RESULTS / "lookup.json")
    args = p.parse_args()

    lay = layout()
    planner = Planner(lay.groups)
    seed = chain_seed(lay.fingerprint, None)
    rng = random.Random(3)
    prompt = [rng.randrange(1, 150000) for _ in range(args.prompt_tokens)]
    chunks = args.prompt_tokens // planner.chunk_tokens
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as d:

        def disk_tier() -> DiskTier:
            return DiskTier(d, lay.fingerprint, lay.describe(), 1 << 30)

        cpu = TieredStore([MemoryTier(1 << 30)])
        results["miss (nothing stored)"] = timed(
            lambda: lookup(planner, cpu, seed, prompt), args.repeats
        )
        fill(planner, cpu, seed, prompt)
        results["hit, CPU tier"] = timed(lambda: lookup(planner, cpu, seed, prompt), args.repeats)

        disk = TieredStore([disk_tier()])
        fill(planner, disk, seed, prompt)
        results["hit, disk (indexed)"] = timed(
            lambda: lookup(planner, disk, seed, prompt), args.repeats
        )
        disk.close()

        def restarted() -> None:
            store = TieredStore([disk_tier()])
            try:
                assert lookup(planner, store, seed, prompt) > 0
            finally:
                store.close()

        results["hit, disk, fresh process (incl. index scan)"] = timed(restarted, args.repeats)
        hashing = timed(lambda: chunk_keys(seed, prompt, planner.chunk_tokens), args.repeats)
        results["of which: chain keys"] = hashing

    print(f"lookup of a {args.prompt_tokens}-token prompt ({chunks} chunks, 4 groups)")
    print(f"{'':46}{'total ms':>10}{'us/chunk':>10}")
    for name, secs in results.items():
        print(f"{name:46}{secs * 1e3:10.2f}{secs * 1e6 / chunks:10.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"prompt_tokens": args.prompt_tokens, "seconds": results}, indent=2)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
