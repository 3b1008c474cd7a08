"""Helpers to start an offline vLLM engine with hybridkv on it (demo, tests, benchmarks).

Kept out of `hybridkv.vllm` (the connector) because only tools use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

CONNECTOR = {
    "kv_connector": "HybridKVConnector",
    "kv_connector_module_path": "hybridkv.vllm",
    "kv_role": "kv_both",
}


def offline_env() -> None:
    """Nothing may be fetched at run time; keep caches inside the user's cache dir."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def make_llm(
    model_dir: str,
    extra_config: dict[str, Any] | None = None,
    *,
    connector: bool | dict[str, Any] = True,
    kv_cache_bytes: int = 256 << 20,
    load_failure_policy: str = "recompute",
    max_model_len: int = 4096,
    **kwargs: Any,
):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    offline_env()
    ktc = None
    if isinstance(connector, dict):  # another connector's settings (a baseline, a wrapper)
        ktc = KVTransferConfig(**connector)
    elif connector:
        ktc = KVTransferConfig(
            **CONNECTOR,
            kv_connector_extra_config=dict(extra_config or {}),
            kv_load_failure_policy=load_failure_policy,
        )
    try:
        return LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            enforce_eager=True,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=kv_cache_bytes,
            max_model_len=max_model_len,
            seed=0,
            kv_transfer_config=ktc,
            **kwargs,
        )
    except BaseException:
        _release_process_state()  # a failed start must not spoil the next engine's
        raise


def _release_process_state() -> None:
    """Tear down vLLM's process-wide parallel state, so the next engine in this process
    builds its own (a MoE model after a dense one would otherwise find no expert-parallel
    group)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


# The best tokens whose logprobs a generation keeps at each position: a comparison of
# outputs that sees the distribution, not just the chosen token (`Generation.top`).
TOP_LOGPROBS = 5


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token
    num_cached_tokens: int
    # At each position the TOP_LOGPROBS best tokens' logprobs (and the chosen token's):
    # the tiny models' distributions are nearly flat, so output from a wrong prefix often
    # chooses a token about as likely as the right one's, while its best five move.
    top: list[dict[int, float]]


def generate(
    llm, prompts: list[list[int]], max_tokens: int = 8, salt: str | None = None, **sp: Any
) -> list[Generation]:
    """Greedy generation from token-id prompts, with an optional `cache_salt`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, logprobs=TOP_LOGPROBS, detokenize=False, **sp
    )
    salted = {"cache_salt": salt} if salt is not None else {}
    inputs = [TokensPrompt(prompt_token_ids=p, **salted) for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    release_finished(llm)
    result = []
    for o in outs:
        c = o.outputs[0]
        top = [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]
        lps = [step[tok] for step, tok in zip(top, c.token_ids, strict=True)]
        result.append(Generation(list(c.token_ids), lps, o.num_cached_tokens or 0, top))
    return result


def release_finished(llm, max_steps: int = 1000) -> None:
    """Step an in-process engine until vLLM has freed every finished request's blocks.

    A request whose stores may still read its blocks finishes with them held (vLLM's
    delayed free: hybridkv reports it in `finished_sending` at a later step; a CPU cache
    delays nothing, so this returns at once there), while `LLM.generate` returns as
    soon as its outputs are complete; a `reset_prefix_cache` right after would find
    blocks in use and do nothing. An engine core in its own process steps on by itself."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    for _ in range(max_steps if core is not None else 0):
        if not core.scheduler.has_finished_requests():
            return
        llm.llm_engine.step()


def shutdown(llm) -> None:
    """Stop an in-process engine and release vLLM's process-wide state."""
    llm.llm_engine.engine_core.shutdown()
    _release_process_state()


def scheduler_connector(llm):
    """The scheduler-side connector of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def sync_tiers(llm) -> None:
    """Run the step that tells the workers which requests finished, if one is owed (an
    engine's own loop runs it at once, an idle in-process `LLM` only at its next
    generate: a finished request's last decode-time state goes down to the lower tiers
    in it), wait for the worker's queued writes, rescan its disk (entries other engines
    wrote) and hand its report to the scheduler side at once, rather than after the next
    steps (in-process engine only): tests and benchmarks then see every entry where it
    will be."""
    core = llm.llm_engine.engine_core.engine_core
    if core.scheduler.has_finished_requests() and not core.scheduler.has_unfinished_requests():
        core.step_fn()
    side = scheduler_connector(llm).scheduler_side
    worker = worker_connector().worker_side
    worker.store.flush()
    if worker.store.disk is not None:
        worker.store.disk.rescan()
    side.worker_reports({worker.rank: worker.report()})


def drop_cpu_tier(llm) -> None:
    """Evict every entry from the CPU tier, so that the next hits come from the disk
    (in-process engine only; the engine must be idle)."""
    sync_tiers(llm)
    index = scheduler_connector(llm).scheduler_side.index
    index.evict_all()
    orders = index.take_orders()
    if orders.promote or orders.clear:
        raise RuntimeError("drop_cpu_tier needs an idle engine")
    worker_connector().worker_side.follow(orders)


def drop_page_cache(paths) -> int:
    """Evict files from the OS page cache (`posix_fadvise(DONTNEED)`, no privileges
    needed), so the next read of them comes from the disk; how many."""
    count = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count
