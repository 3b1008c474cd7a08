"""Trace-replay hit-rate benchmark (issues 12, 29): hybridkv vs vLLM's own
OffloadingConnector vs no connector at equal CPU budgets, each against the oracle (the
best any policy could do). The logic is `hybridkv.benchmarks.hit_rate` (see its docstring
for what is measured; `hybridkv bench hit-rate` runs the same); results go to
bench/results/hit_rate-<trace>.{json,png} and hit_rate-summary.json (tuning and held-out
families apart).

    .venv/bin/python bench/hit_rate.py                       # chat, agentic, docqa; 4..64 MiB
    .venv/bin/python bench/hit_rate.py --quick               # small chat trace, 2 budgets
    .venv/bin/python bench/hit_rate.py --traces agentic --budgets-mib 8 32
    .venv/bin/python bench/hit_rate.py --systems hybridkv --reuse-runs OLD_RESULTS_DIR
    .venv/bin/python bench/hit_rate.py --traces issue29 --kv-cache-mib 5   # held out
    .venv/bin/python bench/hit_rate.py --traces mixture --in-flight 4      # concurrent
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import RESULTS

from hybridkv.benchmarks.hit_rate import HitRateSettings, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--traces", nargs="+", help="trace specs (hybridkv.benchmarks.families.make_trace)"
    )
    p.add_argument("--systems", nargs="+", help="hybridkv, vllm-offload, none, hybridkv@REV")
    p.add_argument("--budgets-mib", nargs="+", type=float)
    p.add_argument("--arch")
    p.add_argument("--size")
    p.add_argument("--model", help="model directory (default: made under $HYBRIDKV_HOME)")
    p.add_argument("--kv-cache-mib", type=float, help="the engine's own KV cache")
    p.add_argument("--max-tokens", type=int, help="output tokens per request (cap)")
    p.add_argument("--in-flight", type=int, help="requests in the engine at a time (1)")
    p.add_argument("--limit", type=int, help="replay only the first N requests of each trace")
    p.add_argument("--hybridkv-extra", help="JSON merged into hybridkv's extra config")
    p.add_argument("--offload-extra", help="JSON merged into vLLM's offloading extra config")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--log", help="append every engine process's output to this file")
    p.add_argument("--quick", action="store_true", help="small chat trace, 2 budgets (~2 min)")
    p.add_argument(
        "--reuse-runs",
        type=Path,
        help="directory of earlier results whose vllm-offload / none runs join these",
    )
    args = vars(p.parse_args())
    run(HitRateSettings.make(**args))


if __name__ == "__main__":
    main()
