"""Soak: an OpenAI-compatible vLLM server with hybridkv under a random mixed workload for
minutes, watching for what short tests miss: errors that build up, memory that grows,
entries that stay held, a hit rate that decays.

The server is the one users run (`python -m vllm.entrypoints.openai.api_server`, started
by tests/serving.py). Closed-loop clients, seeded, pick among:
  new        a fresh prompt
  document   one of a few shared documents plus a new question
  repeat     a prompt served before (its earlier output is the reference)
  turn       a conversation's next turn: previous prompt + its output + new text
  abort      a request abandoned mid-flight (a stream closed or a task cancelled)
and every so often a burst of many requests at once. Each interval records requests,
errors, aborts, latency, the server's RSS (all its processes) and the host memory hybridkv's
workers keep resident for entries (`vllm:hybridkv_host_memory_bytes`), vLLM's preemptions,
repeats whose output differs from their first (`Soak.check_repeat`) and hybridkv's
`hybridkv stats` log line (held entries, hit rate); JSON goes to bench/results/soak.json,
the server log beside it.

    .venv/bin/python bench/soak.py                      # 10 minutes, qwen3-next tiny
    .venv/bin/python bench/soak.py --minutes 1 --interval 10
    .venv/bin/python bench/soak.py --no-connector        # the same without hybridkv
    .venv/bin/python bench/soak.py --cpu-bytes 24MiB --disk-path /tmp/soak-disk --redis
                                      # every tier, CPU memory small enough to evict all along

`--redis` starts a redis-server of its own on loopback (tests/redis_servers.py) as the
shared tier, bounded by `--redis-bytes` and evicting least recently used keys, as a
production server is (without a bound it grew to 7 GB in 20 minutes: docs/benchmarks.md).
The summary adds the scheduler side's eviction, promotion and error counters, and with
`--redis` how often and how long the workers' Redis tiers were down (`redis_downtime`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from common import RESULTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import serving  # noqa: E402  (the test harness: one way to start and drive the server)
from redis_servers import redis_server  # noqa: E402

MAX_PROMPT = 3500  # max_model_len 4096 less room for the answer
KINDS = {"new": 0.2, "document": 0.25, "repeat": 0.2, "turn": 0.2, "abort": 0.15}


@dataclass
class Interval:
    """What happened between two samples."""

    t_s: float = 0.0
    ok: int = 0
    errors: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    repeats_compared: int = 0
    repeat_mismatches: int = 0
    cold_repeats_compared: int = 0  # of them, both served with nothing cached
    cold_repeat_mismatches: int = 0
    real_differences: int = 0  # logprobs moved past rounding (serving.real_difference)
    latencies_s: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    mismatch_samples: list[dict[str, int]] = field(default_factory=list)


class Workload:
    """The seeded random choices: prompts, kinds, delays. Holds what was served so that
    repeats and next turns can be built from it."""

    def __init__(self, seed: int, docs: int, doc_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.docs = [serving.tokens(doc_tokens, seed * 1000 + d) for d in range(docs)]
        self.served: dict[tuple[int, ...], serving.Completion] = {}
        self.conversations: list[list[int]] = []

    def text(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(1, 2000) for _ in range(self.rng.randint(lo, hi))]

    def kind(self) -> str:
        return self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]

    def prompt(self, kind: str) -> list[int]:
        if kind == "document":
            return self.rng.choice(self.docs) + self.text(20, 200)
        if kind == "repeat" and self.served:
            return list(self.rng.choice(list(self.served)))
        if kind == "turn" and self.conversations:
            prompt = self.conversations.pop(self.rng.randrange(len(self.conversations)))
            nxt = prompt + self.text(20, 200)
            if len(nxt) <= MAX_PROMPT:
                return nxt
        return self.text(100, 2500)

    def record(self, prompt: list[int], c: serving.Completion) -> None:
        self.served.setdefault(tuple(prompt), c)
        if len(prompt) + len(c.token_ids) < MAX_PROMPT:
            self.conversations.append(prompt + c.token_ids)
        if len(self.conversations) > 64:
            self.conversations.pop(0)


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length if one is a prefix)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


class Soak:
    def __init__(self, srv: serving.Server, wl: Workload, args: argparse.Namespace) -> None:
        self.srv = srv
        self.wl = wl
        self.args = args
        self.current = Interval()
        self.intervals: list[dict[str, Any]] = []
        self.client = srv.client(timeout=300)
        self.start = time.monotonic()
        self.deadline = self.start + args.minutes * 60
        self.log_offset = 0
        self.last_stats: dict[str, Any] | None = None
        self.stats_seen = 0
        self.idle_held: int | None = None

    # ---- requests ------------------------------------------------------------------------
    async def request(self, kind: str) -> None:
        """One request of `kind`; its outcome goes into the current interval."""
        prompt = self.wl.prompt(kind)
        if kind == "abort":
            await self.abort(prompt)
            return
        t = time.monotonic()
        try:
            c = await serving.complete(self.client, self.srv.model, prompt, self.args.max_tokens)
        except Exception as e:  # every failure counts; the soak goes on
            self.current.errors += 1
            if len(self.current.error_samples) < 5:
                self.current.error_samples.append(f"{type(e).__name__}: {e}"[:300])
            return
        self.current.latencies_s.append(time.monotonic() - t)
        self.current.ok += 1
        self.current.prompt_tokens += c.prompt_tokens
        self.current.cached_tokens += c.cached_tokens
        self.check_repeat(prompt, c)
        self.wl.record(prompt, c)

    def check_repeat(self, prompt: list[int], c: serving.Completion) -> None:
        """Count repeats whose output differs from their first: compared always on models
        without sliding windows, on Gemma-3 only at the same hit length (its CPU kernels
        round with where a hit ends). Greedy outputs part without a bug: CPU kernels
        round with the batch (on the Intel VM of docs/benchmarks.md, without hybridkv,
        14 % of Gemma-3's repeats and 6 % of Qwen3-Next's differ), a preempted request
        recomputes its output tokens as a prefill, and a next turn may restore a state
        hybridkv kept at a decode-time boundary; the tiny models' near-flat
        distributions turn such nudges into swapped tokens. Repeats served cold both
        times (`cold_...`) differ by the batch alone. What tells a wrong restore from
        rounding is the suite's rule (`serving.real_difference`): a chosen token's
        logprob moved by more than the kernels' rounding before the outputs part
        (`real_differences`, over every compared repeat); a near tie swapped is not one.
        Under the soak's load vLLM alone has some (Qwen3-Next: 8 of 667 repeats,
        mid-output, without hybridkv): compare the rate with a `--no-connector` run."""
        before = self.wl.served.get(tuple(prompt))
        if before is None or (
            self.args.arch == "gemma3" and before.cached_tokens != c.cached_tokens
        ):
            return
        cold = before.cached_tokens == c.cached_tokens == 0
        self.current.repeats_compared += 1
        self.current.cold_repeats_compared += cold
        real = serving.real_difference(before, c)
        self.current.real_differences += real is not None
        if before.token_ids != c.token_ids or real is not None:
            self.current.repeat_mismatches += before.token_ids != c.token_ids
            self.current.cold_repeat_mismatches += cold and before.token_ids != c.token_ids
            if len(self.current.mismatch_samples) < 5:
                self.current.mismatch_samples.append(
                    {
                        "prompt_tokens": len(prompt),
                        "first_cached": before.cached_tokens,
                        "cached": c.cached_tokens,
                        "first_difference": first_difference(before.token_ids, c.token_ids),
                        "real_difference": -1 if real is None else real,
                    }
                )

    async def abort(self, prompt: list[int]) -> None:
        """A client that gives up: half close a stream after a few chunks, half cancel."""
        rng = self.wl.rng
        try:
            if rng.random() < 0.5:
                await serving.stream_then_close(
                    self.client, self.srv.model, prompt, after=rng.randint(1, 6)
                )
            else:
                body = serving.complete(self.client, self.srv.model, prompt, 64, ignore_eos=True)
                await serving.cancel_after(body, rng.uniform(0.05, 2.0))
        except Exception as e:
            self.current.errors += 1
            if len(self.current.error_samples) < 5:
                self.current.error_samples.append(f"abort {type(e).__name__}: {e}"[:300])
            return
        self.current.aborted += 1

    async def client_loop(self) -> None:
        while time.monotonic() < self.deadline and self.srv.alive():
            await self.request(self.wl.kind())
            await asyncio.sleep(self.wl.rng.uniform(0, self.args.think_s))

    async def bursts(self) -> None:
        """Every so often, many requests at once (mixed kinds)."""
        while True:
            pause = self.wl.rng.uniform(0.5, 1.5) * self.args.burst_every_s
            await asyncio.sleep(max(0.0, min(pause, self.deadline - time.monotonic())))
            if time.monotonic() >= self.deadline or not self.srv.alive():
                return
            n = self.wl.rng.randint(self.args.burst // 2, self.args.burst)
            await asyncio.gather(*(self.request(self.wl.kind()) for _ in range(n)))

    # ---- samples -------------------------------------------------------------------------
    def read_stats(self) -> None:
        """The newest `hybridkv stats` record in the log since the last read."""
        with open(self.srv.log_path, errors="replace") as f:
            f.seek(self.log_offset)
            new = f.read()
            self.log_offset = f.tell()
        records = serving.hybridkv_stats(new.splitlines())
        if records:
            self.last_stats = records[-1]
            self.stats_seen += len(records)

    async def sample(self) -> dict[str, Any]:
        iv, self.current = self.current, Interval()
        iv.t_s = round(time.monotonic() - self.start, 1)
        self.read_stats()
        try:
            metrics = await self.srv.ametrics()
        except Exception:
            metrics = {}
        row = asdict(iv)
        lat = row.pop("latencies_s")
        row["p50_latency_s"] = round(statistics.median(lat), 3) if lat else None
        row["max_latency_s"] = round(max(lat), 3) if lat else None
        by_process = self.srv.rss_by_process()
        row["rss_mib"] = round(sum(by_process.values()) / serving.MiB, 1)
        row["rss_mib_by_process"] = {k: round(v / serving.MiB, 1) for k, v in by_process.items()}
        row["alive"] = self.srv.alive()
        row["preemptions_total"] = metrics.get("vllm:num_preemptions_total")
        row["running"] = metrics.get("vllm:num_requests_running")
        row["waiting"] = metrics.get("vllm:num_requests_waiting")
        host = metrics.get("vllm:hybridkv_host_memory_bytes")  # resident for entries
        row["host_pool_mib"] = round(host / serving.MiB, 1) if host is not None else None
        row["hybridkv"] = self.last_stats
        self.intervals.append(row)
        print(format_row(row, self.intervals), flush=True)
        return row

    async def sampler(self) -> None:
        while time.monotonic() < self.deadline and self.srv.alive():
            await asyncio.sleep(min(self.args.interval, max(0.1, self.deadline - time.monotonic())))
            await self.sample()

    async def run(self) -> None:
        print(HEADER, flush=True)
        tasks = [self.client_loop() for _ in range(self.args.clients)]
        await asyncio.gather(self.sampler(), self.bursts(), *tasks)
        await self.sample()  # what finished after the last tick
        self.idle_held = await self.held_once_idle()
        await self.client.close()

    async def held_once_idle(self, timeout_s: float = 120) -> int | None:
        """Entries still pinned once no request is left (any is a leaked pin), None if the
        server never went idle, logged no record or failed meanwhile (the run's rows say
        whether it died). The scheduler side logs its stats at most every 10 s and only
        while the engine steps, so once vLLM reports nothing running or waiting, prompts
        shorter than a chunk (nothing to hit or store, so no pins of their own) keep it
        stepping until the next record."""
        try:
            return await self._held_once_idle(time.monotonic() + timeout_s)
        except Exception as e:
            print(f"no figure for the entries pinned once idle: {e!r}", flush=True)
            return None

    async def _held_once_idle(self, end: float) -> int | None:
        while time.monotonic() < end and self.srv.alive():
            m = await self.srv.ametrics()
            if not m.get("vllm:num_requests_running") and not m.get("vllm:num_requests_waiting"):
                break
            await asyncio.sleep(1)
        else:
            return None
        self.read_stats()
        seen = self.stats_seen
        while time.monotonic() < end and self.srv.alive():
            await serving.complete(self.client, self.srv.model, IDLE_PROMPT, 1)
            self.read_stats()
            if self.stats_seen > seen and self.last_stats is not None:
                return self.last_stats.get("held_entries")
            await asyncio.sleep(1)
        return None


IDLE_PROMPT = list(range(1, 9))  # shorter than any model's chunk


HEADER = (
    f"{'t s':>7}{'ok':>6}{'err':>5}{'abort':>6}{'p50 s':>7}{'cached%':>8}{'hkv hit%':>9}"
    f"{'held':>6}{'entries':>8}{'RSS MiB':>9}{'pool MiB':>9}{'preempt':>8}{'mism':>5}"
)


def hit_rate(prev: dict | None, cur: dict | None) -> float | None:
    """hybridkv's hit tokens over queried tokens between two stats records."""
    if not cur:
        return None
    p = prev or {}
    queried = cur.get("queried_tokens", 0) - p.get("queried_tokens", 0)
    hits = cur.get("hit_tokens", 0) - p.get("hit_tokens", 0)
    return 100 * hits / queried if queried > 0 else None


def cpu_entries(stats: dict | None) -> int | None:
    """Entries in the workers' CPU memory, as the scheduler side's index counts them."""
    return (stats or {}).get("cpu_entries")


def format_row(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    prev = rows[-2]["hybridkv"] if len(rows) > 1 else None
    stats = row["hybridkv"]
    hr = hit_rate(prev, stats)
    cached = 100 * row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0
    return (
        f"{row['t_s']:7.0f}{row['ok']:6}{row['errors']:5}{row['aborted']:6}"
        f"{_num(row['p50_latency_s'], 7, 2)}{cached:8.1f}{_num(hr, 9, 1)}"
        f"{_num((stats or {}).get('held_entries'), 6, 0)}{_num(cpu_entries(stats), 8, 0)}"
        f"{row['rss_mib']:9.0f}{_num(row['host_pool_mib'], 9, 0)}"
        f"{_num(row['preemptions_total'], 8, 0)}"
        f"{row['repeat_mismatches']:5}"
    )


def _num(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def totals(intervals: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("ok", "errors", "aborted", "prompt_tokens", "cached_tokens")
    out: dict[str, Any] = {k: sum(r[k] for r in intervals) for k in keys}
    repeats = ("repeats_compared", "repeat_mismatches")
    for k in (*repeats, *(f"cold_{k}" for k in repeats), "real_differences"):
        out[k] = sum(r[k] for r in intervals)
    sampled = [r for r in intervals if r["rss_mib"]]  # the server was up
    if sampled:
        rss = [r["rss_mib"] for r in sampled]
        out["rss_mib_first"], out["rss_mib_last"], out["rss_mib_max"] = rss[0], rss[-1], max(rss)
        first, last = sampled[0]["rss_mib_by_process"], sampled[-1]["rss_mib_by_process"]
        out["rss_mib_by_process"] = {k: (first.get(k), v) for k, v in last.items()}
        pool = [r["host_pool_mib"] for r in sampled]
        out["host_pool_mib_first"], out["host_pool_mib_last"] = pool[0], pool[-1]
    stats = [r["hybridkv"] for r in intervals if r["hybridkv"]]
    if stats:
        out["hybridkv_hit_rate_pct"] = hit_rate(None, stats[-1])
        out["held_entries_last"] = stats[-1].get("held_entries")
        out["held_entries_max"] = max(s.get("held_entries", 0) for s in stats)
        out.update({key: stats[-1].get(key) for key in COUNTERS})
    return out


# The scheduler side's counters the summary shows (its `hybridkv stats` record): the tiers
# at work, and anything that went wrong on its side.
COUNTERS = (
    "cpu_evictions",
    "cpu_full",
    "lookups_by_tier",
    "promoted_from",
    "failed_promotions",
    "hook_errors",
)


def start(args: argparse.Namespace, redis_url: str | None) -> serving.Server:
    from hybridkv.models import model_for

    model = model_for(args.arch, args.size, args.model)
    extra: dict[str, Any] = {"cpu_bytes": args.cpu_bytes}
    if args.disk_path:
        extra.update(disk_path=args.disk_path, disk_bytes=args.disk_bytes)
    if redis_url:
        extra.update(redis_url=redis_url)
    return serving.start_server(
        str(model),
        args.log,
        extra,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        extra_args=("--shutdown-timeout", "30"),
        connector=not args.no_connector,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3-next", choices=["qwen3-next", "gemma3", "qwen3"])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--model", help="model directory (default: made under $HYBRIDKV_HOME)")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=float, default=30, help="seconds between samples")
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients")
    p.add_argument("--think-s", type=float, default=0.5, help="max pause between requests")
    p.add_argument("--burst", type=int, default=32, help="largest burst (requests at once)")
    p.add_argument("--burst-every-s", type=float, default=45)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--docs", type=int, default=8, help="shared documents")
    p.add_argument("--doc-tokens", type=int, default=1200)
    p.add_argument("--kv-cache-bytes", type=int, default=32 << 20, help="vLLM's KV cache")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--cpu-bytes", default="256MiB")
    p.add_argument("--disk-path", help="hybridkv disk tier directory (default: off)")
    p.add_argument("--disk-bytes", default="2GiB")
    p.add_argument("--redis", action="store_true", help="a redis-server of its own as shared tier")
    p.add_argument(
        "--redis-bytes",
        default="1gb",
        help="its maxmemory (evicting allkeys-lru, as README asks of a shared tier)",
    )
    p.add_argument(
        "--no-connector", action="store_true", help="the same server without hybridkv (baseline)"
    )
    p.add_argument("--json", type=Path, default=RESULTS / "soak.json")
    p.add_argument("--log", type=Path, default=RESULTS / "soak-server.log")
    args = p.parse_args()

    with contextlib.ExitStack() as stack:
        redis_url = None
        if args.redis:
            bound = ("--maxmemory", args.redis_bytes, "--maxmemory-policy", "allkeys-lru")
            redis_url = stack.enter_context(redis_server(*bound)).url
        srv = start(args, redis_url)
        soak = Soak(srv, Workload(args.seed, args.docs, args.doc_tokens), args)
        try:
            asyncio.run(soak.run())
        finally:
            code = srv.stop()
    log_lines = srv.log_lines()
    problems = serving.log_problems(log_lines)
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": os.uname().nodename,
        "totals": totals(soak.intervals),
        "intervals": soak.intervals,
        "server": {
            "exit_code": code,
            "died": any(not r["alive"] for r in soak.intervals),
            "log": str(args.log),
            "log_problem_lines": len(problems),
            "log_problems": problems[:40],
            "hybridkv_stats_records": soak.stats_seen,
            "held_entries_once_idle": soak.idle_held,
            "redis_down": redis_downtime(log_lines) if args.redis else None,
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print_summary(result)
    print(f"wrote {args.json}; server log {args.log}")


_TIER_CHANGE = re.compile(
    r"^\((?P<proc>Worker[^)]*)\) \S+ (?P<at>\d\d-\d\d \d\d:\d\d:\d\d) .*"
    r"hybridkv: Redis tier at \S+ (?P<what>down:|up again)"
)


def redis_downtime(lines: list[str]) -> dict[str, float]:
    """How often the workers' Redis tiers went down and for how long in all, up again
    (seconds, at the log's 1 s resolution), and how many were down when the log ended:
    read from the server log, where the tier logs each change."""
    down_since: dict[str, datetime] = {}
    falls, down_s = 0, 0.0
    for line in lines:
        m = _TIER_CHANGE.match(line)
        if m is None:
            continue
        at = datetime.strptime(m["at"], "%m-%d %H:%M:%S")
        if m["what"] == "down:":
            falls += 1
            down_since.setdefault(m["proc"], at)
        elif m["proc"] in down_since:
            down_s += (at - down_since.pop(m["proc"])).total_seconds()
    return {"falls": falls, "down_s": down_s, "down_at_end": len(down_since)}


def print_summary(result: dict[str, Any]) -> None:
    t, s = result["totals"], result["server"]
    cached = 100 * t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0
    rows = [
        ("requests ok / errors / aborted", f"{t['ok']} / {t['errors']} / {t['aborted']}"),
        ("prompt tokens cached (vLLM + hybridkv)", f"{cached:.1f}%"),
        ("hybridkv hit rate (hit / queried tokens)", _pct(t.get("hybridkv_hit_rate_pct"))),
        (
            "held entries last / max",
            f"{t.get('held_entries_last', '-')} / {t.get('held_entries_max', '-')}",
        ),
        (
            "server RSS MiB first / last / max",
            f"{t.get('rss_mib_first', '-')} / {t.get('rss_mib_last', '-')} / "
            f"{t.get('rss_mib_max', '-')}",
        ),
        *(
            (f"  {name} first / last", f"{a} / {b}")
            for name, (a, b) in t.get("rss_mib_by_process", {}).items()
        ),
        (
            "  of it, the workers' pools of entries (host_memory_bytes) first / last",
            f"{t.get('host_pool_mib_first', '-')} / {t.get('host_pool_mib_last', '-')}",
        ),
        ("repeats compared / mismatched", f"{t['repeats_compared']} / {t['repeat_mismatches']}"),
        (
            "  of them cold (nothing cached)",
            f"{t['cold_repeats_compared']} / {t['cold_repeat_mismatches']}",
        ),
        ("  logprobs moved past 0.02 (see --no-connector)", str(t["real_differences"])),
        ("server exit code / died", f"{s['exit_code']} / {s['died']}"),
        ("error lines in server log", str(s["log_problem_lines"])),
        ("hybridkv stats records seen", str(s["hybridkv_stats_records"])),
        ("held entries once idle (must be 0)", str(s.get("held_entries_once_idle", "-"))),
        *(
            [
                (
                    "Redis down on the workers: falls / s / at end",
                    f"{d['falls']} / {d['down_s']:.0f} / {d['down_at_end']}",
                )
            ]
            if (d := s.get("redis_down"))
            else []
        ),
        *((key.replace("_", " "), str(t.get(key, "-"))) for key in COUNTERS),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


if __name__ == "__main__":
    main()
