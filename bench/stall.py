"""Decode stall: how much a request that is decoding slows down while other requests
restore long prefixes from the disk tier (issue 11's benchmark; goal: p99 ratio <= 1.2).

One in-process engine (qwen3-next small). First `--prefixes` prompts of `--prefix-tokens`
tokens each are computed once, so hybridkv stores them (at least 256 MiB in total by
default). Then, in each of `--rounds` rounds:
  alone     a decoding request runs by itself for `--alone-steps` engine steps
  restore   every stored prefix is requested again while it keeps decoding, with the
            CPU tier emptied and the files dropped from the page cache
            (`posix_fadvise(DONTNEED)`): hybridkv reads them from disk in the background
            while the scheduler answers "ask again", then loads them all
The decoder's inter-token gaps are the wall times between the engine steps that gave it
a token. The figure is p99(gap while restoring) / p99(gap alone), gaps pooled over the
rounds; p50 and the max are printed too, and each round's restore window (the restore
requests' arrival to the last one's end): how long the restorers waited. Each prompt is
one token past a chunk boundary, so a restored request computes a single token: what the
decoder waits for is the read and the load, not the restorers' own prefill.

    .venv/bin/python bench/stall.py                 # 8 x 15360 tokens (~265 MiB)
    .venv/bin/python bench/stall.py --prefixes 2 --prefix-tokens 3840 --rounds 1  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS

from hybridkv.benchmarks.figures import percentile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def summary(gaps: list[float]) -> dict[str, float]:
    return {
        "n": len(gaps),
        "p50_ms": statistics.median(gaps) * 1e3,
        "p99_ms": percentile(gaps, 0.99) * 1e3,
        "max_ms": max(gaps) * 1e3,
    }


@dataclass
class Decoder:
    """The decoding request's progress: tokens so far, and when the last one came."""

    req_id: str
    count: int = 0
    last: float | None = None

    def step(self, engine) -> tuple[dict, float | None]:
        """One engine step: its outputs, and the decoder's gap if it got a token in it
        (its first three tokens, prefill included, give none)."""
        outs = {o.request_id: o for o in engine.step()}
        now = time.perf_counter()
        gap = None
        out = outs.get(self.req_id)
        if out is not None and len(out.outputs[0].token_ids) > self.count:
            if self.last is not None and self.count >= 3:
                gap = now - self.last
            self.count, self.last = len(out.outputs[0].token_ids), now
        return outs, gap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=15360, help="a chunk-size multiple")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--alone-steps", type=int, default=120)
    p.add_argument(
        "--load-step-bytes", default="64MiB", help="hybridkv's load_step_bytes (0: no limit)"
    )
    p.add_argument("--disk-path", help="disk tier directory (default: a new temporary one)")
    p.add_argument("--json", type=Path, default=RESULTS / "stall.json")
    args = p.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hybridkv.engine import (
        drop_cpu_tier,
        drop_page_cache,
        generate,
        make_llm,
        scheduler_connector,
        sync_tiers,
        worker_connector,
    )
    from hybridkv.models import default_model_dir, make_model

    disk = Path(args.disk_path or tempfile.mkdtemp(prefix="hybridkv-stall-"))
    model = make_model("qwen3-next", default_model_dir("qwen3-next", args.size), args.size)
    room = args.prefix_tokens + 64
    llm = make_llm(
        str(model),
        {
            "cpu_bytes": "4GiB",
            "disk_path": str(disk),
            "disk_bytes": "16GiB",
            "load_step_bytes": args.load_step_bytes,
        },
        kv_cache_bytes=2 << 30,
        max_model_len=room,
        max_num_batched_tokens=room,
    )
    side = scheduler_connector(llm).scheduler_side
    C = side.planner.chunk_tokens
    if args.prefix_tokens % C:
        raise SystemExit(f"--prefix-tokens must be a multiple of the chunk size, {C}")
    rng = random.Random(7)
    prefixes = [
        [rng.randrange(1, 30000) for _ in range(args.prefix_tokens + 1)]
        for _ in range(args.prefixes)
    ]
    generate(llm, [prefixes[0][:64]], max_tokens=1)  # warm-up
    t = time.perf_counter()
    for prompt in prefixes:
        generate(llm, [prompt], max_tokens=1)
    sync_tiers(llm)
    print(f"stored {args.prefixes} prefixes in {time.perf_counter() - t:.0f} s")
    files = list(disk.rglob("*.kv"))
    disk_bytes = sum(f.stat().st_size for f in files)
    engine = llm.llm_engine

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)

    alone: list[float] = []
    restoring: list[float] = []
    restored_tokens = 0
    windows: list[float] = []  # per round: the restore requests' arrival to the last's end
    loaded = worker_connector().worker_side.stats.loaded_bytes
    for r in range(args.rounds):
        llm.reset_prefix_cache()
        drop_cpu_tier(llm)
        dropped = drop_page_cache(files)
        decoder = f"decoder-{r}"
        engine.add_request(
            decoder, TokensPrompt(prompt_token_ids=prefixes[0][-64:]), params(room - 128)
        )
        tracker = Decoder(decoder)

        while tracker.count < 3 + args.alone_steps:
            _, gap = tracker.step(engine)
            if gap is not None:
                alone.append(gap)
        for i, prompt in enumerate(prefixes):
            engine.add_request(f"restore-{r}-{i}", TokensPrompt(prompt_token_ids=prompt), params(1))
        waiting = {f"restore-{r}-{i}" for i in range(len(prefixes))}
        started = time.perf_counter()
        while waiting:
            outs, gap = tracker.step(engine)
            if gap is not None:
                restoring.append(gap)
            for rid, o in outs.items():
                if rid in waiting and o.finished:
                    waiting.discard(rid)
                    restored_tokens += o.num_cached_tokens or 0
        windows.append(time.perf_counter() - started)
        engine.abort_request([decoder])
        while engine.has_unfinished_requests():
            engine.step()
        print(f"round {r}: {dropped} files dropped from the page cache")
    loaded = worker_connector().worker_side.stats.loaded_bytes - loaded
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "size": args.size,
        "prefixes": args.prefixes,
        "prefix_tokens": args.prefix_tokens,
        "rounds": args.rounds,
        "load_step_bytes": args.load_step_bytes,
        "disk_bytes_per_round": disk_bytes,
        "loaded_bytes_per_round": loaded // max(args.rounds, 1),
        "restored_tokens_per_round": restored_tokens // max(args.rounds, 1),
        "restore_window_s": windows,
        "alone": summary(alone),
        "restoring": summary(restoring),
        "snapshot": side.snapshot(),
    }
    result["p99_ratio"] = result["restoring"]["p99_ms"] / result["alone"]["p99_ms"]
    result["p50_ratio"] = result["restoring"]["p50_ms"] / result["alone"]["p50_ms"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    mib = 1 << 20
    print(
        f"restored per round: {result['restored_tokens_per_round']} tokens, "
        f"{result['loaded_bytes_per_round'] / mib:.0f} MiB loaded, "
        f"{disk_bytes / mib:.0f} MiB of entry files read cold"
    )
    for name in ("alone", "restoring"):
        s = result[name]
        print(
            f"{name:10s} gaps {s['n']:4d}  p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms"
            f"  max {s['max_ms']:7.1f} ms"
        )
    print(f"p99 ratio {result['p99_ratio']:.2f}  (p50 ratio {result['p50_ratio']:.2f})")
    print("restore windows: " + ", ".join(f"{w:.2f} s" for w in windows))


if __name__ == "__main__":
    main()
