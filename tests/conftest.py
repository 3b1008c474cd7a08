"""Shared fixtures: locally generated tiny models and in-process vLLM engines."""

from __future__ import annotations

import os
import random

import pytest

# Engines run inside the test process so tests can reach both connector sides.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    from hybridkv.models import ARCHS, make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(arch, root / arch, size="tiny")) for arch in ARCHS}


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


@pytest.fixture
def engine_factory():
    """Start engines; shut them all down when the test ends."""
    from hybridkv.engine import make_llm, shutdown

    llms = []

    def start(model_dir, extra=None, **kwargs):
        llm = make_llm(model_dir, extra, **kwargs)
        llms.append(llm)
        return llm

    yield start
    for llm in llms:
        shutdown(llm)
    llms.clear()


ENGINE_PROC = os.path.join(os.path.dirname(__file__), "engine_proc.py")


class EngineProc:
    """An engine in a new Python process (see engine_proc.py), with no PYTHONHASHSEED.

    Its output is drained by a thread: processes that wait on each other must never block
    on a full pipe, and a pipe (unlike a file) is not cut short by a file-size limit.
    """

    def __init__(self, spec: dict):
        import json
        import subprocess
        import sys
        import threading

        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        self.proc = subprocess.Popen(
            [sys.executable, ENGINE_PROC],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.proc.stdin.write(json.dumps(spec))
        self.proc.stdin.close()
        self._out: list[str] = []
        self._reader = threading.Thread(target=lambda: self._out.extend(self.proc.stdout))
        self._reader.start()

    def kill(self) -> None:
        """SIGKILL: no exit hook runs, queued writes are lost mid-way."""
        self.proc.kill()
        self.proc.wait()
        self._reader.join()

    def result(self, timeout: float = 600) -> dict:
        import json

        self.proc.wait(timeout)
        self._reader.join()
        out = "".join(self._out)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert self.proc.returncode == 0 and lines, f"engine process failed:\n{out[-4000:]}"
        return json.loads(lines[-1][len("RESULT ") :])


def run_engine_proc(spec: dict) -> dict:
    return EngineProc(spec).result()
