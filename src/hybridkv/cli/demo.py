"""`hybridkv make-model` and `hybridkv demo`: a local random-weight hybrid model, and the
main job on it (cold run, vLLM's own prefix hit, hybridkv's restore after a reset)."""

from __future__ import annotations

import os
import random
import time
from enum import Enum
from typing import Annotated

import typer

from hybridkv.cli.app import app, size_option
from hybridkv.models import ARCHS, SIZES, default_model_dir, make_model

Arch = Enum("Arch", {a.replace("-", "_"): a for a in ARCHS}, type=str)
Size = Enum("Size", {s: s for s in SIZES}, type=str)


@app.command("make-model")
def make_model_cmd(
    arch: Annotated[Arch, typer.Argument(help="architecture to build")],
    directory: Annotated[str, typer.Argument(metavar="DIR", help="where to write it")],
    size: Annotated[Size, typer.Option(help="tiny (tests) or small (benchmarks)")] = Size.tiny,
    seed: Annotated[int, typer.Option(help="weights seed: same seed, same bytes")] = 0,
) -> None:
    """Write a deterministic random-weight model (config, safetensors, tokenizer)."""
    typer.echo(make_model(arch.value, directory, size=size.value, seed=seed))


@app.command()
def demo(
    arch: Annotated[Arch, typer.Option(help="architecture of the model")] = Arch.qwen3_next,
    size: Annotated[Size, typer.Option(help="model size")] = Size.small,
    model: Annotated[
        str | None, typer.Option(help="model directory (default: made under $HYBRIDKV_HOME)")
    ] = None,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length")] = 4096,
    max_tokens: Annotated[int, typer.Option(help="greedy tokens compared")] = 16,
    cpu_bytes: Annotated[str, typer.Option(help="hybridkv's CPU memory")] = "1GiB",
    kv_cache_bytes: Annotated[str, typer.Option(help="vLLM's KV cache")] = "1GiB",
) -> None:
    """Cold run, vLLM's own prefix hit, reset vLLM's prefix cache, hybridkv's restore:
    TTFT of each and whether the restored continuation is identical."""
    # One process for the whole engine keeps the demo simple to read and debug.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from hybridkv.engine import generate, make_llm, worker_connector

    kv_bytes = size_option(kv_cache_bytes, "--kv-cache-bytes")
    size_option(cpu_bytes, "--cpu-bytes")
    model_dir = model or str(default_model_dir(arch.value, size.value))
    print(f"model: {arch.value}/{size.value} at {model_dir}")
    make_model(arch.value, model_dir, size=size.value)
    llm = make_llm(
        model_dir,
        {"cpu_bytes": cpu_bytes},
        kv_cache_bytes=kv_bytes,
        max_model_len=prompt_tokens + 64,
        max_num_batched_tokens=prompt_tokens + 64,
    )
    rng = random.Random(0)
    prompt = [rng.randrange(1, 1000) for _ in range(prompt_tokens)]
    generate(llm, [[rng.randrange(1, 1000) for _ in range(64)]], max_tokens=1)  # warm-up

    def timed(n: int):
        t = time.perf_counter()
        g = generate(llm, [prompt], max_tokens=n)[0]
        return g, time.perf_counter() - t

    cold, t_cold = timed(1)
    native, t_native = timed(1)  # vLLM's own prefix cache serves this one
    llm.reset_prefix_cache()
    restored, t_restored = timed(1)  # only hybridkv can serve this one
    # Longer greedy continuations: native prefix hit vs hybridkv restore.
    ref = generate(llm, [prompt], max_tokens=max_tokens)[0]
    llm.reset_prefix_cache()
    again = generate(llm, [prompt], max_tokens=max_tokens)[0]

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
    print(f"{max_tokens} greedy tokens + logprobs restored == native hit: {same}")
    ok = restored.num_cached_tokens > 0 and same and cold.token_ids == restored.token_ids
    print("demo:", "OK" if ok else "FAILED")
    if not ok:
        raise typer.Exit(1)
