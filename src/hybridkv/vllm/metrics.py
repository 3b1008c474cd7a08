"""hybridkv's metrics in vLLM's terms: `HybridKVStats` (vLLM's `KVConnectorStats`) carries
reports (core/metrics.py) from the workers and the scheduler side to vLLM's stat loggers;
`HybridKVPromMetrics` (a `KVConnectorPromMetrics`) puts them on vLLM's `/metrics` as
`vllm:hybridkv_*`, labelled by tier; `MetricsServer` serves the same metrics on
`metrics_port` for engines without vLLM's server (offline `LLM`).

How a figure travels: each worker's `get_kv_connector_stats` returns the increase of its
counters since the last call (every step, just before `build_connector_worker_meta`:
what lands in that call is counted a step later); vLLM's
output aggregator merges the ranks' reports (`aggregate`); the scheduler merges in the
scheduler side's own report and hands the payload (`to_dict`) with its scheduler stats to
the front-end process, where vLLM's `PrometheusStatLogger` builds `HybridKVPromMetrics`
from the connector class (`build_prom_metrics`) and calls `observe` with it. vLLM drops
the payload when stats logging is off (`disable_log_stats`, the offline default):
`metrics_port` exists for that case. Figures move only while the engine steps: an idle
engine asks for no stats, so a tier that goes down or a disk writer that finishes while
no request runs shows at the next request.

Nothing here may raise into vLLM: a failing `observe` is logged and skipped.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client import values as prom_values
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from hybridkv.core import metrics as core
from hybridkv.core.config import HybridKVConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

PREFIX = "vllm:hybridkv_"
# Load and store batches: from a fraction of a millisecond (a few small entries in
# memory) to seconds (a long prompt from disk or a distant Redis).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# name -> (kind, documentation, tiers). Every metric has vLLM's labels (model_name,
# engine) and `tier`: cpu, disk or redis, or "none" where no tier served (a miss). `tiers`
# names the label values a counter or histogram starts at 0 with: "each" configured tier,
# "each+none", "below" (each but cpu), or the one value given.
METRICS: dict[str, tuple[type[PromMetric], str, str]] = {
    "lookups": (
        Counter,
        "Lookups hybridkv answered (not the 'ask again' answers while entries are "
        "promoted), by the tier the hit came from: cpu, or the lower tier its entries "
        "were promoted from; none for a miss.",
        "each+none",
    ),
    "hit_tokens": (
        Counter,
        "Tokens restored by hybridkv (a prompt's; a resumed request's output too), "
        "beyond vLLM's own prefix-cache hit, counted when vLLM allocates the hit; by "
        "tier as for lookups. Those whose load then failed are counted again in "
        "failed_load_tokens.",
        "each",
    ),
    "failed_load_tokens": (
        Counter,
        "Tokens counted in hit_tokens whose load failed (an entry a worker could not "
        "read or copy): vLLM recomputed them. hit_tokens minus these is what restores "
        "served.",
        "each",
    ),
    "failed_promotions": (
        Counter,
        "Entries a promotion could not read from a lower tier on some rank (gone, "
        "damaged, the tier down); the hit stops short of them.",
        "below",
    ),
    "errors": (
        Counter,
        "Faults hybridkv caught at vLLM's hooks instead of raising them into vLLM, on the "
        "scheduler side and each rank (each logged with its traceback; tier is none). "
        "Anything but 0 is worth a bug report.",
        "none",
    ),
    "miss_tokens": (
        Counter,
        "Tokens past vLLM's own hit and hybridkv's hit at each answered lookup "
        "(they are computed; short_of_state_tokens are among them); tier is none.",
        "none",
    ),
    "short_of_state_tokens": (
        Counter,
        "Of those, tokens whose attention KV hybridkv held, past the hit it could serve, "
        "that no boundary with every recurrent state reached (so they were computed); "
        "tier is none. What a hybrid model loses for want of a state.",
        "none",
    ),
    "loaded_bytes": (
        Counter,
        "Bytes of entries read out of a tier: cpu, into the KV cache by restores; disk "
        "and redis, into CPU memory by promotions. Summed over tensor-parallel ranks.",
        "each",
    ),
    "stored_bytes": (
        Counter,
        "Bytes of entries a tier accepted: cpu holds them at once, disk and redis queue "
        "them for their writers. Summed over tensor-parallel ranks.",
        "each",
    ),
    "evictions": (
        Counter,
        "Entries evicted from a tier: cpu on the scheduler side's orders or its safety "
        "bound, disk by its byte budget (redis evicts on its own, unseen: always 0). "
        "Each rank's shard counts.",
        "each",
    ),
    "dropped_stores": (
        Counter,
        "Stores a tier did not keep: write queue full or tier down, entry too large, or "
        "a failed write. Each rank's shard counts.",
        "each",
    ),
    "damaged_entries": (
        Counter,
        "Unusable entries found on reading from disk or redis (damaged, truncated, wrong "
        "format or integrity key), each answered as a miss. Each rank's shard counts.",
        "each",
    ),
    "occupancy_bytes": (Gauge, "Bytes a tier holds, summed over tensor-parallel ranks.", "each"),
    "held_entries": (
        Gauge,
        "Pins on entries in CPU memory (an entry pinned twice counts twice): those of "
        "hits between their lookup and their load, and those running requests hold "
        "(what their stores admitted, their latest decode-time state). 0 when no "
        "request is in flight (above 0 then: a leak).",
        "cpu",
    ),
    "tier_up": (Gauge, "1 while the tier serves on every rank, 0 while it is down.", "each"),
    "host_memory_bytes": (
        Gauge,
        "Host memory resident for entries, summed over tensor-parallel ranks: each "
        "rank's pool holds the CPU tier's entries and those in flight (loads, queued "
        "disk and Redis writes), and keeps what the most live entries at once touched "
        "(pinned, its whole slabs) for reuse.",
        "cpu",
    ),
    "load_seconds": (
        Histogram,
        "Seconds a batch of loads took: cpu, a step's restores into the KV cache (on a "
        "GPU until seen landed, within a step of landing); disk and redis, a promotion "
        "batch read into CPU memory.",
        "each",
    ),
    "store_seconds": (
        Histogram,
        "Seconds from the start of a step's stores until their entries were in CPU "
        "memory (and queued for the lower tiers).",
        "cpu",
    ),
}


@dataclass
class HybridKVStats(KVConnectorStats):
    """A report (core/metrics.py) as vLLM's connector stats: `aggregate` merges ranks and
    steps, `reduce` gives vLLM's periodic log line its figures."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = core.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        core.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return core.summary(self.data)

    def is_empty(self) -> bool:
        return core.is_empty(self.data)


def own_stats(stats: KVConnectorStats | None) -> HybridKVStats | None:
    """hybridkv's stats in what vLLM hands `update_connector_output`: the stats
    themselves, or under MultiConnector one entry of its per-connector map."""
    if stats is None or isinstance(stats, HybridKVStats):
        return stats
    inner = stats.data.values() if isinstance(stats.data, dict) else ()
    return next((s for s in inner if isinstance(s, HybridKVStats)), None)


def stats_or_none(report: core.Report) -> HybridKVStats | None:
    """What `get_kv_connector_stats` returns: None when nothing changed, so an idle step
    sends vLLM no connector output."""
    return None if core.is_empty(report) else HybridKVStats(data=report)


class HybridKVPromMetrics(KVConnectorPromMetrics):
    """The `vllm:hybridkv_*` metrics. vLLM builds one in its front-end process from the
    connector class; `MetricsServer` builds one on its own registry."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, PromMetric] = {}
        tiers = _configured_tiers(vllm_config)
        for name, (kind, doc, which) in METRICS.items():
            extra: dict[str, Any] = {}
            if kind is Gauge:
                extra["multiprocess_mode"] = "mostrecent"
            elif kind is Histogram:
                extra["buckets"] = LATENCY_BUCKETS
            self._metrics[name] = metric_types[kind](
                name=PREFIX + name,
                documentation=doc,
                labelnames=[*labelnames, "tier"],
                **extra,
            )
            if kind is Gauge:
                continue  # no figure before the first report (a tier is not down at 0)
            start = {
                "each": tiers,
                "each+none": [*tiers, "none"],
                "below": [t for t in tiers if t != "cpu"],
            }.get(which, [which])
            for labels in per_engine_labelvalues.values():
                for tier in start:
                    self._metrics[name].labels(*labels, tier)
        # Per engine: each source's latest gauge values (a rank reports a gauge only
        # when it changed, so the others' must be remembered).
        self._gauges: dict[int, dict[str, dict[str, dict[str, float]]]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one (merged) report; logged and skipped if it cannot be read."""
        try:
            self._observe(transfer_stats_data, engine_idx)
        except Exception:
            log.exception("hybridkv: recording metrics failed; this report is skipped")

    def _observe(self, report: dict[str, Any], engine_idx: int) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, by_tier in report.get("counters", {}).items():
            for tier, inc in by_tier.items():
                amount = core.clamp(f"{name}[{tier}]", inc)
                if amount:
                    self._metrics[name].labels(*labels, tier).inc(amount)
        gauges = self._gauges.setdefault(engine_idx, {})
        core.merge({"gauges": gauges}, {"gauges": report.get("gauges", {})})
        changed = {name: gauges[name] for name in report.get("gauges", {})}
        for name, by_tier in core.gauge_values(changed).items():
            for tier, value in by_tier.items():
                self._metrics[name].labels(*labels, tier).set(value)
        for name, by_tier in report.get("histograms", {}).items():
            for tier, values in by_tier.items():
                child = self._metrics[name].labels(*labels, tier)
                for v in values:
                    child.observe(v)


class NoPromMetrics(KVConnectorPromMetrics):
    """What vLLM's front end gets where `HybridKVPromMetrics` could not be built: it
    records nothing (the failure was logged)."""

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        pass


def _configured_tiers(vllm_config: VllmConfig) -> list[str]:
    """The kinds of the engine's tiers; just "cpu" if its configuration does not read
    (the engine then refuses to start anyway, naming the key)."""
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        return [t.kind for t in HybridKVConfig.from_dict(extra).tiers]
    except Exception:
        return ["cpu"]


class MetricsServer:
    """`metrics_port`: the `vllm:hybridkv_*` metrics served over HTTP (Prometheus text at
    any path) from the process of the scheduler side, on a registry of its own, for
    engines whose stats reach no vLLM server (offline `LLM`, stats logging off)."""

    def __init__(self, vllm_config: VllmConfig, port: int, host: str):
        registry = CollectorRegistry()
        types: dict[type[PromMetric], Any] = {
            kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
        }
        model = vllm_config.model_config.served_model_name
        self.metrics = HybridKVPromMetrics(
            vllm_config, types, ["model_name", "engine"], {0: [model, "0"]}
        )
        self.port = port
        self._server, self._thread = start_http_server(port, host, registry=registry)

    def observe(self, report: core.Report) -> None:
        self.metrics.observe(report)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    vllm_config: VllmConfig, port: int, host: str = "127.0.0.1"
) -> MetricsServer | None:
    """The server on `host` (`metrics_host`: this machine alone unless told otherwise), or
    None with a warning when it cannot start (the port is taken): metrics are not worth
    an engine. Not under prometheus_client's multiprocess mode (vLLM's server sets it for
    several API processes): every metric, on any registry, then writes to the shared
    directory the server's `/metrics` sums, which would count each figure twice."""
    if prom_values.ValueClass is not prom_values.MutexValue:
        log.warning(
            "hybridkv: metrics_port %d ignored: prometheus_client is in multiprocess mode "
            "(PROMETHEUS_MULTIPROC_DIR), so vLLM's server has the metrics on /metrics",
            port,
        )
        return None
    try:
        server = MetricsServer(vllm_config, port, host)
    except Exception as e:
        log.warning(
            "hybridkv: metrics_port %d: cannot serve metrics (%s); serving on without", port, e
        )
        return None
    log.info("hybridkv: metrics on http://%s:%d/metrics", host, port)
    return server
