"""Run a vLLM engine with hybridkv in a fresh Python process, for restart and sharing tests.

Reads a JSON spec on stdin: {"model", "extra", "steps": [...], "shutdown"?}
and prints one line `RESULT <json>` with every generation and the store's tier stats.
Steps: {"op": "generate", "name", "prompt", "max_tokens"?, "fresh"?} (fresh: empty vLLM's
own prefix cache and hybridkv's CPU tier first, so only the disk can serve a hit),
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
    from hybridkv.engine import generate, make_llm, scheduler_connector, shutdown

    llm = make_llm(spec["model"], spec.get("extra"), **spec.get("engine", {}))
    side = scheduler_connector(llm).scheduler_side
    store = side.store
    runs = {}
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            if step.get("fresh"):
                llm.reset_prefix_cache()
                store.tiers[0].clear()
            out = generate(llm, [step["prompt"]], step.get("max_tokens", 8))[0]
            runs[step["name"]] = dataclasses.asdict(out)
        elif op == "limit_file_size":  # a full disk from here on (also for child processes)
            resource.setrlimit(resource.RLIMIT_FSIZE, (step["bytes"], step["bytes"]))
        elif op == "flush":
            store.flush()
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
    stats = {name: dataclasses.asdict(s) for name, s in store.stats().items()}
    result = {"runs": runs, "stats": stats, "chunk_tokens": side.planner.chunk_tokens}
    print("RESULT " + json.dumps(result), flush=True)
    if spec.get("shutdown", True):
        shutdown(llm)
    # Otherwise the interpreter exits with the engine up: queued disk writes must still
    # be finished by hybridkv's exit hook.


if __name__ == "__main__":
    main()
