"""How many lookups share one Redis probe round trip when 32 new prompts arrive at once
(issue 27: every pending lookup's unknown keys in one round trip).

An in-process engine (tiny Qwen3-Next, CPU memory + Redis) on its own `redis-server`
gets `--prompts` new prompts in one `generate`: first cold (Redis holds none of them,
every lookup asks), then again with vLLM's own cache and hybridkv's CPU memory emptied
(Redis holds them all: once the cold phase's answers have lapsed, every lookup asks, and
hits). Counted in the scheduler side: the lookups that waited for a probe
(`SchedulerSide._probe` answered "still asking"), and the probe's round trips (calls of
the tier's `contains_many`); lookups per round trip is their ratio.

    .venv/bin/python bench/redis_probe.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import engine_with_redis, random_prompts

from hybridkv.engine import drop_cpu_tier, generate, scheduler_connector


def count_probes(side) -> dict[str, object]:
    """Wrap the scheduler side's probe: requests that waited for it, round trips."""
    counts: dict[str, object] = {"waited": set(), "round_trips": 0, "keys": 0}
    probe, ask = side._probe, side.probe._contains_many

    def probing(keys, local_tokens, num_prompt_tokens):
        asking = probe(keys, local_tokens, num_prompt_tokens)
        if asking:
            counts["waited"].add(keys[0])  # the prompt's first chain key names it
        return asking

    def contains_many(keys):
        counts["round_trips"] += 1
        counts["keys"] += len(keys)
        return ask(keys)

    side._probe = probing
    side.probe._contains_many = contains_many
    return counts


def phase(llm, side, prompts: list[list[int]]) -> dict[str, float]:
    counts = count_probes(side)
    outs = generate(llm, prompts, max_tokens=1)
    lookups, trips = len(counts["waited"]), counts["round_trips"]
    return {
        "lookups_waiting": lookups,
        "round_trips": trips,
        "keys_asked": counts["keys"],
        "lookups_per_round_trip": lookups / trips if trips else 0.0,
        "hit_tokens": sum(o.num_cached_tokens for o in outs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=700)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    prompts = random_prompts(args.prompts, args.prompt_tokens)
    with engine_with_redis(max_num_seqs=args.prompts) as (llm, _):
        side = scheduler_connector(llm).scheduler_side
        rows = {"cold": phase(llm, side, prompts)}
        llm.reset_prefix_cache()
        drop_cpu_tier(llm)
        time.sleep(side.probe.ttl_s)  # the cold phase's answers ("absent") lapse
        rows["from_redis"] = phase(llm, side, prompts)
    print(
        f"{'phase':>10} {'lookups':>8} {'round trips':>11} {'lookups/trip':>12} {'hit tokens':>10}"
    )
    for name, r in rows.items():
        print(
            f"{name:>10} {r['lookups_waiting']:>8} {r['round_trips']:>11} "
            f"{r['lookups_per_round_trip']:>12.2f} {r['hit_tokens']:>10}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"prompts": args.prompts, "phases": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
