"""`hybridkv demo` (what `make demo` runs) passes on a real engine, and fails where
hybridkv's restore is wrong: its reference continuation comes from vLLM's own prefix hit
before anything is restored. The wrong restore (every entry written as zeros) is a fault
no real input causes, so it is patched in."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine

DEMO = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
if sys.argv[1] == "zeros":
    import torch
    from hybridkv.vllm import worker_side
    real = worker_side.WorkerSide._next_batch
    def zeroed(self):
        batch, touched, spent = real(self)
        return [(c, torch.zeros_like(e)) for c, e in batch], touched, spent
    worker_side.WorkerSide._next_batch = zeroed
from hybridkv.cli import main
sys.exit(main(["demo", "--arch", "qwen3-next", "--size", "tiny", "--model", sys.argv[2],
               "--prompt-tokens", "512", "--cpu-bytes", "256MiB",
               "--kv-cache-bytes", "256MiB"]))
"""


@pytest.mark.parametrize(("restore", "code"), [("real", 0), ("zeros", 1)])
def test_demo_passes_and_fails_a_wrong_restore(model_dirs, restore, code):
    out = subprocess.run(
        [sys.executable, "-c", DEMO, restore, model_dirs["qwen3-next"]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == code, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("demo: OK" if code == 0 else "demo: FAILED") in out.stdout


def test_a_users_model_directory_is_run_as_it_is_never_written_over(tmp_path):
    """`--model DIR` naming a model hybridkv did not make (no marker): the demo and the
    benchmarks run it as it is, and `make_model` refuses to write over it."""
    from hybridkv.models import make_model, model_for

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FileExistsError, match="did not write"):
        make_model("qwen3", mine, size="tiny")
    assert model_for("qwen3", "tiny", mine) == mine
    # `hybridkv make-model` says so as a usage error naming DIR, not a traceback
    from conftest import run_cli

    out = run_cli("make-model", "qwen3", str(mine))
    assert out.returncode == 2 and "DIR" in out.stdout and "Traceback" not in out.stdout
    assert [p.name for p in mine.iterdir()] == ["config.json"]
    assert (mine / "config.json").read_text() == '{"model_type": "llama"}'
