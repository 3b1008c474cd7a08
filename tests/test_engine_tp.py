"""Workers in processes of their own: the `mp` executor with tensor parallelism 2, and a
TP = 1 engine on the same disk directory. (The `mp` executor with TP = 1 and the engine
core in a process of its own are what every server test runs: on the CPU build vLLM's
server turns `uni` into `mp`.)

The scheduler side and each worker share nothing but vLLM's channels (connector
metadata out, worker metadata and transfer results back), so these engines exercise
the whole data path: a hit is reported only once every rank holds every entry, each
rank stores its own shard on disk, and a TP = 1 engine never reads TP = 2 entries.

Each engine runs in a new process (engine_proc.py: vLLM spawns the workers, which needs
a `__main__` guard); its engine core stays in that process, so vLLM's own prefix cache
serves the reference output (a restore must match it exactly). On the 2-core CI machine
each rank gets one core (`VLLM_CPU_OMP_THREADS_BIND="0|1"`).
"""

from __future__ import annotations

import pytest
from conftest import SEED, run_engine_proc, tokens
from serving import drawn_lengths
from test_engine_disk import disk_config, entry_files, gen, hit_tokens, same_output

pytestmark = pytest.mark.engine

(PROMPT,) = drawn_lengths(1, seed=SEED * 100 + 6)  # the seed is in the run's header
TP2 = {
    "engine": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
}


def _store_and_restore(spec: dict, prompt: list[int]) -> dict:
    steps = [gen("cold", prompt), gen("native", prompt), {"op": "reset"}, gen("restored", prompt)]
    return run_engine_proc({**spec, "steps": steps})


@pytest.mark.parametrize("arch", ["qwen3-next", "gemma3"])
def test_tp2_restores_from_memory_and_from_disk_after_a_restart_and_tp1_keeps_apart(
    arch, model_dirs, tmp_path
):
    prompt = tokens(PROMPT, seed=31)
    spec = {"model": model_dirs[arch], "extra": disk_config(tmp_path), **TP2}
    a = _store_and_restore(spec, prompt)
    C = a["chunk_tokens"]
    runs = a["runs"]
    assert runs["native"]["num_cached_tokens"] > 0
    assert runs["restored"]["num_cached_tokens"] == hit_tokens(C, PROMPT)
    assert same_output(runs["restored"], runs["native"])
    snap = a["snapshot"]
    assert snap["held_entries"] == 0 and snap["hook_errors"] == 0, snap
    # Each rank wrote its own shard, in a directory of its own layout.
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2
    assert entry_files(tmp_path) and not entry_files(tmp_path, "*.tmp")

    b = run_engine_proc({**spec, "steps": [gen("from-disk", prompt)]})
    assert b["runs"]["from-disk"]["num_cached_tokens"] == hit_tokens(C, PROMPT)
    assert same_output(b["runs"]["from-disk"], runs["native"])
    assert b["snapshot"]["promotions"] > 0 and b["snapshot"]["failed_promotions"] == 0

    # TP = 1 on the same directory: other layouts, other keys, never read as its own;
    # it stores and restores its own.
    c = _store_and_restore({**spec, "engine": {}, "env": {}}, prompt)
    runs = c["runs"]
    assert runs["cold"]["num_cached_tokens"] == 0
    assert runs["restored"]["num_cached_tokens"] == hit_tokens(C, PROMPT)
    assert same_output(runs["restored"], runs["native"])
