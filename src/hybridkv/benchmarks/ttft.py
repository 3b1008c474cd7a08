"""Time to first token of one prompt set: cold, served by vLLM's own prefix cache, and
restored by hybridkv from each tier, also after a restart (`hybridkv bench ttft`,
`hybridkv bench restart`, bench/ttft.py).

Modes, each timed once per prompt, in this order within one engine process:
  cold       the prompt computed from scratch (hybridkv stores it to CPU and disk)
  native     the same prompt again: vLLM's own in-memory prefix cache serves it
  cpu        vLLM's prefix cache emptied: hybridkv restores from its CPU tier
  disk       CPU tier emptied as well: hybridkv restores from disk (page cache warm)
  redis      instead of disk, with `redis_url`: restored from Redis (a shared tier)
and in a second engine process on the same disk directory or Redis (a restart, or
another replica):
  restart    the prompt restored from what the first process wrote
  native     the same prompt again in that engine (its own prefix hit), the reference
  recompute  the prompt with its first token changed (so nothing of it is cached),
             computed from scratch in the same engine: the cold reference after restart
TTFT is the wall time of a one-token greedy `generate`. Every ratio is taken against the
native hit measured in the same process. Each engine phase runs in a child process
(`python -m hybridkv.benchmarks.ttft`, spec on stdin, a `RESULT {...}` line out), so the
caller never imports vLLM and a restart really is a new process.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridkv.benchmarks.figures import engine_process, percentile, write_result

FIRST_MODES = ("cold", "native", "cpu")
RESTART_MODES = ("restart", "native", "recompute")


def first_modes(tp: int, redis: bool = False) -> tuple[str, ...]:
    """The first engine's modes, the lower tier's last. With workers in processes of
    their own (TP > 1) the CPU tier cannot be emptied from the benchmark's process, so
    the lower tier's mode is left out."""
    return FIRST_MODES + (("redis" if redis else "disk",) if tp == 1 else ())


LABELS = {
    "cold": "cold",
    "native": "vLLM prefix hit",
    "cpu": "hybridkv CPU",
    "disk": "hybridkv disk",
    "redis": "hybridkv Redis",
    "restart": "restart: hybridkv",
    "restart native": "restart: vLLM prefix hit",
    "recompute": "restart: cold",
}


@dataclass
class TtftSettings:
    """The engine and workload of one TTFT benchmark."""

    arch: str = "qwen3-next"
    size: str = "small"
    model: str | None = None
    prompt_tokens: int = 8192
    repeats: int = 3
    cpu_bytes: str = "4GiB"
    kv_cache_bytes: int = 2 << 30
    disk_path: str | None = None
    redis_url: str | None = None  # the lower tier is this Redis instead of a disk
    run_id: str = ""  # names this run's Redis keys; set by `measure`
    tp: int = 1


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """Seeded prompts; ids below 30000 and within the model's vocabulary."""
    rng = random.Random(1234)
    top = min(vocab, 30000)
    return [[rng.randrange(1, top) for _ in range(length)] for _ in range(n)]


def _start_engine(s: TtftSettings):
    from hybridkv.engine import make_llm
    from hybridkv.models import model_for

    model = model_for(s.arch, s.size, s.model)
    extra: dict[str, Any] = {"cpu_bytes": s.cpu_bytes}
    if s.redis_url is not None:
        # Keys of this run only: a Redis outlives the benchmark, and a later run's cold
        # prompts must not hit what this one stored.
        extra.update(redis_url=s.redis_url, redis_key_prefix=f"hybridkv-bench-{s.run_id}")
    else:
        extra.update(disk_path=s.disk_path, disk_bytes="64GiB")
    room = s.prompt_tokens + 64
    parallel: dict[str, Any] = {}
    if s.tp > 1:
        parallel = {"tensor_parallel_size": s.tp, "distributed_executor_backend": "mp"}
        per = max((os.cpu_count() or s.tp) // s.tp, 1)
        binds = [f"{r * per}-{r * per + per - 1}" if per > 1 else str(r) for r in range(s.tp)]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(binds))
    return make_llm(
        str(model),
        extra,
        kv_cache_bytes=s.kv_cache_bytes,
        max_model_len=room,
        max_num_batched_tokens=room,
        **parallel,
    )


def _loaded_bytes(llm) -> int:
    """Bytes the in-process worker wrote into the KV cache (0 with workers elsewhere)."""
    from hybridkv.engine import worker_connector

    if llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend != "uni":
        return 0
    return worker_connector().worker_side.stats.loaded_bytes


def phase(s: TtftSettings, modes: list[str]) -> dict[str, Any]:
    """Time `modes` for every prompt in one engine (this process): seconds, tokens hit
    and bytes loaded per mode and prompt."""
    from hybridkv.engine import drop_cpu_tier, generate, scheduler_connector, sync_tiers
    from hybridkv.models import model_config

    llm = _start_engine(s)
    layout = scheduler_connector(llm).scheduler_side.layout
    vocab = model_config(s.arch, s.size)["vocab_size"]
    generate(llm, [[7] * 64], max_tokens=1)  # warm-up: first-request compilation
    rows: dict[str, dict[str, list]] = {m: {"s": [], "hit": [], "loaded": []} for m in modes}
    for prompt in prompts(s.repeats, s.prompt_tokens, vocab):
        for mode in modes:
            if mode in ("cpu", "disk", "redis"):
                llm.reset_prefix_cache()
            if mode in ("disk", "redis"):
                drop_cpu_tier(llm)
            timed = [prompt[0] % (vocab - 1) + 1, *prompt[1:]] if mode == "recompute" else prompt
            before = _loaded_bytes(llm)
            t = time.perf_counter()
            out = generate(llm, [timed], max_tokens=1)[0]
            rows[mode]["s"].append(time.perf_counter() - t)
            rows[mode]["hit"].append(out.num_cached_tokens)
            rows[mode]["loaded"].append(_loaded_bytes(llm) - before)
            # Let the disk writers finish what this run queued: on a small machine they
            # would otherwise slow down the next timed run (bench/overhead.py times them).
            if s.tp == 1:
                sync_tiers(llm)
    per_token = sum(g.block_bytes / g.block_tokens for g in layout.groups if g.kind != "state")
    snapshot = scheduler_connector(llm).scheduler_side.snapshot()
    return {
        "modes": rows,
        # Lookups that asked Redis, per request timed (the warm-up's included).
        "redis_round_trips_per_request": snapshot.get("probe_round_trips", 0)
        / (1 + s.repeats * len(modes)),
        "connector": snapshot,
        "attention_bytes_per_token": per_token,
        "groups": [(g.kind.value, g.block_tokens, g.block_bytes) for g in layout.groups],
    }


def _phase(s: TtftSettings, modes: tuple[str, ...]) -> dict[str, Any]:
    spec = {"settings": asdict(s), "modes": list(modes)}
    return engine_process("hybridkv.benchmarks.ttft", spec, f"TTFT engine {modes}")


def _drop_run_keys(url: str, prefix: str) -> None:
    """Delete what this run stored in a Redis that outlives it (standalone servers)."""
    import redis

    try:
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)
    except redis.RedisError as e:
        print(f"note: could not delete this run's keys {prefix}:* ({e})")


def measure(s: TtftSettings, first: tuple[str, ...], restart: bool) -> dict[str, Any]:
    """Run the first engine's `first` modes, then (with `restart`) a second engine's
    restart modes on the same disk directory; per-mode figures, raw samples, settings."""
    tmp = None
    s.run_id = s.run_id or f"{os.getpid()}-{time.time_ns()}"
    if s.disk_path is None and s.redis_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="hybridkv-bench-")
        s.disk_path = tmp.name
    try:
        phases = {"first": _phase(s, first)}
        if restart:
            phases["restart"] = _phase(s, RESTART_MODES)
    finally:
        if tmp is not None:
            tmp.cleanup()
            s.disk_path = None
        if s.redis_url is not None:
            _drop_run_keys(s.redis_url, f"hybridkv-bench-{s.run_id}")
    figures = {}
    for name, ph in phases.items():
        ref = percentile(ph["modes"]["native"]["s"], 0.5) if "native" in ph["modes"] else None
        for mode, row in ph["modes"].items():
            label = "restart native" if (name, mode) == ("restart", "native") else mode
            p50 = percentile(row["s"], 0.5)
            figures[label] = {
                "ttft_p50_s": p50,
                "ttft_p90_s": percentile(row["s"], 0.9),
                "x_native": p50 / ref if ref else None,
                "hit_tokens": row["hit"][0],
                "loaded_bytes": row["loaded"][0],
            }
    return {
        "settings": asdict(s),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": os.uname().nodename,
        "figures": figures,
        "phases": phases,
    }


def table(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"{s['arch']}/{s['size']}, TP {s['tp']}, {s['prompt_tokens']}-token prompt, "
        f"{s['repeats']} prompts",
        f"{'':26}{'p50 ms':>9}{'p90 ms':>9}{'x native':>10}{'tokens hit':>12}{'loaded MB':>11}",
    ]
    for mode, f in result["figures"].items():
        ratio = f"{f['x_native']:10.2f}" if f["x_native"] is not None else f"{'-':>10}"
        lines.append(
            f"{LABELS[mode]:26}{f['ttft_p50_s'] * 1e3:9.1f}{f['ttft_p90_s'] * 1e3:9.1f}"
            f"{ratio}{f['hit_tokens']:12}{f['loaded_bytes'] / 1e6:11.1f}"
        )
    figs = result["figures"]
    cold = figs.get("cold")
    restored = [m for m in ("cpu", "disk", "redis") if m in figs and figs[m]["ttft_p50_s"]]
    if cold is not None and restored:
        lines.append(
            "cold / restored p50: "
            + ", ".join(f"{m} {cold['ttft_p50_s'] / figs[m]['ttft_p50_s']:.1f}x" for m in restored)
        )
    per_token = result["phases"]["first"].get("attention_bytes_per_token")
    cpu = figs.get("cpu")
    if per_token and cpu is not None and cpu["loaded_bytes"]:
        every = per_token * cpu["hit_tokens"]
        lines.append(
            f"hybridkv CPU loaded {cpu['loaded_bytes'] / 1e6:.1f} MB; every attention layer"
            f" over the {cpu['hit_tokens']} tokens hit holds {every / 1e6:.1f} MB"
            f" ({every / cpu['loaded_bytes']:.2f}x)"
        )
    if s["redis_url"] is not None:
        trips = ", ".join(
            f"{name} {ph['redis_round_trips_per_request']:.2f}"
            for name, ph in result["phases"].items()
        )
        lines.append(f"Redis round trips per request: {trips}")
    return "\n".join(lines)


def draw(result: dict[str, Any], ax: Any) -> None:
    """TTFT p50 bars per mode, p90 as a whisker, tokens hit above each."""
    figs = result["figures"]
    names = list(figs)
    p50 = [figs[m]["ttft_p50_s"] * 1e3 for m in names]
    p90 = [figs[m]["ttft_p90_s"] * 1e3 for m in names]
    colors = ["tab:red" if m in ("cold", "recompute") else "tab:blue" for m in names]
    colors = ["tab:gray" if "native" in m else c for m, c in zip(names, colors, strict=True)]
    bars = ax.bar(range(len(names)), p50, color=colors)
    ax.errorbar(
        range(len(names)),
        p50,
        yerr=[[0] * len(names), [b - a for a, b in zip(p50, p90, strict=True)]],
        fmt="none",
        ecolor="black",
        capsize=4,
    )
    for bar, m, top in zip(bars, names, p90, strict=True):
        ax.annotate(
            f"{figs[m]['hit_tokens']} hit",
            (bar.get_x() + bar.get_width() / 2, top),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(range(len(names)), [LABELS[m] for m in names], rotation=25, ha="right")
    ax.set_ylabel("TTFT ms (bar p50, whisker p90)")
    s = result["settings"]
    ax.set_title(f"{s['arch']}/{s['size']}, {s['prompt_tokens']} tokens, TP {s['tp']}")


def run(s: TtftSettings, first: tuple[str, ...], restart: bool, out: Path) -> Path:
    """Measure, print the table, write JSON at `out` and a PNG beside it; the PNG."""
    result = measure(s, first, restart)
    print(table(result))
    png = write_result(result, out, lambda ax: draw(result, ax))
    print(f"wrote {out} and {png}")
    return png


def _main() -> None:
    spec = json.loads(sys.stdin.read())
    result = phase(TtftSettings(**spec["settings"]), spec["modes"])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _main()
