"""A real server under vLLM's own benchmark client (`vllm.benchmarks.serve`), with and
without hybridkv: request throughput, TTFT p50 / p99, the tokens vLLM's own prefix cache
and hybridkv served, and what hybridkv lost for want of a recurrent state
(`short_of_state`), for two passes of the same requests in a row (issue 26).

Workloads, both from vLLM's benchmark datasets (seeded):
  prefix_repetition  24 prefixes of 1536 tokens, each followed by 4 suffixes of 64
  random-prefix      a 1024-token prefix shared by every prompt, then 64-768 random tokens
The server is the one users run (`python -m vllm.entrypoints.openai.api_server`, with
the model's tokenizer: the client sends text) on a 64 MiB KV cache, smaller than a
pass's working set, so vLLM's own cache cannot keep it all.

    .venv/bin/python bench/serve_load.py                       # qwen3-next small
    .venv/bin/python bench/serve_load.py --size tiny --prompts 32
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import serving  # noqa: E402  (the test harness: one way to start and drive the server)

from hybridkv.server import server_args  # noqa: E402

WORKLOADS = {
    "prefix_repetition": [
        "--dataset-name=prefix_repetition",
        "--prefix-repetition-prefix-len=1536",
        "--prefix-repetition-suffix-len=64",
        "--prefix-repetition-num-prefixes=24",
        "--prefix-repetition-output-len=16",
    ],
    "random-prefix": [
        "--dataset-name=random",
        "--random-prefix-len=1024",
        "--random-input-len=416",
        "--random-output-len=16",
        "--random-range-ratio=0.84",
    ],
}
# vLLM's counters, in tokens, summed over their labels.
VLLM_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "vllm_hit_tokens": "vllm:prefix_cache_hits_total",
    "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "hybridkv_hit_tokens": "vllm:hybridkv_hit_tokens_total",
    "short_of_state": "vllm:hybridkv_short_of_state_tokens_total",
}


def start(model: str, hybridkv: bool, kv_mib: int, log: Path) -> serving.Server:
    port = serving.free_port()
    extra = {"cpu_bytes": "2GiB"} if hybridkv else None
    vllm_args = (
        "--enforce-eager",
        "--max-model-len=4096",
        f"--kv-cache-memory-bytes={kv_mib * serving.MiB}",
        "--enable-prompt-tokens-details",
    )
    cmd = server_args(model, extra, port=port, vllm_args=vllm_args)
    return serving.launch(cmd, model, port, log)


def client_pass(srv: serving.Server, workload: str, prompts: int, concurrency: int) -> dict:
    """One run of vLLM's benchmark client; its result and the server counters' growth."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend=vllm",
            f"--base-url={srv.base_url}",
            f"--model={srv.model}",
            f"--tokenizer={srv.model}",
            f"--num-prompts={prompts}",
            f"--max-concurrency={concurrency}",
            "--seed=0",
            "--ignore-eos",
            "--disable-tqdm",
            "--percentile-metrics=ttft",
            "--metric-percentiles=50,99",
            *WORKLOADS[workload],
        ]
    )
    before = srv.metrics()
    with contextlib.redirect_stdout(io.StringIO()):
        result = main(args)
    after = srv.metrics()
    grown = {k: after.get(m, 0.0) - before.get(m, 0.0) for k, m in VLLM_COUNTERS.items()}
    return {
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "request_throughput": result["request_throughput"],
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        **grown,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3-next")
    ap.add_argument("--size", default="small")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json", type=Path, default=RESULTS / "serve_load.json")
    args = ap.parse_args()

    from hybridkv.models import make_model

    root = Path(tempfile.mkdtemp(prefix="hybridkv-serve-load-"))
    model = str(make_model(args.arch, root / args.arch, size=args.size))
    rows = []
    for workload in args.workloads.split(","):
        for system in ("vllm", "hybridkv"):
            srv = start(model, system == "hybridkv", args.kv_mib, root / f"{workload}-{system}.log")
            try:
                for n in (1, 2):
                    t = time.perf_counter()
                    r = client_pass(srv, workload, args.prompts, args.concurrency)
                    r.update(workload=workload, system=system, run=n)
                    r["seconds"] = time.perf_counter() - t
                    rows.append(r)
                    queried = r["prompt_tokens"] - r["vllm_hit_tokens"]
                    print(
                        f"{workload:>17} {system:>8} pass {n}: {r['completed']} ok "
                        f"{r['failed']} failed, {r['request_throughput']:.2f} req/s, TTFT p50 "
                        f"{r['ttft_p50_ms'] / 1e3:.2f} s p99 {r['ttft_p99_ms'] / 1e3:.2f} s; "
                        f"tokens: prompt {r['prompt_tokens']:.0f}, vLLM's hit "
                        f"{r['vllm_hit_tokens']:.0f}, hybridkv's {r['hybridkv_hit_tokens']:.0f}, "
                        f"short of state {r['short_of_state']:.0f} "
                        f"({r['short_of_state'] / max(queried, 1):.2%} of {queried:.0f} queried)",
                        flush=True,
                    )
            finally:
                srv.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": vars(args) | {"json": None}, "rows": rows}))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
