"""What the garbage collector costs inside a real engine, with hybridkv and without.

Why: `bench/lookup.py --gc` and `--slowest` model the scheduler side alone. In an engine
vLLM's own objects (requests, their token lists, scheduler outputs) set off the
collections, and hybridkv's share is what its objects add to them. This runs the same
workload through a tiny Qwen3-Next engine in this process (vLLM's engine core runs its
scheduler here with `VLLM_ENABLE_V1_MULTIPROCESSING=0`), hybridkv off and on, alternating,
each engine frozen after start-up as the server's engine core freezes itself
(`freeze_gc_heap`), and counts every collection (`gc.callbacks`): how many of each
generation, their total and longest pause, and at the end the objects the collector
tracks whose type is hybridkv's.

The workload: documents with questions on them, question-major (a document's next
question comes after the others pushed it out of vLLM's small cache), drawn from a
seeded generator; hybridkv restores the documents from its CPU tier.

    .venv/bin/python bench/engine_gc.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

from common import RESULTS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class Collections:
    """Every collection while installed: count per generation, pauses."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.pauses: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.count[info["generation"]] += 1
            self._start = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._start)


def hybridkv_tracked() -> int:
    """Objects the collector tracks whose type comes from hybridkv's modules."""
    return sum(type(o).__module__.startswith("hybridkv") for o in gc.get_objects())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--cycles", type=int, default=2, help="off/on engine pairs")
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--json", type=Path, default=RESULTS / "engine_gc.json")
    args = p.parse_args()

    from hybridkv.engine import generate, make_llm, shutdown
    from hybridkv.models import make_model

    rng = random.Random(args.seed)
    print(f"seed {args.seed}")
    docs = [[rng.randrange(1, 2000) for _ in range(args.doc_tokens)] for _ in range(args.documents)]
    prompts = [
        doc + [rng.randrange(1, 2000) for _ in range(rng.randint(20, 80))]
        for _ in range(args.questions)
        for doc in docs
    ]
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as tmp:
        model = str(make_model("qwen3-next", Path(tmp) / "model", size="tiny"))
        for _ in range(args.cycles):
            for mode in ("off", "on"):
                llm = make_llm(
                    model,
                    {"cpu_bytes": "1GiB"} if mode == "on" else None,
                    connector=mode == "on",
                    kv_cache_bytes=8 << 20,  # a few documents: the rest must come back
                )
                gc.collect()
                gc.freeze()
                seen = Collections()
                gc.callbacks.append(seen)
                t = time.perf_counter()
                try:
                    outs = []
                    for i in range(0, len(prompts), len(docs)):
                        outs += generate(llm, prompts[i : i + len(docs)], max_tokens=8)
                finally:
                    gc.callbacks.remove(seen)
                run = {
                    "seconds": time.perf_counter() - t,
                    "cached tokens": sum(o.num_cached_tokens for o in outs),
                    "collections by generation": seen.count,
                    "pauses ms": 1e3 * sum(seen.pauses),
                    "longest pause ms": 1e3 * max(seen.pauses, default=0.0),
                    "hybridkv objects tracked": hybridkv_tracked(),
                }
                runs[mode].append(run)
                print(mode, json.dumps(run))
                gc.unfreeze()
                shutdown(llm)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": runs}))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
