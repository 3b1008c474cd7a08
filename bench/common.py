"""Helpers the benchmark scripts share (run as `python bench/NAME.py`, so importable)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turn in every round so that drift of a
    noisy machine hits all of them alike; one warm-up round first. Each round starts one
    function later, so none always runs just after the same one (a copy right after
    another that swept the caches ran up to 50% slower)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            if r:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}
