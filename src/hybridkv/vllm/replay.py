"""Replay a trace against one vLLM engine in this process, for the hit-rate benchmark
(`hybridkv.benchmarks.hit_rate`, which starts one such process per system and budget).

    python -m hybridkv.vllm.replay < spec.json   ->  a line `RESULT {...}`

Spec: {"system": "hybridkv" | "vllm-offload" | "none" ("hybridkv@REV" is hybridkv too:
the parent put REV's source first on PYTHONPATH), "budget": bytes, "model": dir,
"trace": path (`Trace.save` format), "kv_cache_bytes", "max_model_len",
"hybridkv_extra"?: {...}, "offload_extra"?: {...}}.

Requests run one at a time in trace order (one `generate` each, greedy); the wall time
of that call is the request's TTFT when its max_tokens is 1. Each request's cached
tokens are split into vLLM's own prefix-cache hit (`num_local_cached_tokens`) and the
connector's (`num_external_cached_tokens`), read from the engine core's prefill stats.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

OFFLOAD_SPEC = {
    "spec_name": "CPUSyncOffloadingSpec",
    "spec_module_path": "hybridkv.vllm.offloading_cpu",
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

    def take(self) -> tuple[int, int] | None:
        values = list(self.last.values())
        self.last.clear()
        return values[-1] if values else None


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
        cpu = getattr(self.index, "_cpu", None)
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
        for key, size in getattr(self.index, "_cpu", {}).items():
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
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hybridkv.core.traces import Trace

    trace = Trace.load(spec["trace"])
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    llm = start_engine(spec)
    startup = time.perf_counter() - t_start
    split = PrefillSplit(llm)
    hybrid = spec["system"].startswith("hybridkv")
    probe = HybridKVProbe(llm) if hybrid else None

    def run(prompt: list[int], max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        return out, time.perf_counter() - t

    # Warm-up (first-request compilation), with tokens no trace uses (ids >= vocab are
    # out of the model's range, so they are drawn from the trace's own range but with
    # a fixed pattern), then everything it left in any cache is dropped.
    warm = [(i * 7919) % (trace.vocab - 1) + 1 for i in range(300)]
    run(warm, 1)
    run(warm[:100], 1)
    llm.reset_prefix_cache(reset_connector=True)
    split.take()

    rows = []
    t_replay = time.perf_counter()
    for req in trace:
        out, dt = run(req.prompt, req.max_tokens)
        local, external = split.take() or (out.num_cached_tokens or 0, 0)
        rows.append([len(req.prompt), out.num_cached_tokens or 0, local, external, dt])
    replay = time.perf_counter() - t_replay
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
        "startup_s": startup,
        "loadavg": [load_before, os.getloadavg()],
        "replay_s": replay,
        "connector": connector,
        # vLLM's block (the hit granularity), as the engine resolved it for this model.
        "block_tokens": llm.llm_engine.vllm_config.cache_config.block_size,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
