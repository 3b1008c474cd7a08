"""Trace-replay hit-rate benchmark (issue 12): hybridkv vs vLLM's own OffloadingConnector
vs no connector at equal CPU budgets. The logic is `hybridkv.bench_hit_rate` (see its
docstring for what is measured); results go to bench/results/hit_rate-<trace>.{json,png}.

    .venv/bin/python bench/hit_rate.py                       # chat, agentic, docqa; 4..64 MiB
    .venv/bin/python bench/hit_rate.py --quick               # small chat trace, 2 budgets
    .venv/bin/python bench/hit_rate.py --traces agentic --budgets-mib 8 32
"""

from __future__ import annotations

import sys

from common import RESULTS

from hybridkv.bench_hit_rate import main

if __name__ == "__main__":
    sys.exit(main(results=RESULTS))
