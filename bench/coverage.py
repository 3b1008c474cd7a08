"""Coverage by prompt length: what fraction of seeded prompt lengths is restored at its
last chunk boundary, hybridkv against vLLM alone, in each process layout (issue 26).

Layouts: the API server (engine core in its own process) at TP 1 and TP 2, and an
in-process `LLM` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Each length is sent cold, then
again: with hybridkv after vLLM's own prefix cache was emptied (the hit is hybridkv's),
without it right away (the hit is vLLM's own). A length counts as covered when the
second request had exactly its last chunk boundary before its last token cached.

The cold requests (one output token, so latency ~ time to first token) also time what
hybridkv costs a miss: the same lengths, one server after the other, with and without.

    .venv/bin/python bench/coverage.py                   # 50 lengths, every layout
    .venv/bin/python bench/coverage.py --lengths 10 --layouts server-tp1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import serving  # noqa: E402  (the test harness: one way to start and drive the server)

LAYOUTS = ("server-tp1", "server-tp2", "in-process")
TP2_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    return [serving.tokens(n, seed * 1000 + i) for i, n in enumerate(lengths)]


async def _timed(srv: serving.Server, prompt: list[int]) -> tuple[int, float]:
    async with srv.client() as client:
        t = time.perf_counter()
        c = await serving.complete(client, srv.model, prompt, max_tokens=1)
        return c.cached_tokens, time.perf_counter() - t


def run_server(model: str, prompts: list[list[int]], tp: int, hybridkv: bool, log: Path) -> dict:
    """Cold then again, one prompt at a time; with hybridkv vLLM's cache is emptied
    before the second request."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        srv = serving.start_server(
            model,
            log,
            {"cpu_bytes": "512MiB"},
            kv_cache_bytes=64 * serving.MiB,
            extra_args=TP2_ARGS if tp == 2 else (),
            connector=hybridkv,
        )
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        chunk = srv.chunk_tokens() if hybridkv else None
        cold_s, again = [], []
        for p in prompts:
            cached, seconds = asyncio.run(_timed(srv, p))
            assert cached == 0, f"a cold prompt had {cached} tokens cached"
            cold_s.append(seconds)
            if hybridkv:
                srv.reset_prefix_cache()
            again.append(asyncio.run(_timed(srv, p))[0])
        stats = serving.hybridkv_stats(srv.log_lines())
    finally:
        srv.stop()
    return {"chunk": chunk, "cold_s": cold_s, "again": again, "stats": stats[-1] if stats else None}


def run_in_process(model: str, prompts: list[list[int]], hybridkv: bool) -> dict:
    """The same in a child process whose engine core runs in-process."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model, "prompts": prompts, "hybridkv": hybridkv}, f)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run(
        [sys.executable, __file__, "--child", f.name],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    os.unlink(f.name)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"in-process run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def child(spec_path: str) -> None:
    from hybridkv.engine import generate, make_llm, scheduler_connector, shutdown

    spec = json.loads(Path(spec_path).read_text())
    llm = make_llm(
        spec["model"],
        {"cpu_bytes": "512MiB"},
        connector=spec["hybridkv"],
        kv_cache_bytes=64 << 20,
    )
    chunk = scheduler_connector(llm).planner.chunk_tokens if spec["hybridkv"] else None
    cold_s, again = [], []
    for p in spec["prompts"]:
        t = time.perf_counter()
        (cold,) = generate(llm, [p], max_tokens=1)
        cold_s.append(time.perf_counter() - t)
        if spec["hybridkv"]:
            llm.reset_prefix_cache()
        again.append(generate(llm, [p], max_tokens=1)[0].num_cached_tokens)
    shutdown(llm)
    print("RESULT " + json.dumps({"chunk": chunk, "cold_s": cold_s, "again": again}))


def covered(lengths: list[int], again: list[int], chunk: int) -> float:
    hits = sum(a == serving.last_boundary(n, chunk) for n, a in zip(lengths, again, strict=True))
    return hits / len(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, default=50)
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--arch", default="qwen3-next")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=RESULTS / "coverage.json")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return

    from hybridkv.models import make_model

    root = Path(tempfile.mkdtemp(prefix="hybridkv-coverage-"))
    model = str(make_model(args.arch, root / args.arch, size=args.size))
    lengths = serving.drawn_lengths(args.lengths, seed=args.seed)
    prompts = _prompts(lengths, args.seed)
    print(f"seed {args.seed}: {len(lengths)} lengths in [300, 4000]", flush=True)
    results: dict[str, dict] = {}
    for layout in args.layouts.split(","):
        row = {}
        for system in ("vllm", "hybridkv"):
            on = system == "hybridkv"
            if layout == "in-process":
                r = run_in_process(model, prompts, on)
            else:
                tp = 2 if layout == "server-tp2" else 1
                r = run_server(model, prompts, tp, on, root / f"{layout}-{system}.log")
            row[system] = r
        chunk = row["hybridkv"]["chunk"]
        for system in ("vllm", "hybridkv"):
            row[system]["covered"] = covered(lengths, row[system]["again"], chunk)
        ratio = statistics.median(
            h / v for h, v in zip(row["hybridkv"]["cold_s"], row["vllm"]["cold_s"], strict=True)
        )
        total = sum(row["hybridkv"]["cold_s"]) / sum(row["vllm"]["cold_s"])
        row["miss_ttft_ratio"] = {"median": ratio, "total": total}
        results[layout] = row
        stats = row["hybridkv"].get("stats") or {}
        print(
            f"{layout:>11}  chunk {chunk}  covered: vLLM alone {row['vllm']['covered']:.0%}, "
            f"hybridkv {row['hybridkv']['covered']:.0%}   cold TTFT hybridkv / vLLM alone: "
            f"median {ratio:.3f}, total {total:.3f}   short_of_state "
            f"{stats.get('short_of_state', '-')} of {stats.get('queried_tokens', '-')} queried",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"seed": args.seed, "lengths": lengths, "layouts": results}, indent=1)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
