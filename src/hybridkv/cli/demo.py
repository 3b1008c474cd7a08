"""`hybridkv make-model` and `hybridkv demo`: a local random-weight hybrid model, and the
main job on it (cold run, vLLM's own prefix hit, hybridkv's restore after a reset)."""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from enum import Enum
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.cli.app import app, size_option
from hybridkv.models import ARCHS, SIZES, make_model, model_for

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
    try:
        typer.echo(make_model(arch.value, directory, size=size.value, seed=seed))
    except (FileExistsError, NotADirectoryError) as e:  # a directory of the user's own
        raise typer.BadParameter(str(e), param_hint="DIR") from None


@app.command()
def demo(
    arch: Annotated[Arch, typer.Option(help="architecture of the model")] = Arch.qwen3_next,
    size: Annotated[Size, typer.Option(help="model size")] = Size.small,
    model: Annotated[
        str | None,
        typer.Option(
            help="model directory: yours as it is, or where to make the random-weight one "
            "(default: under $HYBRIDKV_HOME)"
        ),
    ] = None,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length")] = 4096,
    max_tokens: Annotated[int, typer.Option(help="greedy tokens compared")] = 16,
    cpu_bytes: Annotated[str, typer.Option(help="hybridkv's CPU memory")] = "1GiB",
    kv_cache_bytes: Annotated[str, typer.Option(help="vLLM's KV cache")] = "1GiB",
) -> None:
    """Cold run, vLLM's own prefix hit, reset vLLM's prefix cache, hybridkv's restore:
    TTFT of each and whether the restored continuation is identical to the one vLLM's
    own hit gave before anything was restored. vLLM logs errors only
    (VLLM_LOGGING_LEVEL=INFO shows its log)."""
    quiet()
    # One process for the whole engine keeps the demo simple to read and debug.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from hybridkv.engine import generate, make_llm, worker_connector

    kv_bytes = size_option(kv_cache_bytes, "--kv-cache-bytes")
    size_option(cpu_bytes, "--cpu-bytes")
    # The option wins over the caller's HYBRIDKV_CPU_BYTES (other settings come from the
    # HYBRIDKV_* variables and the config file, as for `hybridkv serve`).
    os.environ["HYBRIDKV_CPU_BYTES"] = cpu_bytes
    model_dir = str(model_for(arch.value, size.value, model))
    console = Console()
    console.print(f"model: {model_dir}")
    llm = make_llm(
        model_dir,
        {"cpu_bytes": cpu_bytes},
        kv_cache_bytes=kv_bytes,
        max_model_len=prompt_tokens + max(max_tokens, 64),
        max_num_batched_tokens=prompt_tokens + max(max_tokens, 64),
        use_tqdm_on_load=False,
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
    # The reference continuation, before anything is restored: vLLM's own prefix hit on
    # the blocks the cold run computed.
    ref = generate(llm, [prompt], max_tokens=max_tokens)[0]
    emptied = llm.reset_prefix_cache()
    stats = worker_connector().worker_side.stats
    loaded = stats.loaded_blocks
    restored, t_restored = timed(1)  # only hybridkv can serve this one
    emptied = llm.reset_prefix_cache() and emptied
    again = generate(llm, [prompt], max_tokens=max_tokens)[0]  # restored once more

    same = again.token_ids == ref.token_ids and again.logprobs == ref.logprobs
    first_same = cold.token_ids == restored.token_ids == ref.token_ids[:1]
    hit = restored.num_cached_tokens > 0 and again.num_cached_tokens > 0
    ok = emptied and hit and stats.loaded_blocks > loaded and same and first_same

    table = Table(title=f"time to first token, {len(prompt)}-token prompt", title_justify="left")
    table.add_column("run")
    table.add_column("cached tokens", justify="right")
    table.add_column("TTFT", justify="right")
    table.add_column("speed-up", justify="right")
    for name, gen, t in (
        ("cold", cold, t_cold),
        ("vLLM's own prefix hit", native, t_native),
        ("restored by hybridkv", restored, t_restored),
    ):
        table.add_row(name, str(gen.num_cached_tokens), f"{t * 1e3:.1f} ms", f"{t_cold / t:.1f}x")
    console.print(table)
    console.print(
        f"hybridkv: {stats.loaded_blocks} blocks loaded, {stats.stored_entries} entries stored"
    )
    if not emptied:
        console.print("[red]vLLM's prefix cache could not be emptied: nothing was shown[/]")
    console.print(f"first token, restored == cold: {_yes(first_same)}")
    console.print(
        f"{max_tokens} greedy tokens + logprobs, restored == vLLM's own hit before any "
        f"restore: {_yes(same)}"
    )
    console.print("demo:", "[bold green]OK[/]" if ok else "[bold red]FAILED[/]")
    if not ok:
        raise typer.Exit(1)


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]no[/]"


def quiet() -> None:
    """Keep the demo's output to its own summary: vLLM logs errors only, and no progress
    bars, C++ or Python warnings. Set before vLLM, torch and transformers are imported
    (they read these once); a variable the user set wins."""
    for name, value in (
        ("VLLM_LOGGING_LEVEL", "ERROR"),
        ("TORCH_CPP_LOG_LEVEL", "ERROR"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TQDM_DISABLE", "1"),
    ):
        os.environ.setdefault(name, value)
    level = os.environ["VLLM_LOGGING_LEVEL"].upper()
    # vLLM configures its logging only when the engine starts: until then, warnings
    # logged while it is imported reach Python's last-resort handler.
    logging.getLogger("vllm").setLevel(level)
    if level == "ERROR":
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
