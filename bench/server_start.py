"""How long a test server takes to answer /health: started as users start it (a new
`python -m vllm.entrypoints.openai.api_server`), and forked from the test session's zygote,
which has imported vLLM already (tests/conftest.py). Alternating, side by side, on the
tiny Qwen3-Next; each server is stopped with SIGTERM and must exit 0.

Why: server starts are the largest part of the suite's time on a 2-core machine
(docs/benchmarks.md); this says what the zygote saves on each.

    .venv/bin/python bench/server_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import conftest  # noqa: E402  (the test session's zygote)
import serving  # noqa: E402

from hybridkv.models import make_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=RESULTS / "server_start.json")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hybridkv-server-start-"))
    model = str(make_model("qwen3-next", root / "model", size="tiny"))
    conftest._Zygote.get()  # its own start is paid once a session, not timed here
    ways = {"new interpreter": serving.popen, "forked from the zygote": conftest._forked_server}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name, start in ways.items():
            serving.start_process = start
            t = time.monotonic()
            server = serving.start_server(model, root / f"{r}-{len(seconds[name])}.log")
            up = time.monotonic() - t
            code = server.stop()
            if code != 0:
                raise SystemExit(f"{name}: the server exited {code}; log in {root}")
            seconds[name].append(up)
            print(f"round {r}: {name:24} {up:6.1f} s to healthy", flush=True)
    for name, times in seconds.items():
        print(f"{name:24} median {statistics.median(times):6.1f} s  ({len(times)} starts)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(seconds, indent=2))


if __name__ == "__main__":
    main()
