"""`hybridkv` command line: make-model, demo."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from hybridkv.models import ARCHS, SIZES, default_model_dir, make_model


def cmd_make_model(args: argparse.Namespace) -> int:
    out = make_model(args.arch, args.dir, size=args.size, seed=args.seed)
    print(out)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    # One process for the whole engine keeps the demo simple to read and debug.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from hybridkv.engine import generate, make_llm, worker_connector

    model_dir = args.model or str(default_model_dir(args.arch, args.size))
    print(f"model: {args.arch}/{args.size} at {model_dir}")
    make_model(args.arch, model_dir, size=args.size)
    llm = make_llm(
        model_dir,
        {"cpu_bytes": args.cpu_bytes},
        kv_cache_bytes=args.kv_cache_bytes,
        max_model_len=args.prompt_tokens + 64,
        max_num_batched_tokens=args.prompt_tokens + 64,
    )
    rng = random.Random(0)
    prompt = [rng.randrange(1, 1000) for _ in range(args.prompt_tokens)]
    generate(llm, [[rng.randrange(1, 1000) for _ in range(64)]], max_tokens=1)  # warm-up

    def timed(max_tokens: int):
        t = time.perf_counter()
        g = generate(llm, [prompt], max_tokens=max_tokens)[0]
        return g, time.perf_counter() - t

    cold, t_cold = timed(1)
    native, t_native = timed(1)  # vLLM's own prefix cache serves this one
    llm.reset_prefix_cache()
    restored, t_restored = timed(1)  # only hybridkv can serve this one
    # Longer greedy continuations: native prefix hit vs hybridkv restore.
    ref = generate(llm, [prompt], max_tokens=args.max_tokens)[0]
    llm.reset_prefix_cache()
    again = generate(llm, [prompt], max_tokens=args.max_tokens)[0]

    ws = worker_connector().worker_side
    same = again.token_ids == ref.token_ids and again.logprobs == ref.logprobs
    print(f"prompt tokens            {len(prompt)}")
    hit, native_hit = restored.num_cached_tokens, native.num_cached_tokens
    print(f"tokens restored          {hit} (native hit: {native_hit})")
    stats = ws.stats
    print(f"blocks loaded            {stats.loaded_blocks}, entries stored {stats.stored_entries}")
    print(f"TTFT cold                {t_cold * 1e3:8.1f} ms")
    print(f"TTFT native prefix hit   {t_native * 1e3:8.1f} ms")
    speedup = t_cold / t_restored
    print(f"TTFT restored (hybridkv) {t_restored * 1e3:8.1f} ms   cold/restored = {speedup:.1f}x")
    print(f"first token cold == restored: {cold.token_ids == restored.token_ids}")
    print(f"{args.max_tokens} greedy tokens + logprobs restored == native hit: {same}")
    ok = restored.num_cached_tokens > 0 and same and cold.token_ids == restored.token_ids
    print("demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridkv", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-model", help="write a deterministic random-weight model")
    m.add_argument("arch", choices=ARCHS)
    m.add_argument("dir")
    m.add_argument("--size", choices=SIZES, default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=cmd_make_model)

    d = sub.add_parser("demo", help="cold run, reset vLLM's prefix cache, restored run")
    d.add_argument("--arch", choices=ARCHS, default="qwen3-next")
    d.add_argument("--size", choices=SIZES, default="small")
    d.add_argument("--model", help="model directory (default: made under $HYBRIDKV_HOME)")
    d.add_argument("--prompt-tokens", type=int, default=4096)
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--cpu-bytes", default="1GiB")
    d.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    d.set_defaults(fn=cmd_demo)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
