"""Issue 29's held-out check in `make test`: the multi-turn + branching trace the eviction
policy was not tuned on (3 shared system prompts, 18 four-turn conversations, 6 forking
after turn 2), drawn with the test seed and replayed through real engines (tiny
Qwen3-Next, engine KV 5 MiB) by `hybridkv bench hit-rate`. At the two CPU budgets where
the issue found hybridkv below vLLM's own OffloadingConnector (6 and 8 MiB), hybridkv
must serve at least as many prompt tokens from cache, and neither may exceed the oracle's
bound (a replay above it would mean the bound, or the replay's order, is wrong)."""

from __future__ import annotations

import json

from conftest import SEED
from test_cli_bench import bench

BUDGETS_MIB = (6, 8)


def test_held_out_trace_hybridkv_at_least_vllm_offloading(model_dirs, tmp_path):
    print(f"seed {SEED}")
    args = ["hit-rate", "--model", model_dirs["qwen3-next"], "--trace", f"issue29:seed={SEED}"]
    args += ["--system", "hybridkv", "--system", "vllm-offload", "--kv-cache-mib", "5"]
    for mib in BUDGETS_MIB:
        args += ["--budget-mib", str(mib)]
    bench(*args, "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "hit_rate-issue29.json").read_text())
    assert result["group"] == "held-out"
    rates = {}
    for run in result["runs"]:
        f = run["figures"]
        assert run["raw"]["in_order"] and not f["above_oracle"]
        rates[f["system"], f["budget_bytes"] >> 20] = f["token_hit_rate"]
    print(rates)
    for mib in BUDGETS_MIB:
        assert rates["hybridkv", mib] >= rates["vllm-offload", mib], mib
    # The budgets are not idle: hybridkv's CPU tier serves part of the trace at both.
    assert all(
        run["figures"]["connector_hit_rate"] > 0
        for run in result["runs"]
        if run["figures"]["system"] == "hybridkv"
    )
