"""Helpers the benchmark scripts share (run as `python bench/NAME.py`, so importable)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.core.canonical import CanonicalKV, build_canonical
from hybridkv.core.copy_engine import CopyEngine
from hybridkv.core.planner import EntryCopy

RESULTS = Path(__file__).parent / "results"


def random_prompts(n: int, tokens: int, seed: int = 27) -> list[list[int]]:
    """`n` prompts of `tokens` token ids drawn from `seed`: new to every cache."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 2000) for _ in range(tokens)] for _ in range(n)]


@contextlib.contextmanager
def engine_with_redis(disk: bool = False, **llm_kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """A tiny Qwen3-Next engine in this process with hybridkv (1 GiB of CPU memory, a
    disk tier with `disk`) and a Redis tier on its own `redis-server` (allkeys-lru,
    tests/redis_servers.py): (the `LLM`, the server); all of it gone afterwards."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from redis_servers import redis_server

    from hybridkv.engine import make_llm, shutdown
    from hybridkv.models import make_model

    with (
        tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as tmp,
        redis_server("--maxmemory-policy", "allkeys-lru") as server,
    ):
        model = str(make_model("qwen3-next", Path(tmp) / "model", size="tiny"))
        extra = {"cpu_bytes": "1GiB", "redis_url": server.url}
        if disk:
            extra["disk_path"] = str(Path(tmp) / "disk")
        llm = make_llm(model, extra, **llm_kwargs)
        try:
            yield llm, server
        finally:
            shutdown(llm)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turn in every round so that drift of a
    noisy machine hits all of them alike; one warm-up round first. Each round starts one
    function later, so none always runs just after the same one (a copy right after
    another that swept the caches ran up to 50% slower)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            if r:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def write_result(result: dict[str, Any], args: Any) -> None:
    """`result` with the arguments that produced it, as JSON at `args.json`."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result | {"args": vars(args) | {"json": str(args.json)}}))
    print(f"wrote {args.json}")


@dataclass
class FakeCopies:
    """A fake KV cache, one `(blocks, page)` int8 tensor per layer as vLLM lays them out,
    its copy engine, and one step's batch of stores and of loads: `entries` entries of
    `per` random, non-contiguous blocks each, the loads into blocks the stores left alone.
    """

    caches: dict[str, torch.Tensor]
    engine: CopyEngine
    stores: list[EntryCopy]
    loads: list[EntryCopy]

    @classmethod
    def make(
        cls,
        page: int,
        layers: int,
        per: int,
        entries: int,
        device: str = "cpu",
        cuda_programs: int | None = None,
    ) -> FakeCopies:
        blocks = 2 * entries * per + 1
        gen = torch.Generator(device=device).manual_seed(0)
        caches = {
            f"l{i}": torch.randint(
                -128, 127, (blocks, page), dtype=torch.int8, device=device, generator=gen
            )
            for i in range(layers)
        }
        kv = build_canonical(caches, [[(n, page) for n in caches]], blocks)
        engine = CopyEngine(kv, cuda_programs=cuda_programs)
        order = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
        ids = order.tolist()
        slots = tuple(range(per))

        def batch(first: int) -> list[EntryCopy]:
            return [
                EntryCopy(0, e, slots, tuple(ids[(first + e) * per : (first + e + 1) * per]))
                for e in range(entries)
            ]

        return cls(caches, engine, batch(0), batch(entries))


# ---- the torch index kernels: the baseline the copy paths are measured against -------
_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _layer_rows(kv: CanonicalKV, g: int, entry: torch.Tensor, n: int):
    """(engine rows, entry rows) of each layer of group g, as the widest integer every
    page, stride and the entry align to (on int8 the kernels ran 3-5x slower)."""
    refs = kv.groups[g]
    views = [kv.tensors[r.tensor_idx] for r in refs]
    w = next(
        w
        for w in (8, 4, 2, 1)
        if entry.data_ptr() % w == 0
        and all(
            r.page_bytes % w == 0 and v.stride(0) % w == 0 and v.data_ptr() % w == 0
            for r, v in zip(refs, views, strict=True)
        )
    )
    off = 0
    for ref, view in zip(refs, views, strict=True):
        size = n * ref.page_bytes
        rows = entry[off : off + size].view(_INT[w]).view(n, ref.page_bytes // w)
        yield view[:, : ref.page_bytes].view(_INT[w]), rows
        off += size


def torch_gather(kv: CanonicalKV, g: int, block_ids: list[int], out: torch.Tensor) -> None:
    """Group g's blocks into `out` (on the cache's device), one `index_select` a layer."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=out.device)
    for engine, rows in _layer_rows(kv, g, out, len(block_ids)):
        torch.index_select(engine, 0, idx, out=rows)


def torch_scatter(kv: CanonicalKV, g: int, entry: torch.Tensor, slots, block_ids) -> None:
    """Rows `slots` of `entry` (on the cache's device) into blocks, one `index_copy_` a
    layer."""
    n = entry.numel() // kv.block_bytes(g)
    idx = torch.tensor(block_ids, dtype=torch.long, device=entry.device)
    sel = torch.tensor(slots, dtype=torch.long, device=entry.device)
    for engine, rows in _layer_rows(kv, g, entry, n):
        engine.index_copy_(0, idx, rows.index_select(0, sel))
