"""Trace-replay hit-rate benchmark (issue 12): hybridkv, vLLM's own `OffloadingConnector`
(with hybridkv.vllm.offloading_cpu's CPU spec) and no connector, at equal CPU byte
budgets, on an engine whose own KV cache is small, so that vLLM's prefix cache cannot
keep conversations between turns.

Every (system, budget) runs in a fresh engine process (`python -m hybridkv.vllm.replay`),
so no run sees another's caches. Requests are replayed one at a time in trace order,
greedy, `--max-tokens` each (1 by default: the call's wall time is the TTFT). The
no-connector run does not depend on the budget and runs once per trace.

Reported per system and budget: token hit rate (cached / prompt tokens), split into
what vLLM's own prefix cache served (`local`) and what the connector loaded
(`connector`); requests with any hit; TTFT p50/p90; bytes the connector stored and
loaded; its raw counters (hybridkv: the scheduler side's snapshot, worker and tier stats,
admissions/refusals/evictions per group; vLLM: stores/evictions/loads per group). Also
the trace's `reuse_bound`: what an unbounded prefix cache of the engine's block size
could serve. Writes `<out>/hit_rate-<trace>.json` and `.png`.

    python bench/hit_rate.py                                 # chat, agentic, docqa
    python bench/hit_rate.py --traces agentic --budgets-mib 8 32
    python bench/hit_rate.py --traces mooncake:trace.jsonl:64 sharegpt:sg.json
    python bench/hit_rate.py --quick                         # ~2 min smoke run
    python bench/hit_rate.py --systems hybridkv@9fd6c59 hybridkv vllm-offload none
        # hybridkv at a git revision (its src/ extracted, with today's bench files) and
        # as this tree has it, side by side
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridkv.core.traces import Trace, make_trace, with_max_tokens

SYSTEMS = ("hybridkv", "vllm-offload", "none")
QUICK_TRACE = (
    "chat:sessions=4,turns=3,system_prompts=2,system_tokens=512,user_tokens=160,"
    "answer_tokens=96,concurrency=3"
)
MIB = 1 << 20


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Figures of one replay (`rows`: prompt, cached, local, external, seconds)."""
    rows = run["rows"]
    prompt = sum(r[0] for r in rows) or 1
    times = [r[4] for r in rows]
    conn = run.get("connector", {})
    return {
        "system": run["system"],
        "budget_bytes": run["budget"],
        "requests": len(rows),
        "prompt_tokens": prompt,
        "token_hit_rate": sum(r[1] for r in rows) / prompt,
        "local_hit_rate": sum(r[2] for r in rows) / prompt,
        "connector_hit_rate": sum(r[3] for r in rows) / prompt,
        "requests_with_hit": sum(1 for r in rows if r[1] > 0),
        "requests_with_connector_hit": sum(1 for r in rows if r[3] > 0),
        "ttft_p50_s": _percentile(times, 0.5),
        "ttft_p90_s": _percentile(times, 0.9),
        "stored_bytes": conn.get("stored_bytes"),
        "loaded_bytes": conn.get("loaded_bytes"),
        "replay_s": run["replay_s"],
        "startup_s": run["startup_s"],
    }


REPO = Path(__file__).resolve().parents[2]
# The measuring instrument: a snapshot of another revision runs with today's copies.
INSTRUMENT = ("bench_hit_rate.py", "core/traces.py", "vllm/replay.py", "vllm/offloading_cpu.py")


def snapshot(rev: str, tmp: Path) -> tuple[Path, str]:
    """hybridkv's source at git revision `rev` (with this tree's instrument files and
    built extensions) under `tmp`: (its src directory, the full commit id)."""
    import io
    import shutil
    import tarfile

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = tmp / f"src-{commit[:12]}"
    if not out.exists():
        tar = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", commit, "src"],
            capture_output=True,
            check=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(out, filter="data")
        here = REPO / "src" / "hybridkv"
        for rel in INSTRUMENT:
            shutil.copy(here / rel, out / "src" / "hybridkv" / rel)
        for ext in here.glob("*.so"):
            shutil.copy(ext, out / "src" / "hybridkv" / ext.name)
    return out / "src", commit


def source_of(rev: str | None) -> dict[str, Any]:
    """Which hybridkv a run used: a revision, or this tree (its HEAD and whether
    hybridkv's source differs from it)."""
    if rev is not None:
        return {"rev": rev}
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "src/hybridkv"], capture_output=True, text=True
    ).stdout
    return {
        "rev": "working tree",
        "head": head.strip(),
        "modified": dirty.splitlines(),
    }


def replay(
    spec: dict[str, Any], log: Path | None, pythonpath: Path | None = None
) -> dict[str, Any]:
    """One engine process; its output goes to `log` (the last lines on failure)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.vllm.replay"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        cwd=pythonpath or None,
    )
    out = proc.stdout + proc.stderr
    if log is not None:
        with open(log, "a") as f:
            f.write(f"==== {spec['system']} {spec['budget']}\n{out}\n")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"replay of {spec['system']} failed:\n{out[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def block_tokens(arch: str, size: str) -> int:
    """Tokens per vLLM block (the hit granularity) of this repo's models with prefix
    caching on, as measured on the CPU build: vLLM raises the attention block so a page
    holds the recurrent state."""
    return {("qwen3-next", "tiny"): 256, ("qwen3-next", "small"): 640}.get((arch, size), 16)


def run_trace(trace: Trace, args: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    path = tmp / f"{trace.name}.jsonl"
    trace.save(path)
    max_len = trace.max_prompt() + max(r.max_tokens for r in trace) + 16
    base = {
        "model": model,
        "trace": str(path),
        "kv_cache_bytes": int(args.kv_cache_mib * MIB),
        "max_model_len": max_len,
        "hybridkv_extra": json.loads(args.hybridkv_extra),
        "offload_extra": json.loads(args.offload_extra),
    }
    log = Path(args.log) if args.log else None
    runs, sources = [], {}
    for system in args.systems:
        pythonpath = None
        if system.startswith("hybridkv"):
            rev = system.partition("@")[2] or None
            sources[system] = source_of(rev)
            if rev is not None:
                pythonpath, sources[system]["commit"] = snapshot(rev, tmp)
        budgets = [0] if system == "none" else [int(b * MIB) for b in args.budgets_mib]
        for budget in budgets:
            t = time.perf_counter()
            run = replay({**base, "system": system, "budget": budget}, log, pythonpath)
            fig = summarize(run)
            print(
                f"  {trace.name:10} {system:18} {budget / MIB:6.0f} MiB"
                f"  hit {fig['token_hit_rate']:.3f}"
                f" (local {fig['local_hit_rate']:.3f}, connector {fig['connector_hit_rate']:.3f})"
                f"  p50 {fig['ttft_p50_s'] * 1e3:6.1f} ms  [{time.perf_counter() - t:.0f} s]",
                flush=True,
            )
            runs.append({"figures": fig, "raw": run})
    return {
        "trace": trace.summary(block_tokens(args.arch, args.size)),
        "trace_params": trace.params,
        "arch": args.arch,
        "size": args.size,
        "model": model,
        "kv_cache_bytes": base["kv_cache_bytes"],
        "max_model_len": max_len,
        "max_tokens": args.max_tokens,
        "hybridkv_extra": base["hybridkv_extra"],
        "offload_extra": base["offload_extra"],
        "replay": "sequential, one generate per request, greedy",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": os.uname().nodename,
        "hybridkv_source": sources,
        "runs": runs,
    }


def table(result: dict[str, Any]) -> str:
    t = result["trace"]
    lines = [
        f"{t['name']}: {t['requests']} requests, {t['prompt_tokens']} prompt tokens, "
        f"reuse bound {t['reuse_bound']:.3f} (block {t['block']})",
        f"{'system':18}{'MiB':>6}{'hit':>7}{'local':>7}{'conn':>7}{'req hit':>9}"
        f"{'p50 ms':>8}{'p90 ms':>8}{'stored MB':>11}{'loaded MB':>11}",
    ]
    for run in result["runs"]:
        f = run["figures"]
        mb = lambda v: f"{v / 1e6:11.1f}" if v is not None else f"{'-':>11}"  # noqa: E731
        lines.append(
            f"{f['system']:18}{f['budget_bytes'] / MIB:6.0f}{f['token_hit_rate']:7.3f}"
            f"{f['local_hit_rate']:7.3f}{f['connector_hit_rate']:7.3f}"
            f"{f['requests_with_hit']:>5}/{f['requests']:<3}"
            f"{f['ttft_p50_s'] * 1e3:8.1f}{f['ttft_p90_s'] * 1e3:8.1f}"
            f"{mb(f['stored_bytes'])}{mb(f['loaded_bytes'])}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    """Token hit rate against budget per system; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    figures = [r["figures"] for r in result["runs"]]
    budgets = sorted({f["budget_bytes"] for f in figures if f["system"] != "none"})
    for system in dict.fromkeys(f["system"] for f in figures):
        pts = sorted(
            (f["budget_bytes"] / MIB, f["token_hit_rate"], f["connector_hit_rate"])
            for f in figures
            if f["system"] == system
        )
        if not pts:
            continue
        if system == "none":
            xs = [b / MIB for b in budgets] or [pts[0][0]]
            ax.plot(xs, [pts[0][1]] * len(xs), ":", color="gray", label="no connector")
            continue
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=system)[0]
        ax.plot(
            [p[0] for p in pts],
            [p[2] for p in pts],
            "x--",
            color=line.get_color(),
            alpha=0.6,
            label=f"{system} (connector only)",
        )
    bound = result["trace"]["reuse_bound"]
    ax.axhline(bound, color="black", lw=0.8, ls="--", label="reuse bound")
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks([b / MIB for b in budgets], [f"{b / MIB:g}" for b in budgets])
        ax.minorticks_off()
    ax.set_xlabel("CPU budget (MiB)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    t = result["trace"]
    ax.set_title(
        f"{t['name']} ({t['requests']} req), {result['arch']}/{result['size']},"
        f" engine KV {result['kv_cache_bytes'] / MIB:.0f} MiB"
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _system(name: str) -> str:
    if name in SYSTEMS or (name.startswith("hybridkv@") and len(name) > 9):
        return name
    raise argparse.ArgumentTypeError(f"expected one of {SYSTEMS} or hybridkv@REV, got {name!r}")


def parser(results: Path) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--traces",
        nargs="+",
        default=["chat", "agentic", "docqa"],
        help="trace specs (hybridkv.core.traces.make_trace)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        type=_system,
        help="hybridkv, vllm-offload, none; hybridkv@REV: hybridkv's source at git revision REV",
    )
    p.add_argument("--budgets-mib", nargs="+", type=float, default=[4, 8, 16, 32, 64])
    p.add_argument("--arch", default="qwen3-next")
    p.add_argument("--size", default="tiny")
    p.add_argument("--model", help="model directory (default: made under $HYBRIDKV_HOME)")
    p.add_argument(
        "--kv-cache-mib",
        type=float,
        default=4,
        help="the engine's own KV cache (4 MiB: about 1.7 times the largest default request's"
        " blocks on qwen3-next/tiny)",
    )
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (cap)")
    p.add_argument("--limit", type=int, help="replay only the first N requests of each trace")
    p.add_argument(
        "--hybridkv-extra", default="{}", help="JSON merged into hybridkv's extra config"
    )
    p.add_argument(
        "--offload-extra", default="{}", help="JSON merged into vLLM's offloading extra config"
    )
    p.add_argument("--out-dir", type=Path, default=results)
    p.add_argument("--log", help="append every engine process's output to this file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small chat trace, 2 budgets, 2 MiB engine KV (~2 min)",
    )
    return p


def main(argv: list[str] | None = None, results: Path | None = None) -> int:
    args = parser(results or Path("bench/results")).parse_args(argv)
    if args.quick:
        args.traces, args.budgets_mib, args.kv_cache_mib = [QUICK_TRACE], [2, 8], 2
    from hybridkv.models import default_model_dir, make_model, model_config

    model = str(
        make_model(args.arch, args.model or default_model_dir(args.arch, args.size), args.size)
    )
    vocab = model_config(args.arch, args.size)["vocab_size"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hybridkv-hit-rate-") as tmp:
        for spec in args.traces:
            trace = with_max_tokens(make_trace(spec, vocab=vocab), args.max_tokens)
            if args.limit:
                trace = trace.head(args.limit)
            name = "quick" if args.quick else trace.name
            t = time.perf_counter()
            print(
                f"{name}: {len(trace)} requests, {trace.prompt_tokens()} prompt tokens", flush=True
            )
            result = run_trace(trace, args, model, Path(tmp))
            result["wall_s"] = time.perf_counter() - t
            out = args.out_dir / f"hit_rate-{name}.json"
            out.write_text(json.dumps(result, indent=1))
            png = out.with_suffix(".png")
            print(table(result))
            print(
                f"wrote {out}"
                + (f" and {png}" if plot(result, png) else " (no matplotlib: no plot)")
            )
            print(f"{name}: {result['wall_s']:.0f} s", flush=True)
    return 0
