"""What every benchmark reports the same way: percentiles, where results go, and a
matplotlib figure saved without a display."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv import forked

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


def _setting(name: str) -> bool:
    """A variable hybridkv's config reads (HYBRIDKV_HOME only says where models are)."""
    return name.startswith("HYBRIDKV_") and name != "HYBRIDKV_HOME"


def engine_process(
    module: str,
    spec: dict[str, Any],
    what: str,
    log: Path | None = None,
    pythonpath: Path | None = None,
) -> dict[str, Any]:
    """Run `python -m module` with `spec` as JSON on stdin and return the JSON of its
    last `RESULT {...}` line. One engine per process: no run sees another's caches and a
    restart is a real one. The process is forked from this one once it has imported vLLM
    (`hybridkv.forked`: a run starts about 13 s sooner on 2 cores) where it may fork, else
    a fresh interpreter; `pythonpath` (another hybridkv source, run there) always gets a
    fresh one. The child's output is appended to `log`, and its tail is raised if it
    fails. hybridkv's settings come from `spec` alone: a `HYBRIDKV_*` variable left in
    the shell (a disk or Redis tier, say) would give one system tiers the others lack."""
    env = {k: v for k, v in os.environ.items() if not _setting(k)}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if pythonpath is None:
        forked.preload()
        fork = forked.can_fork()
    else:
        fork = False
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    if fork:
        code, stdout, stderr = _forked(module, json.dumps(spec), env)
    else:
        proc = subprocess.run(
            [sys.executable, "-m", module],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            env=env,
            cwd=pythonpath or None,
        )
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    out = stdout + stderr
    if log is not None:
        with open(log, "a") as f:
            f.write(f"==== {what}\n{out}\n")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if code != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit status {code}):\n{out[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _forked(module: str, stdin: str, env: dict[str, str]) -> tuple[int, str, str]:
    """`python -m module` forked from this process: exit status, stdout, stderr."""
    with (
        tempfile.TemporaryFile("w+") as inp,
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
    ):
        inp.write(stdin)
        inp.flush()
        inp.seek(0)
        pid = forked.fork_child(
            lambda: forked.run_module(module), env, inp.fileno(), out.fileno(), err.fileno()
        )
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read(), err.read()
