"""Shared fixtures: locally generated tiny models and in-process vLLM engines."""

from __future__ import annotations

import gc
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
    from hybridkv.engine import make_llm

    llms = []

    def start(model_dir, extra=None, **kwargs):
        llm = make_llm(model_dir, extra, **kwargs)
        llms.append(llm)
        return llm

    yield start
    for llm in llms:
        llm.llm_engine.engine_core.shutdown()
    llms.clear()
    gc.collect()
