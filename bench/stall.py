"""Decode stall: how much a request that is decoding slows down while other requests
restore long prefixes from the disk tier (issue 11's benchmark; goal: p99 ratio <= 1.2).

One in-process engine (qwen3-next small). First `--prefixes` prompts of `--prefix-tokens`
tokens each are computed once, so hybridkv stores them (at least 256 MiB in total by
default). Then, in each of `--rounds` rounds:
  alone      a decoding request runs by itself for `--alone-steps` engine steps
  restoring  every stored prefix is requested again while it keeps decoding, with the
             CPU tier emptied and the files dropped from the page cache
             (`posix_fadvise(DONTNEED)`): hybridkv reads them from disk in the
             background while the scheduler answers "ask again", then loads them
  replayed   the same requests again, each added in the step it ran in while
             restoring: vLLM's own prefix cache now serves every prefix, so the decoder
             shares its steps with the same forwards and none of hybridkv's work
The decoder's inter-token gaps are the wall times between the engine steps that gave it
a token. The figure is p99(gap while restoring) / p99(gap alone), gaps pooled over the
rounds; restoring over replayed is hybridkv's own share of it, replayed over alone the
restored requests' own forwards. p50, the max and each round's p99 are printed too, with
the restore requests' waits (arrival to end: their TTFT) and each round's restore window
(arrival to the last one's end). Each prompt is one token past a chunk boundary, so a
restored request computes a single token (attending over the whole prefix).

    .venv/bin/python bench/stall.py                 # 8 x 15360 tokens (~265 MiB)
    .venv/bin/python bench/stall.py --prefixes 2 --prefix-tokens 3840 --rounds 1  # quick
    .venv/bin/python bench/stall.py --disk-path D --direct-io  # stored entries, O_DIRECT
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


PHASES = ("alone", "restoring", "replayed")


def summary(rounds: list[list[float]]) -> dict:
    """A phase's gaps pooled over the rounds, with each round's p99 and its three
    longest gaps (index in the phase, ms): one slow gap decides a p99 of a few hundred."""
    gaps = [g for r in rounds for g in r]
    return {
        "n": len(gaps),
        "p50_ms": statistics.median(gaps) * 1e3,
        "p99_ms": percentile(gaps, 0.99) * 1e3,
        "max_ms": max(gaps) * 1e3,
        "p99_by_round_ms": [round(percentile(r, 0.99) * 1e3, 1) for r in rounds],
        "longest_by_round": [
            sorted(((i, round(g * 1e3, 1)) for i, g in enumerate(r)), key=lambda x: -x[1])[:3]
            for r in rounds
        ],
    }


def collect(outs: dict, pending: set[str]) -> int:
    """Drop the requests of `pending` that finished in `outs`; their cached tokens."""
    done = [o for rid, o in outs.items() if rid in pending and o.finished]
    pending.difference_update(o.request_id for o in done)
    return sum(o.num_cached_tokens or 0 for o in done)


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
    p.add_argument(
        "--direct-io", action="store_true", help="disk_direct_io: read past the page cache"
    )
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
            "disk_direct_io": args.direct_io,
        },
        kv_cache_bytes=2 << 30,
        max_model_len=room,
        max_num_batched_tokens=room,
    )
    side = scheduler_connector(llm).scheduler_side
    disk_tier = worker_connector().worker_side.store.tiers[1]
    if disk_tier.direct_io != args.direct_io:
        raise SystemExit(f"the disk tier reads with direct_io={disk_tier.direct_io}")
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

    gaps: dict[str, list[list[float]]] = {name: [] for name in PHASES}  # per round
    restored_tokens = 0
    vllm_hit_tokens = 0
    windows: list[float] = []  # per round: the restore requests' arrival to the last one's end
    waits: list[float] = []  # each restore request's arrival to its end (its TTFT)
    loaded = worker_connector().worker_side.stats.loaded_bytes
    for r in range(args.rounds):
        for name in PHASES:
            gaps[name].append([])
        alone, restoring, replayed = (gaps[name][-1] for name in PHASES)
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
        waiting = {f"restore-{r}-{i}": i for i in range(len(prefixes))}
        ran_at: dict[int, int] = {}  # prefix -> the step (from the arrival) it ran in
        started = time.perf_counter()
        step = 0
        while waiting:
            outs, gap = tracker.step(engine)
            if gap is not None:
                restoring.append(gap)
            for rid, o in outs.items():
                if rid in waiting and o.finished:
                    ran_at[waiting.pop(rid)] = step
                    waits.append(time.perf_counter() - started)
                    restored_tokens += o.num_cached_tokens or 0
            step += 1
        windows.append(time.perf_counter() - started)

        # The same requests again, each added in the step it ran in above: vLLM's own
        # prefix cache now holds every prefix, so the decoder shares its steps with the
        # same forwards and none of hybridkv's reads or loads.
        hits_before = side.snapshot()["hit_tokens"]
        pending = {f"again-{r}-{i}" for i in ran_at}
        for replay_step in range(max(ran_at.values()) + 1):
            for i in (i for i, at in ran_at.items() if at == replay_step):
                engine.add_request(
                    f"again-{r}-{i}", TokensPrompt(prompt_token_ids=prefixes[i]), params(1)
                )
            outs, gap = tracker.step(engine)
            if gap is not None:
                replayed.append(gap)
            vllm_hit_tokens += collect(outs, pending)
        while pending:
            vllm_hit_tokens += collect(tracker.step(engine)[0], pending)
        if side.snapshot()["hit_tokens"] != hits_before:
            raise SystemExit("the replayed requests were served by hybridkv, not vLLM's cache")
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
        "direct_io": args.direct_io,
        "disk_bytes_per_round": disk_bytes,
        "loaded_bytes_per_round": loaded // max(args.rounds, 1),
        "restored_tokens_per_round": restored_tokens // max(args.rounds, 1),
        "vllm_hit_tokens_per_round": vllm_hit_tokens // max(args.rounds, 1),
        "restore_window_s": windows,
        "restore_ttft_s": {
            "p50": statistics.median(waits),
            "first": min(waits),
            "mean": statistics.fmean(waits),
        },
        **{name: summary(gaps[name]) for name in PHASES},
        "snapshot": side.snapshot(),
    }
    result["p99_ratio"] = result["restoring"]["p99_ms"] / result["alone"]["p99_ms"]
    result["p50_ratio"] = result["restoring"]["p50_ms"] / result["alone"]["p50_ms"]
    result["p99_over_replayed"] = result["restoring"]["p99_ms"] / result["replayed"]["p99_ms"]
    result["replayed_p99_ratio"] = result["replayed"]["p99_ms"] / result["alone"]["p99_ms"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    mib = 1 << 20
    print(
        f"restored per round: {result['restored_tokens_per_round']} tokens, "
        f"{result['loaded_bytes_per_round'] / mib:.0f} MiB loaded, "
        f"{disk_bytes / mib:.0f} MiB of entry files read cold"
    )
    print(f"vLLM's own hit per round (replayed): {result['vllm_hit_tokens_per_round']} tokens")
    for name in PHASES:
        s = result[name]
        print(
            f"{name:10s} gaps {s['n']:4d}  p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms"
            f"  max {s['max_ms']:7.1f} ms  (p99 by round: {s['p99_by_round_ms']})"
        )
    print(f"p99 ratio {result['p99_ratio']:.2f}  (p50 ratio {result['p50_ratio']:.2f})")
    print(
        f"replayed over alone: p99 {result['replayed_p99_ratio']:.2f}; restoring over "
        f"replayed: p99 {result['p99_over_replayed']:.2f}"
    )
    print("restore windows: " + ", ".join(f"{w:.2f} s" for w in windows))
    t = result["restore_ttft_s"]
    print(f"restore TTFT: first {t['first']:.2f} s, p50 {t['p50']:.2f} s, mean {t['mean']:.2f} s")


if __name__ == "__main__":
    main()
