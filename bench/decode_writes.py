"""Bytes written to the tiers below CPU memory per generated token, in a long-decode
workload (issue 27: staged decode-time states stay in CPU memory until their request
finishes; only its last one goes down).

An in-process engine (tiny Qwen3-Next, 256-token chunks: one recurrent state of three
groups per boundary; CPU memory + disk + Redis, both written through) generates
`--decode` tokens for each of `--requests` prompts of `--prompt-tokens`, crossing a
chunk boundary every 256 tokens. Counted by the worker: the entry bytes each lower tier
accepted (`TieredStore.stored_bytes`, what its writer threads then write), and Redis's
own count of SET and UNLINK commands (`INFO commandstats`), over the tokens generated.

    .venv/bin/python bench/decode_writes.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import engine_with_redis, random_prompts

from hybridkv.engine import generate, sync_tiers, worker_connector


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--decode", type=int, default=2000)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    prompts = random_prompts(args.requests, args.prompt_tokens)
    with engine_with_redis(disk=True) as (llm, server):
        outs = generate(llm, prompts, max_tokens=args.decode, ignore_eos=True)
        sync_tiers(llm)  # the finishes reported, every queued write done
        stored = dict(worker_connector().worker_side.store.stored_bytes)
        commands = server.client().info("commandstats")
    generated = sum(len(o.token_ids) for o in outs)
    row = {
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "generated_tokens": generated,
        "disk_bytes": stored["disk"],
        "redis_bytes": stored["redis"],
        "lower_bytes_per_token": (stored["disk"] + stored["redis"]) / generated,
        "redis_sets": commands.get("cmdstat_set", {}).get("calls", 0),
        "redis_unlinks": commands.get("cmdstat_unlink", {}).get("calls", 0),
    }
    print(json.dumps(row, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
