"""Time to first token: cold, vLLM's own prefix hit, restored by hybridkv (CPU, disk, and
disk after a restart), side by side (issue 4, targets 1, 2 and 5). The logic is
`hybridkv.benchmarks.ttft` (its docstring says what each mode times; `hybridkv bench
ttft --restart` runs the same); results go to bench/results/ttft.{json,png}.

    .venv/bin/python bench/ttft.py                          # qwen3-next small, 8k tokens
    .venv/bin/python bench/ttft.py --arch gemma3            # sliding window: bytes loaded
    .venv/bin/python bench/ttft.py --tp 2                   # two ranks, `mp` executor
    .venv/bin/python bench/ttft.py --redis-url redis://127.0.0.1:6379/0   # Redis tier

With `--tp` > 1 the workers run in processes of their own (one core each on a 2-core
machine): the `disk` mode, which empties the CPU tier from inside the worker, is left
out; `restart` still times a restore from disk.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import RESULTS

from hybridkv.benchmarks.ttft import TtftSettings, first_modes, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3-next")
    p.add_argument("--size", default="small")
    p.add_argument("--model", help="model directory (default: made under $HYBRIDKV_HOME)")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-bytes", default="4GiB")
    p.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    p.add_argument("--disk-path", help="disk tier directory (default: a new temporary one)")
    p.add_argument("--redis-url", help="restore from this Redis instead of a disk")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--json", type=Path, default=RESULTS / "ttft.json")
    args = vars(p.parse_args())
    out = args.pop("json")
    settings = TtftSettings(**args)
    run(settings, first_modes(settings.tp, settings.redis_url is not None), True, out)


if __name__ == "__main__":
    main()
