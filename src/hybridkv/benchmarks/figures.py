"""What every benchmark reports the same way: percentiles, where results go, and a
matplotlib figure saved without a display."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 1 << 20


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0 < q < 1, to the percent) of `values`, inclusive method, so a
    benchmark with a few repeats still reports its p90 from the samples it has."""
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def write_result(result: dict[str, Any], path: Path, draw: Callable[[Any], None]) -> Path:
    """Write `result` as JSON at `path` and the figure `draw(ax)` makes as a PNG beside
    it; the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    fig, ax = plt.subplots(figsize=(6.4, 4))
    try:
        draw(ax)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        png = path.with_suffix(".png")
        fig.savefig(png, dpi=110)
    finally:
        plt.close(fig)
    return png


def engine_process(
    module: str,
    spec: dict[str, Any],
    what: str,
    log: Path | None = None,
    pythonpath: Path | None = None,
) -> dict[str, Any]:
    """Run `python -m module` with `spec` as JSON on stdin and return the JSON of its
    last `RESULT {...}` line. One engine per process: no run sees another's caches, a
    restart is a real one, and the caller never imports vLLM. The child's output is
    appended to `log`, and its tail is raised if it fails; `pythonpath` puts another
    hybridkv source first (and runs there)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        cwd=pythonpath or None,
    )
    out = proc.stdout + proc.stderr
    if log is not None:
        with open(log, "a") as f:
            f.write(f"==== {what}\n{out}\n")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed:\n{out[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
