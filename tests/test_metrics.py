"""The vllm:hybridkv_* metrics: reports that merge over ranks and steps without going
negative (unit), the figures on a real server's /metrics against what its requests
showed and what its disk tier wrote, and the `metrics_port` server of an offline engine.
About 90 s on 2 cores (one server, one in-process engine)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import SEED, tokens
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families
from serving import (
    Server,
    cancel_after,
    complete,
    drawn_lengths,
    gather_all,
    start_server,
    stream_then_close,
)

from hybridkv.core import metrics
from hybridkv.vllm.metrics import METRICS, HybridKVPromMetrics, HybridKVStats

Scrape = dict[tuple[str, str], float]
HEADER_BYTES = 64  # docs/format.md: an entry file is the header and the payload (no MAC)


def parse(text: str) -> Scrape:
    """{(sample name, tier): value summed over the other labels} of vLLM's metrics;
    histogram buckets and creation times left out."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("vllm:") or s.name.endswith(("_bucket", "_created")):
                continue
            key = (s.name, s.labels.get("tier", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(url: str) -> Scrape:
    r = httpx.get(url, timeout=30)
    r.raise_for_status()
    return parse(r.text)


def delta(after: Scrape, before: Scrape, name: str, tier: str = "") -> float:
    return after.get((name, tier), 0.0) - before.get((name, tier), 0.0)


def hkv(name: str) -> str:
    """The sample name of a metric of METRICS (counters get `_total`)."""
    return f"vllm:hybridkv_{name}" + ("_total" if METRICS[name][0] is Counter else "")


def assert_none_negative(s: Scrape) -> None:
    bad = {k: v for k, v in s.items() if k[0].startswith("vllm:hybridkv_") and v < 0}
    assert not bad, bad


def assert_counters_grew(after: Scrape, before: Scrape) -> None:
    shrunk = {
        k: (before[k], v)
        for k, v in after.items()
        if k[0].startswith("vllm:hybridkv_") and k[0].endswith("_total") and v < before.get(k, 0)
    }
    assert not shrunk, shrunk


# ---- reports: increases, merging, clamping (no engine) -----------------------------------------
@given(st.lists(st.integers(0, 10**6), max_size=30))
def test_reporter_reports_every_increase_and_never_a_decrease(totals: list[int]) -> None:
    """A total that goes back (a reading that failed: a tier's `stats` answers zeros
    after a fault) counts nothing, and its history is not counted again when the real
    total returns: the sum of the reports is the highest total read, each report
    non-negative."""
    reporter = metrics.Reporter("rank0")
    reported = []
    for t in totals:
        report = reporter.report({"stored_bytes": {"cpu": t}})
        reported.append(report["counters"].get("stored_bytes", {}).get("cpu", 0))
    assert all(r >= 0 for r in reported)
    assert sum(reported) == max(totals, default=0)


report_st = st.fixed_dictionaries(
    {
        "counters": st.dictionaries(
            st.sampled_from(["hit_tokens", "stored_bytes"]),
            st.dictionaries(st.sampled_from(["cpu", "disk"]), st.integers(-5, 100), max_size=2),
            max_size=2,
        ),
        "gauges": st.dictionaries(
            st.sampled_from(["occupancy_bytes", "tier_up"]),
            st.dictionaries(
                st.sampled_from(["rank0", "rank1", "scheduler"]),
                st.dictionaries(st.sampled_from(["cpu", "disk"]), st.integers(0, 9), max_size=2),
                max_size=3,
            ),
            max_size=2,
        ),
        "histograms": st.dictionaries(
            st.just("load_seconds"),
            st.dictionaries(
                st.sampled_from(["cpu", "disk"]), st.lists(st.floats(0, 10), max_size=3)
            ),
            max_size=1,
        ),
    }
)


@given(st.lists(report_st, min_size=1, max_size=6))
def test_merged_reports_sum_counters_keep_newest_gauges_and_clamp(reports: list[dict]) -> None:
    """vLLM merges the ranks' reports, then the scheduler side's, then consecutive steps
    (`aggregate`): counters add up with negative increments counted as 0, every
    observation is kept, each source's newest gauge wins; occupancy adds up over
    sources, a tier is up only where every source has it up."""
    merged = HybridKVStats()
    for r in reports:
        merged = merged.aggregate(HybridKVStats(data=json.loads(json.dumps(r))))
    for name in ("hit_tokens", "stored_bytes"):
        for tier in ("cpu", "disk"):
            want = sum(max(r["counters"].get(name, {}).get(tier, 0), 0) for r in reports)
            assert merged.data["counters"].get(name, {}).get(tier, 0) == want
    for tier in ("cpu", "disk"):
        want_obs = [
            v for r in reports for v in r["histograms"].get("load_seconds", {}).get(tier, [])
        ]
        assert merged.data["histograms"].get("load_seconds", {}).get(tier, []) == want_obs
    newest: dict[str, dict[str, dict[str, int]]] = {}
    for r in reports:
        for name, by_source in r["gauges"].items():
            for source, by_tier in by_source.items():
                newest.setdefault(name, {}).setdefault(source, {}).update(by_tier)
    values = metrics.gauge_values(merged.data["gauges"])
    for name, by_source in newest.items():
        for tier in ("cpu", "disk"):
            vs = [by_tier[tier] for by_tier in by_source.values() if tier in by_tier]
            if vs:
                assert values[name][tier] == (min(vs) if name == "tier_up" else sum(vs))
    assert merged.is_empty() == all(metrics.is_empty(r) for r in reports)
    assert all(v >= 0 for k, v in merged.reduce().items() if not k.endswith(".mean"))


def prom(registry: CollectorRegistry, disk: Path) -> HybridKVPromMetrics:
    """The metrics of an engine with CPU and disk tiers, on `registry`."""
    extra = {"disk_path": str(disk)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    types = {
        Counter: lambda **kw: Counter(registry=registry, **kw),
        Gauge: lambda **kw: Gauge(registry=registry, **kw),
        Histogram: lambda **kw: Histogram(registry=registry, **kw),
    }
    return HybridKVPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})


def value(registry: CollectorRegistry, name: str, tier: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", "tier": tier})


def test_prometheus_never_sees_a_negative_increment_and_bad_reports_are_skipped(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """prometheus_client raises on a negative increment (a metrics logger once crashed
    so): hybridkv clamps it, logs it, and records the rest; a report it cannot read is
    logged and skipped, never raised into vLLM."""
    registry = CollectorRegistry()
    p = prom(registry, tmp_path)
    assert value(registry, "vllm:hybridkv_hit_tokens_total", "cpu") == 0  # starts at 0
    with caplog.at_level(logging.DEBUG, logger="hybridkv"):  # repeats log at debug
        p.observe({"counters": {"hit_tokens": {"cpu": 256, "disk": -7}}})
        p.observe({"counters": {"no_such_metric": {"cpu": 1}}})
        p.observe({"counters": {"hit_tokens": {"cpu": "many"}}})
    assert value(registry, "vllm:hybridkv_hit_tokens_total", "cpu") == 256
    assert value(registry, "vllm:hybridkv_hit_tokens_total", "disk") == 0
    assert "went back" in caplog.text and "recording metrics failed" in caplog.text


def test_gauges_sum_over_ranks_that_report_only_changes(tmp_path: Path) -> None:
    """A rank reports a gauge only when it changed: the figure is still the sum of every
    rank's latest value."""
    registry = CollectorRegistry()
    p = prom(registry, tmp_path)
    ranks = [metrics.Reporter("rank0"), metrics.Reporter("rank1")]
    step = [
        r.report({}, {"occupancy_bytes": {"cpu": n}}) for r, n in zip(ranks, (10, 5), strict=True)
    ]
    p.observe(metrics.merge(metrics.merge(metrics.empty(), step[0]), step[1]))
    assert value(registry, "vllm:hybridkv_occupancy_bytes", "cpu") == 15
    p.observe(ranks[1].report({}, {"occupancy_bytes": {"cpu": 7}}))  # rank 0 unchanged
    assert metrics.is_empty(ranks[0].report({}, {"occupancy_bytes": {"cpu": 10}}))
    assert value(registry, "vllm:hybridkv_occupancy_bytes", "cpu") == 17


# ---- a real server -----------------------------------------------------------------------------
# A prompt length drawn, not chosen (the seed is in the run's header).
(PROMPT,) = drawn_lengths(1, seed=SEED * 100 + 7)
# The preemption workload, sized so that the requests cannot all run (by construction,
# not by how steps happen to interleave): documents of which hybridkv restores 512 tokens,
# each asked several questions at once; a prompt (756 tokens) ends 12 tokens before a
# block boundary (768), so every request needs another block on its 12th generated token,
# and its recurrent groups another while vLLM moves their running states on. vLLM's pool
# here is 39 blocks (5 MiB of 128 KiB pages); each request holds 7 once past the boundary
# (4 attention, one per GDN group). So the 12 requests that run to the end need 84, more
# than twice the pool: vLLM admits as many as fit (about five, as they arrive within
# milliseconds and each runs for 32 steps), and those cannot all cross the boundary.
DOC, QUESTION, PREEMPT_KV_BYTES, PREEMPT_TOKENS = 600, 156, 5 << 20, 32


def disk_entries(disk: Path) -> tuple[dict, dict[int, list[int]]]:
    """The layout the disk tier wrote (layout.json) and its entry files' sizes by group
    (a file's name ends with its group id, docs/format.md)."""
    (layout_file,) = disk.glob("*/layout.json")
    sizes: dict[int, list[int]] = {}
    for f in layout_file.parent.glob("*/*.kv"):
        sizes.setdefault(int(f.stem[-4:], 16), []).append(f.stat().st_size)
    return json.loads(layout_file.read_text()), sizes


async def _complete_all(srv: Server, prompts: list[list[int]], **kw) -> list:
    async with srv.client() as client:
        return await gather_all([complete(client, srv.model, p, **kw) for p in prompts])


async def _with_hangups(srv: Server, prompts: list[list[int]], leaving: list[list[int]]) -> list:
    """`prompts` to the end, all at once, and `leaving` abandoned meanwhile: half hang up
    mid-stream, half are cancelled mid-load or mid-prefill."""
    async with srv.client() as client:
        jobs = [
            complete(client, srv.model, p, max_tokens=PREEMPT_TOKENS, ignore_eos=True)
            for p in prompts
        ]
        for i, p in enumerate(leaving):
            if i % 2:
                jobs.append(stream_then_close(client, srv.model, p, after=2))
            else:
                body = complete(client, srv.model, p, max_tokens=64, ignore_eos=True)
                jobs.append(cancel_after(body, 0.3 + 0.2 * i))
        return await gather_all(jobs)


@pytest.mark.engine
def test_server_metrics_match_what_happened(model_dirs, tmp_path: Path) -> None:
    """Through vLLM's OpenAI server (Qwen3-Next, CPU and disk tiers):

    1. A prompt stored, vLLM's own prefix cache emptied, the prompt again: hybridkv's hit
       tokens are exactly the request's `cached_tokens` beyond vLLM's own prefix hits
       (here none), and vLLM's `external_prefix_cache_hits`; the bytes stored are the
       sizes of the entry files the disk tier wrote, the bytes loaded those of the entries
       a hit at that boundary reads (every attention chunk below it, each recurrent
       group's state at it).
    2. Many requests at once on a KV cache that holds a few, while clients hang up:
       vLLM preempts, and no hybridkv figure is negative or shrinks; hybridkv's hit tokens
       are at least vLLM's external hits (vLLM leaves out re-admitted preempted requests,
       hybridkv restores them again); no entry stays held once the requests are done."""
    disk = tmp_path / "kv"
    srv = start_server(
        model_dirs["qwen3-next"],
        tmp_path / "server.log",
        {"disk_path": str(disk), "disk_bytes": "1GiB"},
        kv_cache_bytes=PREEMPT_KV_BYTES,
    )
    url = srv.base_url + "/metrics"
    try:
        m0 = scrape(url)
        for name in METRICS:  # the counters and histograms are there before any request
            if METRICS[name][0] is not Gauge:
                assert any(k[0].startswith(f"vllm:hybridkv_{name}") for k in m0), name
        prompt = tokens(PROMPT, seed=7)
        (first,) = asyncio.run(_complete_all(srv, [prompt]))
        m1 = scrape(url)
        srv.reset_prefix_cache()
        (second,) = asyncio.run(_complete_all(srv, [prompt]))
        m2 = scrape(url)

        # Hits: what the server told the client, less vLLM's own prefix hits.
        assert first.cached_tokens == 0
        hit = delta(m2, m1, hkv("hit_tokens"), "cpu")
        local = delta(m2, m1, "vllm:prefix_cache_hits_total")
        assert hit > 0 and hit == second.cached_tokens - local
        assert hit == delta(m2, m1, "vllm:external_prefix_cache_hits_total")
        assert delta(m1, m0, hkv("lookups"), "none") == 1
        assert delta(m2, m1, hkv("lookups"), "cpu") == 1
        assert delta(m2, m1, hkv("miss_tokens"), "none") == PROMPT - second.cached_tokens

        # Bytes: the entry files' payloads.
        layout, sizes = disk_entries(disk)
        payloads = {g: [s - HEADER_BYTES for s in v] for g, v in sizes.items()}
        stored = delta(m1, m0, hkv("stored_bytes"), "cpu")
        assert (
            stored == sum(map(sum, payloads.values())) == delta(m1, m0, hkv("stored_bytes"), "disk")
        )
        groups = layout["layout"]["groups"]
        chunk = max(g["block_tokens"] for g in groups)
        per_entry = {g: set(v) for g, v in payloads.items()}
        assert all(len(v) == 1 for v in per_entry.values()), per_entry  # one size a group
        want = sum(
            next(iter(per_entry[g])) * (hit // chunk if spec["kind"] == "full" else 1)
            for g, spec in enumerate(groups)
        )
        assert delta(m2, m1, hkv("loaded_bytes"), "cpu") == want
        assert delta(m2, m1, hkv("load_seconds") + "_count", "cpu") == 1
        assert m2[hkv("occupancy_bytes"), "cpu"] == m2[hkv("stored_bytes"), "cpu"]
        # The CPU tier's entries live in the pool's slabs (which it keeps at their peak).
        assert m2[hkv("host_memory_bytes"), "cpu"] >= m2[hkv("occupancy_bytes"), "cpu"] > 0
        assert m2[hkv("tier_up"), "cpu"] == m2[hkv("tier_up"), "disk"] == 1

        # Preemptions and clients that hang up.
        docs = [tokens(DOC, seed=100 + d) for d in range(4)]
        prompts = [
            d + tokens(QUESTION, seed=200 + 4 * q + i) for q in range(3) for i, d in enumerate(docs)
        ]
        leaving = [d + tokens(QUESTION, seed=300 + i) for i, d in enumerate(docs)]
        results = asyncio.run(_complete_all(srv, prompts[: len(docs)], max_tokens=1))
        srv.reset_prefix_cache()
        m3 = scrape(url)
        results += asyncio.run(_with_hangups(srv, prompts, leaving))
        m4 = scrape(url)
        assert_none_negative(m4)
        assert_counters_grew(m4, m3)
        assert_counters_grew(m3, m2)
        failed = [r for r in results[: len(docs) + len(prompts)] if isinstance(r, BaseException)]
        assert not failed, failed[:3]
        assert delta(m4, m3, "vllm:num_preemptions_total") > 0, "no preemption: shrink the cache"
        assert (
            delta(m4, m3, hkv("hit_tokens"), "cpu")
            >= delta(m4, m3, "vllm:external_prefix_cache_hits_total")
            > 0
        )
        # One more request runs steps after the hang-ups: what they held is released.
        asyncio.run(_complete_all(srv, [tokens(20, seed=9)], max_tokens=2))
        m5 = scrape(url)
        assert m5[hkv("held_entries"), "cpu"] == 0
        assert m5[hkv("host_memory_bytes"), "cpu"] >= m2[hkv("host_memory_bytes"), "cpu"]
        assert_none_negative(m5)
    finally:
        srv.stop()
    problems = [
        ln for ln in srv.log_lines() if "hybridkv" in ln and (" ERROR " in ln or "went back" in ln)
    ]
    assert not problems, problems[:10]


# ---- metrics_port: an offline engine -----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.engine
def test_metrics_port_serves_an_offline_engine(model_dirs, engine_factory) -> None:
    """An offline LLM (stats logging off, so vLLM drops connector stats) serves the same
    metric names on `metrics_port` from the scheduler side's process, counting the
    worker's figures too; a second server on a port in use is a warning, not an error."""
    from hybridkv.engine import generate, scheduler_connector
    from hybridkv.vllm.metrics import start_metrics_server

    port = _free_port()
    llm = engine_factory(model_dirs["qwen3-next"], {"cpu_bytes": "256MiB", "metrics_port": port})
    prompt = tokens(PROMPT, seed=8)
    generate(llm, [prompt])
    llm.reset_prefix_cache()
    (again,) = generate(llm, [prompt])
    got = scrape(f"http://127.0.0.1:{port}/metrics")
    assert again.num_cached_tokens > 0
    assert got[hkv("hit_tokens"), "cpu"] == again.num_cached_tokens
    connector = scheduler_connector(llm)
    planner = connector.planner
    chunks = again.num_cached_tokens // planner.chunk_tokens
    want = sum(
        planner.entry_bytes(g) * (chunks if spec.kind.value == "full" else 1)
        for g, spec in enumerate(planner.groups)
    )
    assert got[hkv("loaded_bytes"), "cpu"] == want
    assert got[hkv("stored_bytes"), "cpu"] >= want
    assert got[hkv("held_entries"), "cpu"] == 0
    assert_none_negative(got)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("hybridkv.vllm.metrics")
    logger.addHandler(handler)
    try:
        assert start_metrics_server(connector._vllm_config, port) is None
    finally:
        logger.removeHandler(handler)
    assert any(r.levelno == logging.WARNING and "metrics_port" in r.getMessage() for r in records)


def _listens(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(10)
        return s.connect_ex((host, port)) == 0


@pytest.mark.skipif(sys.platform != "linux", reason="uses 127.0.0.2, Linux's loopback")
@pytest.mark.parametrize(
    ("metrics_host", "serves_on", "not_on"),
    [
        (None, "127.0.0.1", "127.0.0.2"),  # the default: this machine's loopback alone
        ("127.0.0.2", "127.0.0.2", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.2", None),  # every address
    ],
)
def test_metrics_server_binds_loopback_unless_a_host_is_given(
    metrics_host: str | None, serves_on: str, not_on: str | None
) -> None:
    """`metrics_port` is served on 127.0.0.1 unless `metrics_host` says otherwise: the
    server answers on the address bound and refuses connections on another one (Linux
    answers for all of 127.0.0.0/8 on its loopback)."""
    from hybridkv.core.config import HybridKVConfig
    from hybridkv.vllm.metrics import start_metrics_server

    extra: dict[str, object] = {"metrics_port": _free_port()}
    if metrics_host is not None:
        extra["metrics_host"] = metrics_host
    config = HybridKVConfig.from_dict(extra, env={})
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        model_config=SimpleNamespace(served_model_name="m"),
    )
    server = start_metrics_server(vllm_config, config.metrics_port, config.metrics_host)
    assert server is not None
    try:
        reply = httpx.get(f"http://{serves_on}:{config.metrics_port}/metrics", timeout=30)
        assert reply.status_code == 200 and "vllm:hybridkv_lookups" in reply.text
        assert not_on is None or not _listens(not_on, config.metrics_port)
    finally:
        server.close()


def test_a_lookup_is_counted_once_vllm_allocates_for_it(tmp_path_factory):
    """vLLM's real scheduler asks a waiting request's lookup again every step until it
    can allocate its blocks: a KV cache of 32 blocks, held by a long request, leaves the
    second no room until the first ends (checked: it was asked many times). Each prompt's
    tokens are counted once, when vLLM allocates, as vLLM counts its own connector
    queries."""
    from test_async_scheduling import Engine, _prompt, config_dir

    eng = Engine(config_dir(tmp_path_factory), False, num_blocks=32)
    side = eng.side
    asked: dict[str, int] = {}
    lookup = side.num_new_matched_tokens

    def counted(request, local_tokens):
        asked[request.request_id] = asked.get(request.request_id, 0) + 1
        return lookup(request, local_tokens)

    side.num_new_matched_tokens = counted
    eng.add("a", _prompt(200, 1), max_tokens=60)
    eng.step()
    eng.step()
    eng.add("b", _prompt(200, 2), max_tokens=2)
    eng.run()
    assert asked["b"] > 2, asked  # it waited for room, asked every step
    assert side.stats.lookups == 2 and side.stats.lookups_by_tier == {"none": 2}
    assert side.stats.queried_tokens == side.stats.miss_tokens == 400
    eng.check_settled()


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "under-MultiConnector"])
def test_every_stats_message_carries_every_ranks_gauges(tmp_path_factory, multi):
    """vLLM hands a step's stats to one front end only (`--api-server-count` > 1), and a
    rank reports a gauge only when it changed: each message carries every rank's latest
    gauges whenever one changed, so whichever front end gets it sums all ranks. Under
    MultiConnector the workers' stats reach `update_connector_output` in its
    per-connector map, which must be looked into."""
    from test_async_scheduling import _configs, config_dir
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorStats,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from hybridkv.core import metrics as core
    from hybridkv.vllm.connector import HybridKVConnector
    from hybridkv.vllm.metrics import HybridKVStats

    vllm_config, kv_cache_config = _configs(config_dir(tmp_path_factory), False)
    conn = HybridKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    ranks = [core.Reporter("rank0"), core.Reporter("rank1")]
    fronts = [core.empty(), core.empty()]  # what each front end has merged

    def step(front: int, occupancy: tuple[int, int]) -> float:
        worker = core.empty()
        for reporter, value in zip(ranks, occupancy, strict=True):
            core.merge(worker, reporter.report({}, {"occupancy_bytes": {"cpu": value}}))
        stats = HybridKVStats(data=core.merge(core.empty(), worker))
        if multi:
            stats = MultiKVConnectorStats(data={"HybridKVConnector": stats})
        conn.update_connector_output(KVConnectorOutput(kv_connector_stats=stats))
        stats = conn.get_kv_connector_stats()
        merged = HybridKVStats(data=worker).aggregate(stats)  # as vLLM's scheduler does
        core.merge(fronts[front], merged.data)
        return core.gauge_values(fronts[front]["gauges"])["occupancy_bytes"]["cpu"]

    assert step(0, (100, 100)) == 200
    assert step(1, (100, 160)) == 260  # front end 1 never saw rank 0's report
    assert step(0, (90, 160)) == 250  # nor front end 0 rank 1's change


def test_a_failed_registration_leaves_a_stand_in_that_records_nothing(monkeypatch):
    """Registering the metrics fails: vLLM's front end still gets an object to call
    (MultiConnector's wrapper asserts every connector's is there), which records
    nothing and raises nothing."""
    from hybridkv.vllm import connector as connector_module
    from hybridkv.vllm.connector import HybridKVConnector
    from hybridkv.vllm.metrics import NoPromMetrics

    def broken(*args, **kwargs):
        raise ValueError("Duplicated timeseries in CollectorRegistry")

    monkeypatch.setattr(connector_module, "HybridKVPromMetrics", broken)
    registry = CollectorRegistry()
    types = {k: functools.partial(k, registry=registry) for k in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
        model_config=SimpleNamespace(served_model_name="m"),
    )
    got = HybridKVConnector.build_prom_metrics(vllm_config, types, ["engine"], {0: ["0"]})
    assert isinstance(got, NoPromMetrics)
    got.observe({"counters": {"lookups": {"cpu": 1}}}, 0)
    assert not [m for m in registry.collect() if m.name.startswith("vllm:hybridkv")]


MULTIPROCESS_MODE = """
import json, sys
from types import SimpleNamespace
from hybridkv.vllm.metrics import start_metrics_server
vllm_config = SimpleNamespace(
    kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
    model_config=SimpleNamespace(served_model_name="m"),
)
print(json.dumps(start_metrics_server(vllm_config, int(sys.argv[1])) is None))
"""


def test_metrics_port_is_ignored_in_prometheus_multiprocess_mode(tmp_path: Path) -> None:
    """vLLM's server with several API processes puts prometheus_client in multiprocess
    mode (PROMETHEUS_MULTIPROC_DIR, set before any import): a `metrics_port` registry
    would then write its figures into the directory the server's /metrics sums, each
    counted twice. It is not started, and nothing is written there."""
    import os
    import subprocess

    shared = tmp_path / "prom"
    shared.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    port = str(_free_port())
    out = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS_MODE, port], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) is True
    assert "metrics_port" in out.stderr and "multiprocess" in out.stderr
    assert list(shared.iterdir()) == []  # (without it, the server starts: tests above)
