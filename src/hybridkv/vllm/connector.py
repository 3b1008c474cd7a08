"""`HybridKVConnector`: the vLLM KV connector, a thin shell over the two sides.

vLLM builds one scheduler-role instance in the engine-core process and one worker-role
instance per tensor-parallel rank, in the rank's process (the engine core's own with the
`uni` executor, a process each with `mp`). They share nothing but vLLM's channels: the
scheduler side's orders go out in the step's connector metadata, each worker's report
comes back in its worker metadata (merged over ranks by vLLM), loads are finished
through `get_transfer_results`. Layouts that channel cannot serve are refused at start,
naming the setting.

No exception may leave a hook: an engine that dies for a cache is worse than no cache.
Each hook turns an error into a miss or a dropped store, counts it and logs it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from hybridkv.core import metrics
from hybridkv.core.config import ConfigError, HybridKVConfig, effective
from hybridkv.core.index import StoreIndex
from hybridkv.core.layout import GroupKind
from hybridkv.core.planner import Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.core.probe import Probe
from hybridkv.core.shared_tiers import warn_logged_secrets, warn_unprotected_tiers
from hybridkv.core.store import TieredStore, redis_tier
from hybridkv.vllm.kv_events import kv_events
from hybridkv.vllm.layout import group_layer_pages, layout_from_vllm
from hybridkv.vllm.metadata import HybridKVMetadata, HybridKVWorkerMeta
from hybridkv.vllm.metrics import (
    HybridKVPromMetrics,
    HybridKVStats,
    MetricsServer,
    NoPromMetrics,
    own_stats,
    start_metrics_server,
    stats_or_none,
)
from hybridkv.vllm.scheduler_side import SchedulerSide
from hybridkv.vllm.split_guard import SplitGuard, engine_block_size
from hybridkv.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def log_through_vllm() -> None:
    """Send the `hybridkv` loggers' records where vLLM sends its own.

    vLLM configures only its `vllm` logger (handler, format, level). Without this, an
    operator's server log never shows hybridkv's start-up line or its periodic stats, and
    its warnings go to Python's last-resort handler with no prefix. An operator who
    configures a `hybridkv` logger (VLLM_LOGGING_CONFIG_PATH) keeps that configuration."""
    ours, theirs = logging.getLogger("hybridkv"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


T = TypeVar("T")

# The worker's CPU tier bound, over its share of `cpu_bytes`: the scheduler side's index
# keeps the share; this only stops runaway growth (a step's stores land before its
# evictions).
_CPU_BOUND_FACTOR = 2
MAX_RANKS = 63
# vLLM's prefix-caching hashes whose block hashes may stand for a prefix's tokens.
_SAFE_BLOCK_HASHES = ("sha256", "sha256_cbor")


def check_process_layout(vllm_config: VllmConfig) -> None:
    """Refuse layouts whose workers would not report to this engine's scheduler side
    through vLLM's per-step channels, naming the setting."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ConfigError(
            f"pipeline_parallel_size: hybridkv supports tensor parallelism only "
            f"(got pipeline_parallel_size={pc.pipeline_parallel_size})"
        )
    if pc.data_parallel_size > 1:
        raise ConfigError(
            f"data_parallel_size: hybridkv is not tested with data parallelism yet "
            f"(got {pc.data_parallel_size}); run separate servers instead"
        )
    if pc.tensor_parallel_size > MAX_RANKS:
        # The index keeps which ranks hold an entry on disk as a bit per rank in a
        # 64-bit signed table value.
        raise ConfigError(
            f"tensor_parallel_size: hybridkv supports at most {MAX_RANKS} ranks "
            f"(got {pc.tensor_parallel_size})"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        # A manager block then spans block_size x ranks tokens over the ranks, while
        # a chunk's key covers block_size: a hit would restore another span's KV.
        if getattr(pc, name, 1) > 1:
            raise ConfigError(
                f"{name}: hybridkv does not support context parallelism "
                f"(got {name}={getattr(pc, name)})"
            )
    backend = pc.distributed_executor_backend
    if backend not in (None, "uni", "mp"):
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", backend)
        raise ConfigError(
            f"distributed_executor_backend: hybridkv supports the 'uni' and 'mp' executors, "
            f"got {name!r}"
        )


def check_load_failure_policy(vllm_config: VllmConfig) -> None:
    """Warn when a load hybridkv reports failed would fail its request.

    hybridkv reports a load failed when an entry went missing or its copy raised; vLLM's
    default `kv_load_failure_policy` ("fail") then ends the request with an error, where
    "recompute" computes its prefix instead. Only a warning: "fail" is a valid choice, and
    under `MultiConnector` vLLM reads the policy from the top level, which this connector
    (given its own entry) cannot see."""
    policy = vllm_config.kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        log.warning(
            "hybridkv: kv_load_failure_policy is %r: a request whose load fails (an entry "
            "lost, a copy that raised) ends with an error. Add "
            '"kv_load_failure_policy": "recompute" to --kv-transfer-config (KVTransferConfig) '
            "so vLLM recomputes it instead (with MultiConnector, at its top level and in "
            "hybridkv's entry)",
            policy,
        )


def _guarded(default: Callable[[], T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a hook; on any exception log it, count it on the side, return `default()`."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def hook(self: HybridKVConnector, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                log.exception("hybridkv: %s failed; serving on without it", fn.__name__)
                side = self.scheduler_side or self.worker_side
                if side is not None:
                    side.stats.hook_errors += 1
                return default()

        return hook

    return wrap


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a store a preemption overtakes is a later miss
        (`WorkerSide.guard` keeps it from reading blocks handed on), so vLLM need not
        drop a preempted request's output in flight and sample it again, as it does for
        connectors that must deliver (the default for the `kv_both` role)."""
        return False

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        log_through_vllm()
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self.metrics_server: MetricsServer | None = None
        # The workers' merged report of the current step, for `metrics_server` and the
        # book of every rank's latest gauges (`get_kv_connector_stats`).
        self._worker_report: metrics.Report | None = None
        self._gauge_book = metrics.GaugeBook()
        ktc = vllm_config.kv_transfer_config
        self.config = HybridKVConfig.from_dict(ktc.kv_connector_extra_config)
        check_process_layout(vllm_config)
        model_id = self.config.model_id or str(vllm_config.model_config.model)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, model_id)
        self.planner = Planner(self.layout.groups, self.config.chunk_tokens)
        state_groups = [g for g in self.layout.groups if g.kind is GroupKind.STATE]
        policy = None
        # vLLM turns prefix caching off where a restored prefix would be wrong or crash
        # the engine (pooling by mean or CLS: no partial prefill; non-causal attention:
        # a prefix's KV depends on later tokens), as well as on request.
        enabled = bool(vllm_config.cache_config.enable_prefix_caching)
        if not enabled:
            log.warning(
                "hybridkv: prefix caching is off for this engine (enable_prefix_caching="
                "False: set, or a model vLLM cannot prefix-cache); offloading is off"
            )
        split_guard = None
        if state_groups:
            mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
            if mode != "align":
                # Without "align", vLLM keeps one running state per request and no
                # checkpoint at chunk boundaries: nothing restorable exists.
                if enabled:
                    log.warning(
                        "hybridkv: recurrent layers without prefix caching "
                        "(mamba_cache_mode=%s); offloading is off for this engine",
                        mode,
                    )
                enabled = False
            if vllm_config.speculative_config is not None:
                # Speculative blocks are relocated inside a recurrent group's table; a
                # restored state would not be where vLLM reads it.
                raise ConfigError(
                    "speculative_config: hybridkv does not support speculative decoding "
                    "with recurrent layers yet"
                )
            if self.planner.chunk_tokens != state_groups[0].block_tokens:
                # vLLM materializes states at multiples of its state block only: a larger
                # chunk would leave the prompt checkpoint unstorable (silently no hits).
                raise ConfigError(
                    f"chunk_tokens: must equal the recurrent block size "
                    f"{state_groups[0].block_tokens} here, got {self.planner.chunk_tokens}"
                )
            policy = CheckpointPolicy(self.config.checkpoint_policy, self.planner.chunk_tokens)
            if enabled:
                split_guard = SplitGuard(
                    vllm_config.cache_config, engine_block_size(kv_cache_config)
                )
        ranks = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            below = self.config.tiers[1:]
            index = StoreIndex(
                self.config.cpu_bytes,
                ranks,
                self.config.disk_path is not None,
                recurrent=policy is not None,
                alpha=self.config.eviction_alpha,
            )
            probe = None
            if self.config.redis is not None:
                # Other replicas write to it: ask it (rank 0's entries stand for all).
                client = redis_tier(self.config, self.config.redis, self.layout.fingerprint)
                probe = Probe("redis", client.contains_many, release=client.close)
            self.scheduler_side = SchedulerSide(
                self.layout,
                self.planner,
                policy,
                index,
                enabled,
                below=any(t.store != "never" for t in below),
                tiers=[(t.kind, t.load_weight) for t in below],
                probe=probe,
                split_guard=split_guard,
                events=kv_events(
                    vllm_config, self.layout, self.planner, kv_cache_config, index, bool(below)
                ),
                # A CPU cache copies within `wait_for_save`; with one batch in flight
                # (no async scheduling, no pipeline stages) no step overlaps the next.
                stores_land_in_step=vllm_config.device_config.device_type == "cpu"
                and vllm_config.max_concurrent_batches == 1,
                # vLLM's block hashes stand for a prefix's tokens only where a collision
                # cannot be made: xxhash's can (core/keys.py's `ChainMemo`).
                hash_block_size=kv_cache_config.hash_block_size
                if vllm_config.cache_config.prefix_caching_hash_algo in _SAFE_BLOCK_HASHES
                else None,
            )
            if enabled:
                check_load_failure_policy(vllm_config)
            log.info("hybridkv: settings %s", json.dumps(effective(self.config)))
            warn_unprotected_tiers(self.config)  # once per engine: not per rank
            warn_logged_secrets(ktc.kv_connector_extra_config or {})
            self._reporter = metrics.Reporter("scheduler")
            if self.config.metrics_port is not None:
                self.metrics_server = start_metrics_server(
                    vllm_config, self.config.metrics_port, self.config.metrics_host
                )
        else:
            # A CUDA cache copies to and from pinned host memory (full PCIe speed).
            pin = vllm_config.device_config.device_type == "cuda"
            bound = _CPU_BOUND_FACTOR * self.config.cpu_bytes // ranks
            store = TieredStore.from_config(self.config, self.layout, pin, bound)
            self.worker_side = WorkerSide(
                self.planner,
                store,
                vllm_config.parallel_config.rank,
                load_step_bytes=self.config.load_step_bytes,
                hook_before_reuse=not vllm_config.use_v2_model_runner,
            )
            self._reporter = metrics.Reporter(f"rank{self.worker_side.rank}")
        self._all_groups = tuple(range(len(self.layout.groups)))
        log.info(
            "hybridkv: %s side, chunk %d tokens, groups %s",
            role.name.lower(),
            self.planner.chunk_tokens,
            [(g.kind.value, g.block_tokens, g.block_bytes) for g in self.layout.groups],
        )

    # ---- scheduler side ------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind(kv_cache_manager)

    @_guarded(lambda: (0, False))
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Hits are asynchronous loads (see scheduler_side for why); None asks vLLM to
        ask again next step."""
        n = self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens)
        return n, bool(n)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A load writes every group: vLLM must zero none of its blocks meanwhile."""
        return self._all_groups

    @_guarded(lambda: None)
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    @_guarded(lambda: HybridKVMetadata(all_handed=True))
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Guarded inside, part by part (the loads must go out); this is the last net."""
        return self.scheduler_side.build_meta(scheduler_output)

    @_guarded(lambda: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        reports, landed = (
            (meta.reports, meta.landed) if isinstance(meta, HybridKVWorkerMeta) else ({}, {})
        )
        self.scheduler_side.worker_output(
            reports,
            landed,
            connector_output.failed_recving or (),
            connector_output.finished_sending or (),
        )
        stats = own_stats(connector_output.kv_connector_stats)
        if stats is not None:
            self._worker_report = metrics.merge(metrics.empty(), stats.data)

    @_guarded(lambda: (False, None))
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request), None

    @_guarded(lambda: (False, None))
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while stores may still read the request's blocks: vLLM keeps them until
        every rank reports the request in `finished_sending` (`get_transfer_results`)."""
        return self.scheduler_side.request_finished(request), None

    @_guarded(lambda: False)
    def has_pending_block_frees(self) -> bool:
        """Asked when vLLM cannot allocate for a running request: True while a finished
        request's blocks, kept for its stores in flight (a GPU's), are about to be freed,
        so vLLM waits a step instead of preempting a request (`frees_pending`)."""
        return self.scheduler_side.frees_pending()

    @_guarded(list)
    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's KV cache events for what hybridkv can resume (vllm/kv_events.py): what
        changed since the last step, when `--kv-events-config` enables them."""
        events = self.scheduler_side.events
        return events.take() if events is not None else ()

    @_guarded(lambda: False)
    def reset_cache(self) -> bool:
        self.scheduler_side.reset()
        return True

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(
            kv_caches, group_layer_pages(self._kv_cache_config), self._kv_cache_config.num_blocks
        )

    @_guarded(lambda: None)
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """The first hook of a step: stores still reading blocks the step's schedule
        handed to another request (a preempted one's, a retired state, a window's past)
        are ordered ahead of the step's writes or dropped (`WorkerSide.guard`)."""
        assert isinstance(kv_connector_metadata, HybridKVMetadata)
        self.worker_side.guard(kv_connector_metadata)

    @_guarded(lambda: None)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads are asynchronous: their requests are not in this step's forward."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, HybridKVMetadata)
        self.worker_side.begin_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No layer of this step's forward reads a block being loaded."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Recurrent layers never call this, so every group is saved at step end instead."""

    @_guarded(lambda: None)
    def wait_for_save(self) -> None:
        self.worker_side.end_step(self._get_connector_metadata())

    @_guarded(lambda: None)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, rank = self.worker_side.report(), self.worker_side.rank
        landed = {rank: self.worker_side.landed_through()}
        return HybridKVWorkerMeta({rank: report} if report else {}, landed)

    @_guarded(lambda: KVConnectorTransferResults())
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done = self.worker_side.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=done.sending,
            finished_recving=done.received,
            failed_recving=done.failed,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Unused: `get_transfer_results` reports loads, with their failures, and the
        requests whose blocks were kept for stores."""
        return None, None

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's `prompt_tokens_cached_by_source`: CPU memory is the host; Redis, a
        store other engines fill, is unspecified. Never raises (a wrong answer here is
        only a label)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens == 0:
            return {}
        try:
            tier = self.scheduler_side.hit_source(request)
        except Exception:
            log.exception("hybridkv: naming a hit's tier failed")
            tier = "redis"
        source = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(
            tier, CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        return {source: num_external_tokens}

    # ---- metrics (both sides) -------------------------------------------------------------------
    @_guarded(lambda: None)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's report since the last call (core/metrics.py): a worker's goes to
        the scheduler with its output, the scheduler side's joins the workers' there.
        With `metrics_port`, the scheduler side also records both on its own server
        (vLLM calls this every step, after `update_connector_output`)."""
        side = self.scheduler_side or self.worker_side
        report = self._reporter.report(*side.metrics())
        if self.scheduler_side is not None:
            worker, self._worker_report = self._worker_report, None
            self._gauge_book.complete(report, worker)  # every rank's, if one changed
            if self.metrics_server is not None:
                self.metrics_server.observe(metrics.merge(worker or metrics.empty(), report))
        return stats_or_none(report)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return HybridKVStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HybridKVPromMetrics | None:
        """vLLM's front end builds this once; a failure costs the metrics, not the server:
        what is returned then records nothing (None would do for this connector alone,
        but under MultiConnector vLLM's wrapper asserts every connector's is there, in
        the front end's stat logging, which then fails the requests it serves)."""
        try:
            return HybridKVPromMetrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
        except Exception:
            log.exception("hybridkv: registering the vllm:hybridkv_* metrics failed")
        try:
            return NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        except Exception:
            log.exception("hybridkv: even a metrics stand-in failed")
            return None

    # ---- both --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """A worker finishes its queued disk writes; the scheduler side's probe releases
        its Redis client (connections, threads); the metrics server stops."""
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None and self.scheduler_side.probe is not None:
            self.scheduler_side.probe.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
