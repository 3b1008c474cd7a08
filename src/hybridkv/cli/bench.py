"""`hybridkv bench ttft | restart | hit-rate`: the package's benchmarks from the command
line. Each runs its engines in child processes and writes JSON and a PNG plot; the
figures in docs/benchmarks.md come from these (bench/*.py call them)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridkv.cli.app import bench, size_option
from hybridkv.cli.demo import Arch, Size

Out = Annotated[Path, typer.Option(help="JSON result (the PNG plot is written beside it)")]
ArchOpt = Annotated[Arch, typer.Option(help="model architecture")]
SizeOpt = Annotated[Size, typer.Option(help="model size")]
Model = Annotated[str | None, typer.Option(help="model directory (default: built)")]
PromptTokens = Annotated[int, typer.Option(help="prompt length")]
Repeats = Annotated[int, typer.Option(help="prompts timed (p50/p90 over them)")]
CpuBytes = Annotated[str, typer.Option(help="hybridkv's CPU memory")]
KvCacheBytes = Annotated[str, typer.Option(help="vLLM's own KV cache")]
Tp = Annotated[int, typer.Option(help="tensor-parallel ranks (`mp` executor)")]
Quick = Annotated[bool, typer.Option(help="tiny model, short prompts, 2 repeats (~1 min)")]
Redis = Annotated[
    str | None,
    typer.Option(help="restore from this Redis (redis://...) instead of a disk directory"),
]


def _ttft_settings(
    arch: Arch,
    size: Size,
    model: str | None,
    prompt_tokens: int,
    repeats: int,
    cpu_bytes: str,
    kv_cache_bytes: str,
    tp: int,
    quick: bool,
    redis: str | None,
):
    from hybridkv.benchmarks.ttft import TtftSettings

    size_option(cpu_bytes, "--cpu-bytes")
    s = TtftSettings(
        arch=arch.value,
        size=size.value,
        model=model,
        prompt_tokens=prompt_tokens,
        repeats=repeats,
        cpu_bytes=cpu_bytes,
        kv_cache_bytes=size_option(kv_cache_bytes, "--kv-cache-bytes"),
        tp=tp,
        redis_url=redis,
    )
    if quick:
        s.size, s.prompt_tokens, s.repeats, s.kv_cache_bytes = "tiny", 1024, 2, 256 << 20
    return s


@bench.command()
def ttft(
    arch: ArchOpt = Arch.qwen3_next,
    size: SizeOpt = Size.small,
    model: Model = None,
    prompt_tokens: PromptTokens = 8192,
    repeats: Repeats = 3,
    cpu_bytes: CpuBytes = "4GiB",
    kv_cache_bytes: KvCacheBytes = "2GiB",
    tp: Tp = 1,
    restart: Annotated[bool, typer.Option(help="also time a restart from disk")] = False,
    quick: Quick = False,
    redis: Redis = None,
    json: Out = Path("hybridkv-bench/ttft.json"),
) -> None:
    """TTFT cold, with vLLM's own prefix hit, and restored by hybridkv from CPU memory
    and from disk (or Redis), in one engine; p50/p90, tokens hit, bytes loaded."""
    from hybridkv.benchmarks.ttft import first_modes, run

    s = _ttft_settings(
        arch, size, model, prompt_tokens, repeats, cpu_bytes, kv_cache_bytes, tp, quick, redis
    )
    run(s, first_modes(s.tp, s.redis_url is not None), restart, json)


@bench.command("restart")
def restart_cmd(
    arch: ArchOpt = Arch.qwen3_next,
    size: SizeOpt = Size.small,
    model: Model = None,
    prompt_tokens: PromptTokens = 8192,
    repeats: Repeats = 3,
    cpu_bytes: CpuBytes = "4GiB",
    kv_cache_bytes: KvCacheBytes = "2GiB",
    tp: Tp = 1,
    quick: Quick = False,
    redis: Redis = None,
    json: Out = Path("hybridkv-bench/restart.json"),
) -> None:
    """One engine computes the prompts (hybridkv writes them to disk or Redis); a new
    engine process restores them from there: TTFT against its own prefix hit and
    against computing them from scratch."""
    from hybridkv.benchmarks.ttft import run

    s = _ttft_settings(
        arch, size, model, prompt_tokens, repeats, cpu_bytes, kv_cache_bytes, tp, quick, redis
    )
    run(s, ("cold",), True, json)


@bench.command("hit-rate")
def hit_rate(
    traces: Annotated[
        list[str] | None,
        typer.Option(
            "--trace",
            help="trace spec, repeatable: a family (tuning: chat, agentic, docqa; held-out: "
            "sharegpt-like, mooncake-like, coding-agent, rag, mixture, issue29), "
            "mooncake:FILE[:N], sharegpt:FILE (default: chat, agentic, docqa)",
        ),
    ] = None,
    systems: Annotated[
        list[str] | None,
        typer.Option(
            "--system",
            help="repeatable: hybridkv, vllm-offload (vLLM's own "
            "OffloadingConnector), none, hybridkv@REV (default: the first three)",
        ),
    ] = None,
    budgets_mib: Annotated[
        list[float] | None,
        typer.Option("--budget-mib", help="CPU budget, repeatable (default 4 8 16 32 64)"),
    ] = None,
    arch: ArchOpt = Arch.qwen3_next,
    size: SizeOpt = Size.tiny,
    model: Model = None,
    kv_cache_mib: Annotated[
        float | None, typer.Option(help="the engine's own KV cache [default: 4, quick: 2]")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="output tokens per request")] = 1,
    in_flight: Annotated[
        int, typer.Option(help="requests in the engine at a time (1: one after the other)")
    ] = 1,
    limit: Annotated[int | None, typer.Option(help="first N requests of each trace")] = None,
    hybridkv_extra: Annotated[str, typer.Option(help="JSON merged into hybridkv's config")] = "{}",
    quick: Annotated[
        bool, typer.Option(help="defaults for a smoke run: a small chat trace, 2 and 8 MiB")
    ] = False,
    out_dir: Annotated[Path, typer.Option(help="where hit_rate-<trace>.json/.png go")] = Path(
        "hybridkv-bench"
    ),
    log: Annotated[str | None, typer.Option(help="append engine output to this file")] = None,
) -> None:
    """Replay a trace against hybridkv, vLLM's own OffloadingConnector and no connector
    at equal CPU budgets: token hit rate (vLLM's prefix cache vs the connector), as a
    fraction of the oracle (the best any policy could do), TTFT p50/p90, bytes stored
    and loaded; tuning and held-out trace families summarized apart."""
    from hybridkv.benchmarks.hit_rate import HitRateSettings, run

    try:
        settings = HitRateSettings.make(
            quick,
            traces=traces,
            systems=systems,
            budgets_mib=budgets_mib,
            arch=arch.value,
            size=size.value,
            model=model,
            kv_cache_mib=kv_cache_mib,
            max_tokens=max_tokens,
            in_flight=in_flight,
            limit=limit,
            hybridkv_extra=hybridkv_extra,
            out_dir=out_dir,
            log=log,
        )
    except ValueError as e:  # "<setting>: what is wrong"
        key = str(e).partition(":")[0]
        option = {"systems": "--system", "budgets_mib": "--budget-mib"}.get(
            key, "--" + key.replace("_", "-")
        )
        raise typer.BadParameter(str(e), param_hint=option) from None
    run(settings)
