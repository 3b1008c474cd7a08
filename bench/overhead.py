"""Engine throughput with hybridkv on but never hitting, against hybridkv off (issue 4,
target 4).

Every round serves a batch of fresh prompts (nothing to hit, in vLLM's cache or in
hybridkv's): with hybridkv on, every full chunk is still gathered and stored to the CPU
tier and queued for the disk tier, which is the whole cost of having it on. Engines with
and without the connector run one after the other in this process, alternating, and
each is timed over several rounds; the figure is tokens (prompt + generated) per second.

    .venv/bin/python bench/overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import RESULTS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3-next")
    p.add_argument("--size", default="small")
    p.add_argument("--prompts", type=int, default=4, help="prompts per round")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per engine start")
    p.add_argument("--cycles", type=int, default=2, help="off/on engine pairs")
    p.add_argument("--json", type=Path, default=RESULTS / "overhead.json")
    args = p.parse_args()

    from hybridkv.engine import generate, make_llm, shutdown
    from hybridkv.models import default_model_dir, make_model

    model = str(make_model(args.arch, default_model_dir(args.arch, args.size), args.size))
    rng = random.Random(7)

    def batch() -> list[list[int]]:
        return [
            [rng.randrange(1, 30000) for _ in range(args.prompt_tokens)]
            for _ in range(args.prompts)
        ]

    tokens = args.prompts * (args.prompt_tokens + args.max_tokens)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as disk:
        extra = {"cpu_bytes": "4GiB", "disk_path": disk, "disk_bytes": "16GiB"}
        for _ in range(args.cycles):
            for mode in ("off", "on"):
                llm = make_llm(
                    model,
                    extra if mode == "on" else None,
                    connector=mode == "on",
                    kv_cache_bytes=2 << 30,
                    max_model_len=args.prompt_tokens + args.max_tokens + 64,
                )
                generate(llm, batch()[:2], max_tokens=2)  # warm-up
                for _ in range(args.rounds):
                    prompts = batch()
                    t = time.perf_counter()
                    outs = generate(llm, prompts, args.max_tokens, ignore_eos=True)
                    rates[mode].append(tokens / (time.perf_counter() - t))
                    assert all(o.num_cached_tokens == 0 for o in outs)
                shutdown(llm)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(
        f"{args.arch}/{args.size}: {args.prompts} fresh prompts x {args.prompt_tokens} tokens, "
        f"{args.max_tokens} generated, {args.cycles * args.rounds} rounds each"
    )
    print(f"hybridkv off   {off:9.0f} tokens/s")
    print(f"hybridkv on    {on:9.0f} tokens/s   on/off = {on / off:.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rates": rates}
    args.json.write_text(json.dumps(result | {"ratio": on / off}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
