"""Replay a trace against one vLLM engine in this process, for the hit-rate benchmark
(`hybridkv.benchmarks.hit_rate`, which starts one such process per system and budget).

    python -m hybridkv.benchmarks.replay < spec.json   ->  a line `RESULT {...}`

Spec: {"system": "hybridkv" | "vllm-offload" | "none" ("hybridkv@REV" is hybridkv too:
the parent put REV's source first on PYTHONPATH), "budget": bytes, "model": dir,
"trace": path (`Trace.save` format), "kv_cache_bytes", "max_model_len",
"hybridkv_extra"?: {...}, "offload_extra"?: {...}, "in_flight"?: N (1)}.

Requests are added in trace order, greedy, with at most `in_flight` of them in the
engine at a time: 1 is the sequential replay (the next request arrives when the last
one finished); more is a closed loop of that many clients, so requests of different
sessions share the engine's steps. A request's TTFT is the time from adding it to its
first output token. Each request's cached tokens are split into vLLM's own prefix-cache
hit (`num_local_cached_tokens`) and the connector's (`num_external_cached_tokens`), read
from the engine core's prefill stats. The step at which the scheduler first runs each
request is recorded: `in_order` says no request ran before one that arrived earlier,
which is when the oracle's bound holds for the replay (hybridkv.benchmarks.oracle); the
engine's KV geometry the oracle needs is reported too (`geometry`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

OFFLOAD_SPEC = {
    "spec_name": "CPUSyncOffloadingSpec",
    "spec_module_path": "hybridkv.benchmarks.offloading_cpu",
}
SYSTEMS = ("hybridkv", "vllm-offload", "none")


def start_engine(spec: dict[str, Any]):
    from hybridkv.engine import make_llm

    system = spec["system"]
    common = dict(
        kv_cache_bytes=spec["kv_cache_bytes"],
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],  # a prompt is prefilled in one step
    )
    if system == "hybridkv" or system.startswith("hybridkv@"):
        extra = {"cpu_bytes": spec["budget"], **spec.get("hybridkv_extra", {})}
        return make_llm(spec["model"], extra, **common)
    if system == "none":
        return make_llm(spec["model"], connector=False, **common)
    if system != "vllm-offload":
        raise ValueError(f"system: expected one of {SYSTEMS}, got {system!r}")
    extra = {**OFFLOAD_SPEC, "cpu_bytes_to_use": spec["budget"], **spec.get("offload_extra", {})}
    offloading = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    return make_llm(spec["model"], connector=offloading, **common)


class PrefillSplit:
    """Collects each finished prefill's (local, external) cached tokens by wrapping the
    output processor (it runs in this process in every engine layout)."""

    def __init__(self, llm):
        self.last: dict[str, tuple[int, int]] = {}
        proc = llm.llm_engine.output_processor
        inner = proc.process_outputs

        def process_outputs(outputs, *args, **kwargs):
            for out in outputs:
                ps = getattr(out, "prefill_stats", None)
                if ps is not None:
                    self.last[out.request_id] = (
                        ps.num_local_cached_tokens,
                        ps.num_external_cached_tokens,
                    )
            return inner(outputs, *args, **kwargs)

        proc.process_outputs = process_outputs


class ScheduleOrder:
    """The engine step at which the scheduler first runs each request (`first`, by
    vLLM's internal request id), by wrapping the in-process scheduler's `schedule`."""

    def __init__(self, llm):
        self.first: dict[str, int] = {}
        self.steps = 0
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        inner = sched.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.steps += 1
            for new in out.scheduled_new_reqs:
                self.first.setdefault(new.req_id, self.steps)
            return out

        sched.schedule = schedule


def serve(llm, requests: list[tuple[list[int], int]], in_flight: int, split: PrefillSplit):
    """Run `requests` ((prompt, max_tokens) in arrival order) with at most `in_flight` in
    the engine: per request [prompt, cached, local, external, ttft seconds] and vLLM's
    internal request id."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    pending = deque(enumerate(requests))
    started: dict[str, float] = {}
    ttft: dict[str, float] = {}
    rows: list[list[Any]] = [[] for _ in requests]
    ids: list[str] = [""] * len(requests)
    while pending or started:
        while pending and len(started) < in_flight:
            i, (prompt, max_tokens) = pending.popleft()
            params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)
            ids[i] = engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params)
            started[str(i)] = time.perf_counter()
        for out in engine.step():
            key = out.request_id
            if key not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[key] = time.perf_counter() - started[key]
            if out.finished:
                i = int(key)
                started.pop(key)
                cached = out.num_cached_tokens or 0
                local, external = split.last.pop(ids[i], (cached, 0))
                rows[i] = [len(requests[i][0]), cached, local, external, ttft.pop(key)]
    return rows, ids


def kv_geometry(llm) -> dict[str, Any]:
    """What the oracle needs of this engine's KV cache: the layout's groups (unpadded
    bytes per block, as hybridkv stores them) and the number of blocks in vLLM's pool
    (one of them its null block)."""
    from hybridkv.vllm.layout import layout_from_vllm

    kv = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    layout = layout_from_vllm(llm.llm_engine.vllm_config, kv, "replay")
    groups = [
        {k: g[k] for k in ("kind", "block_tokens", "block_bytes", "window")}
        for g in layout.describe()["groups"]
    ]
    return {"groups": groups, "num_gpu_blocks": kv.num_blocks}


def cpu_entries(index) -> Mapping[bytes, int] | None:
    """The index's entries in CPU memory (key -> bytes): its ledger's, or before the
    ledger was split out (an older revision replayed as `hybridkv@REV`) its own map."""
    ledger = getattr(index, "ledger", None)
    return ledger.sizes if ledger is not None else getattr(index, "_cpu", None)


class HybridKVProbe:
    """Counts, from outside, what hybridkv's index admits, refuses and evicts per group
    (kind), for the benchmark's record: wraps the index's methods on this instance only.
    A method the index no longer has is skipped, never an error."""

    def __init__(self, llm):
        from hybridkv.core.keys import split_group_key
        from hybridkv.engine import scheduler_connector

        self.side = scheduler_connector(llm).scheduler_side
        self.index = self.side.index
        kinds = [g.kind.value for g in self.side.layout.groups]
        self.kind = lambda key: f"{split_group_key(key)[1]}:{kinds[split_group_key(key)[1]]}"
        self.counts: dict[str, Counter[str]] = {
            k: Counter()
            for k in ("admitted", "admitted_bytes", "refused", "evicted", "evicted_bytes")
        }
        cpu = cpu_entries(self.index)
        if cpu is None:
            return
        # Admissions: what a call added to CPU memory, and which of the keys it was
        # given it left out. (`admit_boundary` admits all states of one boundary.)
        for name, keys_of in (
            ("admit", lambda args: [args[0]]),
            ("admit_boundary", lambda args: [k for k, _ in args[0]]),
        ):
            method = getattr(self.index, name, None)
            if method is not None:
                setattr(self.index, name, self._admitting(method, keys_of, cpu))
        make_room = getattr(self.index, "_make_room", None)
        if make_room is not None:

            def counted_make_room(*args, **kwargs):
                before = dict(cpu)
                ok = make_room(*args, **kwargs)
                for key, size in before.items():
                    if key not in cpu:
                        self.counts["evicted"][self.kind(key)] += 1
                        self.counts["evicted_bytes"][self.kind(key)] += size
                return ok

            self.index._make_room = counted_make_room

    def _admitting(self, method, keys_of, cpu):
        def counted(*args, **kwargs):
            before = set(cpu)
            ok = method(*args, **kwargs)
            for key in keys_of(args):
                if key in before:
                    continue
                k = self.kind(key)
                if key in cpu:
                    self.counts["admitted"][k] += 1
                    self.counts["admitted_bytes"][k] += cpu[key]
                else:
                    self.counts["refused"][k] += 1
            return ok

        return counted

    def report(self) -> dict[str, Any]:
        from hybridkv.engine import worker_connector

        held: Counter[str] = Counter()
        held_bytes: Counter[str] = Counter()
        for key, size in (cpu_entries(self.index) or {}).items():
            held[self.kind(key)] += 1
            held_bytes[self.kind(key)] += size
        worker = worker_connector().worker_side
        return {
            "snapshot": self.side.snapshot(),
            "worker": dict(vars(worker.stats)),
            "tiers": {n: dict(vars(s)) for n, s in worker.store.stats().items()},
            "by_group": {k: dict(v) for k, v in self.counts.items()},
            "held": dict(held),
            "held_bytes": dict(held_bytes),
            "stored_bytes": sum(self.counts["admitted_bytes"].values()),
            "loaded_bytes": worker.stats.loaded_bytes,
        }


def offload_report(llm) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    manager = sched.connector.connector_scheduler.manager
    worker = get_kv_transfer_group().connector_worker.worker
    groups = sched.kv_cache_config.kv_cache_groups
    kind = {str(i): f"{i}:{type(g.kv_cache_spec).__name__}" for i, g in enumerate(groups)}
    counts = {
        what: {kind.get(g, g): n for g, n in c.items()} for what, c in manager.group_counts.items()
    }
    chunks = manager._num_chunks
    return {
        "by_group": counts,
        "chunks": chunks,
        "chunks_free": manager._get_num_free_chunks(),
        "stored_bytes": worker.stored_bytes,
        "loaded_bytes": worker.loaded_bytes,
    }


def main() -> None:
    spec = json.load(sys.stdin)
    from hybridkv.benchmarks.traces import Trace
    from hybridkv.engine import release_finished

    trace = Trace.load(spec["trace"])
    in_flight = int(spec.get("in_flight", 1))
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    llm = start_engine(spec)
    startup = time.perf_counter() - t_start
    split = PrefillSplit(llm)
    hybrid = spec["system"].startswith("hybridkv")
    probe = HybridKVProbe(llm) if hybrid else None

    # Warm-up (first-request compilation), with tokens no trace uses (ids >= vocab are
    # out of the model's range, so they are drawn from the trace's own range but with
    # a fixed pattern), then everything it left in any cache is dropped.
    warm = [(i * 7919) % (trace.vocab - 1) + 1 for i in range(300)]
    serve(llm, [(warm, 1), (warm[:100], 1)], 1, split)
    release_finished(llm)  # vLLM keeps a request's blocks a step for hybridkv's stores
    llm.reset_prefix_cache(reset_connector=True)
    split.last.clear()
    order = ScheduleOrder(llm)

    t_replay = time.perf_counter()
    rows, ids = serve(llm, [(r.prompt, r.max_tokens) for r in trace], in_flight, split)
    replay = time.perf_counter() - t_replay
    steps = [order.first.get(i, 0) for i in ids]
    if probe is not None:
        connector = probe.report()
    elif spec["system"] == "vllm-offload":
        connector = offload_report(llm)
    else:
        connector = {}
    result = {
        "system": spec["system"],
        "budget": spec["budget"],
        "columns": ["prompt", "cached", "local", "external", "seconds"],
        "rows": rows,
        "in_flight": in_flight,
        "first_step": steps,
        "in_order": all(a <= b for a, b in zip(steps, steps[1:], strict=False)),
        "startup_s": startup,
        "loadavg": [load_before, os.getloadavg()],
        "replay_s": replay,
        "connector": connector,
        # vLLM's block (the hit granularity), as the engine resolved it for this model.
        "block_tokens": llm.llm_engine.vllm_config.cache_config.block_size,
        "geometry": kv_geometry(llm),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
