"""Time to first token: cold, vLLM's own prefix hit, restored by hybridkv (CPU, disk, and
disk after a restart), side by side on one engine (issue 4, targets 1, 2 and 5).

For each of `--repeats` fresh prompts, in one engine process:
  cold       the prompt computed from scratch (hybridkv stores it to CPU and disk)
  native     the same prompt again: vLLM's own in-memory prefix cache serves it
  cpu        vLLM's prefix cache emptied: hybridkv restores from its CPU tier
  disk       CPU tier emptied as well: hybridkv restores from disk (page cache warm)
Then a new engine process on the same `disk_path` (a restart) times, per prompt:
  restart    restored from disk by the fresh engine
  native     the same prompt again in that engine (its own prefix hit), the reference
TTFT is the wall time of a one-token greedy `generate`. Figures are medians over the
repeats; every ratio is taken against the native hit measured in the same process.

    .venv/bin/python bench/ttft.py                          # qwen3-next small, 8k tokens
    .venv/bin/python bench/ttft.py --arch gemma3            # sliding window: bytes loaded
    .venv/bin/python bench/ttft.py --tp 2                   # two ranks, `mp` executor

With `--tp` > 1 the workers run in processes of their own (one core each on a 2-core
machine): the `disk` mode, which empties the CPU tier from inside the worker, is left
out; `restart` still times a restore from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(1, 30000) for _ in range(length)] for _ in range(n)]


def start_engine(args: argparse.Namespace):
    from hybridkv.engine import make_llm
    from hybridkv.models import default_model_dir, make_model

    model = make_model(args.arch, args.model or default_model_dir(args.arch, args.size), args.size)
    extra = {"cpu_bytes": args.cpu_bytes, "disk_path": args.disk_path, "disk_bytes": "64GiB"}
    room = args.prompt_tokens + 64
    parallel = {}
    if args.tp > 1:
        parallel = {"tensor_parallel_size": args.tp, "distributed_executor_backend": "mp"}
        cores = os.cpu_count() or args.tp
        per = max(cores // args.tp, 1)
        binds = [f"{r * per}-{r * per + per - 1}" if per > 1 else str(r) for r in range(args.tp)]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(binds))
    return make_llm(
        str(model),
        extra,
        kv_cache_bytes=args.kv_cache_bytes,
        max_model_len=room,
        max_num_batched_tokens=room,
        **parallel,
    )


def timed(llm, prompt: list[int]) -> tuple[float, int]:
    from hybridkv.engine import generate

    t = time.perf_counter()
    out = generate(llm, [prompt], max_tokens=1)[0]
    return time.perf_counter() - t, out.num_cached_tokens


def loaded_bytes(llm) -> int:
    """Bytes the in-process worker wrote into the KV cache (0 with workers elsewhere)."""
    from hybridkv.engine import worker_connector

    if llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend != "uni":
        return 0
    return worker_connector().worker_side.stats.loaded_bytes


def run(args: argparse.Namespace, modes: list[str]) -> dict:
    """Time `modes` for every prompt in this process; the first mode must be a cold one."""
    from hybridkv.engine import drop_cpu_tier, generate, scheduler_connector, sync_tiers

    llm = start_engine(args)
    layout = scheduler_connector(llm).scheduler_side.layout
    generate(llm, prompts(1, 64), max_tokens=1)  # warm-up: first-request compilation
    times: dict[str, list[float]] = {m: [] for m in modes}
    hits: dict[str, list[int]] = {m: [] for m in modes}
    loads: dict[str, list[int]] = {m: [] for m in modes}
    for prompt in prompts(args.repeats, args.prompt_tokens):
        for mode in modes:
            if mode in ("cpu", "disk"):
                llm.reset_prefix_cache()
            if mode == "disk":
                drop_cpu_tier(llm)
            before = loaded_bytes(llm)
            t, hit = timed(llm, prompt)
            times[mode].append(t)
            hits[mode].append(hit)
            loads[mode].append(loaded_bytes(llm) - before)
            # Let the disk writers finish what this run queued: on a small machine they
            # would otherwise slow down the next timed run (overhead.py measures them).
            if args.tp == 1:
                sync_tiers(llm)
    per_token = sum(g.block_bytes / g.block_tokens for g in layout.groups if g.kind != "state")
    return {
        "ttft_s": {m: statistics.median(v) for m, v in times.items()},
        "all_s": times,
        "hit_tokens": {m: v[0] for m, v in hits.items()},
        "loaded_bytes": {m: v[0] for m, v in loads.items()},
        "attention_bytes_per_token": per_token,
        "groups": [(g.kind.value, g.block_tokens, g.block_bytes) for g in layout.groups],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3-next")
    p.add_argument("--size", default="small")
    p.add_argument("--model", help="model directory (default: made under $HYBRIDKV_HOME)")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-bytes", default="4GiB")
    p.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    p.add_argument("--disk-path", help="disk tier directory (default: a new temporary one)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--json", type=Path, default=RESULTS / "ttft.json")
    p.add_argument("--restart-phase", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.restart_phase:  # the new process of a restart: report to the parent as JSON
        print("RESULT " + json.dumps(run(args, ["restart", "native"])), flush=True)
        return

    tmp = None
    if args.disk_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="hybridkv-bench-")
        args.disk_path = tmp.name
    first = run(
        args, ["cold", "native", "cpu", "disk"] if args.tp == 1 else ["cold", "native", "cpu"]
    )
    child = [sys.executable, __file__, "--restart-phase", *sys.argv[1:]]
    child += ["--disk-path", args.disk_path]
    out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
    second = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])

    t1, t2 = first["ttft_s"], second["ttft_s"]
    rows = [
        ("cold", t1["cold"], t1["cold"] / t1["native"], first["hit_tokens"]["cold"]),
        ("native prefix hit", t1["native"], 1.0, first["hit_tokens"]["native"]),
        ("hybridkv CPU tier", t1["cpu"], t1["cpu"] / t1["native"], first["hit_tokens"]["cpu"]),
    ]
    if "disk" in t1:
        rows.append(
            ("hybridkv disk", t1["disk"], t1["disk"] / t1["native"], first["hit_tokens"]["disk"])
        )
    rows += [
        ("restart: native hit", t2["native"], 1.0, second["hit_tokens"]["native"]),
        (
            "restart: hybridkv disk",
            t2["restart"],
            t2["restart"] / t2["native"],
            second["hit_tokens"]["restart"],
        ),
    ]
    print(
        f"{args.arch}/{args.size}, TP {args.tp}, {args.prompt_tokens}-token prompt, "
        f"{args.repeats} prompts"
    )
    print(f"{'':24}{'TTFT ms':>10}{'x native':>10}{'tokens hit':>12}")
    for name, t, ratio, hit in rows:
        print(f"{name:24}{t * 1e3:10.1f}{ratio:10.2f}{hit:12}")
    print(f"cold / hybridkv CPU      {t1['cold'] / t1['cpu']:.1f}x")
    hit = first["hit_tokens"]["cpu"]
    naive = hit * first["attention_bytes_per_token"]
    loaded = first["loaded_bytes"]["cpu"]
    print(
        f"bytes loaded for the hit {loaded:,} (all attention layers x {hit} tokens: {naive:,.0f})"
    )
    result = {
        "arch": args.arch,
        "size": args.size,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "tp": args.tp,
        "date": time.strftime("%Y-%m-%d"),
        "machine": os.uname().nodename,
        "same_process": first,
        "after_restart": second,
        "ratios": {name: ratio for name, _, ratio, _ in rows},
        "cold_over_cpu": t1["cold"] / t1["cpu"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
