"""How much hybridkv's stores slow the forward when it stores every step (issue 28, goal:
at most 3 % over no stores), beside the design before it, whose compute stream waited for
each store. Needs torch, Triton and a CUDA device, not vLLM.

A fake KV cache on the GPU (`common.FakeCopies`); each step, on the compute stream, a
"forward" of `--products` bf16 matrix products of `--size`^2, the forward's writes of the
blocks the step stores, and a small "sampling" kernel; the host then waits for the step
before's sampling, as vLLM's scheduler waits for its sampled tokens (one step ahead at
most). The designs, run in turn in every round (`common.interleaved`):
- `none`: no stores;
- `hybridkv@N`: the step's stores (`CopyEngine.gather_async`, on the store stream, its
  kernel on N programs: `--copy-programs`, several for a sweep), which the compute
  stream never waits for;
- `wait-per-store`: the same stores, and the compute stream waits for each where it is
  queued (`hold_compute` right after it: what every store did before issue 28, so the
  step's sampling and the next forward came after it);
- `dma`: the same bytes as one contiguous device-to-pinned `copy_` on a side stream the
  compute stream never waits for: the copy engines' floor, using no SMs, for telling
  what a copy costs the forward through the SMs it takes from what it costs anyway.
`--loads` adds a load of the same size every step (on the load stream, on
`cuda_rows.LOAD_PROGRAMS` programs in every design: no design waits for it).
Each figure is the median seconds of `--steps` steps.

    python bench/gpu_forward_stall.py           # 64 MiB stored a step, ~11 ms forward on an H100
    python bench/gpu_forward_stall.py --loads
    python bench/gpu_forward_stall.py --copy-programs 0 4 8 16 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import RESULTS, FakeCopies, interleaved, write_result

from hybridkv.core.copy_engine import CopyEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-bytes", type=int, default=64 << 10)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks-per-entry", type=int, default=4)
    p.add_argument("--entries", type=int, default=8, help="entries stored a step")
    p.add_argument("--size", type=int, default=8192, help="side of the forward's products")
    p.add_argument("--products", type=int, default=8, help="matrix products a forward")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loads", action="store_true", help="a load of the same size each step")
    p.add_argument(
        "--copy-programs",
        type=int,
        nargs="+",
        help="programs a store batch runs on, one `hybridkv@N` design each (default: "
        "cuda_rows.STORE_PROGRAMS; 0: one per piece)",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "gpu_forward_stall.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_forward_stall: no CUDA device here; nothing measured")
        sys.exit(0)

    from hybridkv.core.cuda_rows import STORE_PROGRAMS  # Triton, which a CUDA build has

    fake = FakeCopies.make(
        args.page_bytes, args.layers, args.blocks_per_entry, args.entries, device="cuda"
    )
    engine = fake.engine
    # One store engine per program count asked for, sharing the cache and pinned pool.
    engines = {
        f"hybridkv@{n}": CopyEngine(engine.kv, engine.pool, cuda_programs=n)
        for n in args.copy_programs or [STORE_PROGRAMS]
    }
    designs = ("none", *engines, "wait-per-store", "dma")
    stored_ids = torch.tensor(sorted({b for c in fake.stores for b in c.block_ids}), device="cuda")
    to_load = list(zip(fake.loads, engine.gather(fake.stores), strict=True))
    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    stored = args.entries * args.blocks_per_entry * args.layers * args.page_bytes
    dma_src = torch.empty(stored, dtype=torch.uint8, device="cuda")
    dma_dst = torch.empty(stored, dtype=torch.uint8, pin_memory=True)
    dma_stream = torch.cuda.Stream()

    def steps(design: str) -> None:
        sampled: torch.cuda.Event | None = None
        landing = []  # stores in flight, with the entries they write (as the worker holds them)
        for step in range(args.steps):
            for _ in range(args.products):
                torch.mm(a, a, out=out)
            for cache in fake.caches.values():  # the forward writes the blocks it stores
                cache.index_fill_(0, stored_ids, step % 100)
            if design == "dma":
                dma_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(dma_stream):
                    dma_dst.copy_(dma_src, non_blocking=True)
            elif design != "none":
                store = engines.get(design, engine)
                landing = [(e, ld) for e, ld in landing if not ld.done()]
                landing.append(store.gather_async(fake.stores))
                if design == "wait-per-store":
                    engine.hold_compute(landing[-1][1])
            if args.loads:
                engine.scatter(to_load)
            out[:8, :8].argmax()  # the step's sampling
            event = torch.cuda.Event()
            event.record()
            if sampled is not None:
                sampled.synchronize()
            sampled = event
        torch.cuda.synchronize()

    t = interleaved({d: (lambda d=d: steps(d)) for d in designs}, args.repeats)
    per_step = {d: secs / args.steps for d, secs in t.items()}
    result = {
        "device": torch.cuda.get_device_name(),
        "stored_bytes_per_step": stored,
        "loads": args.loads,
        "step_seconds": per_step,
        "slowdown": {d: per_step[d] / per_step["none"] - 1 for d in designs[1:]},
    }
    print(
        f"{result['device']}: {stored / 2**20:.0f} MiB stored a step"
        f"{' and as much loaded' if args.loads else ''}, forward {args.products} bf16 "
        f"products of {args.size}^2"
    )
    for d in designs:
        slow = f"{result['slowdown'][d]:+.1%}" if d != "none" else ""
        print(f"{d:16}{per_step[d] * 1e3:9.2f} ms a step {slow:>8}")
    write_result(result, args)


if __name__ == "__main__":
    main()
