"""Run a vLLM engine with hybridkv in a fresh Python process, for restart and sharing tests.

Reads a JSON spec on stdin: {"model", "extra", "steps": [...], "shutdown"?, "engine"?
(LLM keyword arguments), "env"?} and prints one line `RESULT <json>` with every
generation, the scheduler side's snapshot and, when the worker runs in this process,
its tier stats.
Steps: {"op": "generate", "name", "prompt", "max_tokens"?, "fresh"?} (fresh: empty vLLM's
own prefix cache and hybridkv's CPU tier first, so only the disk can serve a hit; with
the worker in this process only), {"op": "reset"} (empty vLLM's own prefix cache only),
{"op": "flush"}, {"op": "touch", "path"}, {"op": "wait", "path", "timeout"?},
{"op": "limit_file_size", "bytes"}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    spec = json.load(sys.stdin)
    os.environ.update(spec.get("env", {}))
    from hybridkv.engine import (
        drop_cpu_tier,
        generate,
        make_llm,
        scheduler_connector,
        shutdown,
        sync_tiers,
        worker_connector,
    )

    llm = make_llm(spec["model"], spec.get("extra"), **spec.get("engine", {}))
    side = scheduler_connector(llm).scheduler_side
    # The worker is in this process with the 'uni' executor only.
    in_process = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "uni"
    store = worker_connector().worker_side.store if in_process else None
    runs = {}
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            if step.get("fresh"):
                llm.reset_prefix_cache()
                drop_cpu_tier(llm)
            out = generate(llm, [step["prompt"]], step.get("max_tokens", 8))[0]
            runs[step["name"]] = dataclasses.asdict(out)
        elif op == "reset":
            llm.reset_prefix_cache()
        elif op == "limit_file_size":  # a full disk from here on (also for child processes)
            resource.setrlimit(resource.RLIMIT_FSIZE, (step["bytes"], step["bytes"]))
        elif op == "flush":
            sync_tiers(llm)
        elif op == "touch":
            Path(step["path"]).touch()
        elif op == "wait":
            deadline = time.monotonic() + step.get("timeout", 300)
            while not Path(step["path"]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(step["path"])
                time.sleep(0.1)
        else:
            raise ValueError(f"unknown step {op!r}")
    stats = {name: dataclasses.asdict(s) for name, s in store.stats().items()} if store else {}
    result = {
        "runs": runs,
        "stats": stats,
        "snapshot": side.snapshot(),
        "chunk_tokens": side.planner.chunk_tokens,
    }
    print("RESULT " + json.dumps(result), flush=True)
    if spec.get("shutdown", True):
        shutdown(llm)
    # Otherwise the interpreter exits with the engine up: queued disk writes must still
    # be finished by hybridkv's exit hook.


if __name__ == "__main__":
    main()
