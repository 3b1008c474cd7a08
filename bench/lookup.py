"""Scheduler-side cost of a lookup and of the eviction policy for a long prompt (issue 4:
"well under a millisecond per chunk" at 32k tokens; issue 12: "policy overhead well
under 1 ms per lookup of a 32k-token prompt").

The lookup is hybridkv's own `SchedulerSide.num_new_matched_tokens` on a real vLLM
`Request` (no engine): chain keys over the prompt, the hit rule against the scheduler
side's index, the pins and recency updates of the hit, the branch-point measure. It
never touches an entry's bytes, so no tier takes part. The layout is Qwen3-Next's shape
(one full-attention group, three recurrent groups, 256-token chunks).

Cases: nothing stored; the whole prompt stored (a hit to its checkpoint; a request's
chain keys are computed at its first lookup and reused by the next); the whole prompt on
disk only, asked again while its promotions are under way (what the scheduler asks of
every waiting request in every step of a restore); and admitting one
boundary into a CPU budget full of others (`StoreIndex.admit_boundary`, which picks what
to evict by the policy), at several numbers of boundaries held.

    .venv/bin/python bench/lookup.py --prompt-tokens 32768
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from common import RESULTS

from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import chunk_keys, group_key
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.vllm.scheduler_side import SchedulerSide

BLOCK = 256
ATTN_BYTES, STATE_BYTES = 1024, 512  # per entry: the bookkeeping is measured, not bytes


def layout() -> Layout:
    full = GroupSpec(GroupKind.FULL, BLOCK, ATTN_BYTES, ("attn.3",))
    states = [GroupSpec(GroupKind.STATE, BLOCK, STATE_BYTES, (f"gdn.{i}",)) for i in range(3)]
    return Layout("bench/lookup", (full, *states))


def request(req_id: str, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, prompt, SamplingParams(max_tokens=1), None)


def side_with(capacity: int, disk: bool = False) -> SchedulerSide:
    lay = layout()
    planner = Planner(lay.groups)
    index = StoreIndex(capacity, disk=disk, recurrent=True)
    policy = CheckpointPolicy("prompt_and_end", planner.chunk_tokens)
    tiers = [("disk", 1.0)] if disk else []
    return SchedulerSide(lay, planner, policy, index, enabled=True, below=disk, tiers=tiers)


def store_prompt(side: SchedulerSide, req, keys: list[bytes]) -> None:
    """Every full-attention chunk of the prompt and the states at its checkpoint, as a
    cold run admits them."""
    planner, index = side.planner, side.index
    ckpt = planner.max_hit_chunks(req.num_prompt_tokens)
    for c in range(ckpt):
        assert index.admit(group_key(keys[c], 0), ATTN_BYTES)
    states = [(group_key(keys[ckpt - 1], g), STATE_BYTES) for g in (1, 2, 3)]
    needs = [group_key(keys[c], 0) for c in range(ckpt)]
    assert index.admit_boundary(states, needs, ckpt * BLOCK, 3 * STATE_BYTES)


def samples(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of each of `n` calls."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of a call, after a warm-up call."""
    fn()
    return statistics.median(samples(fn, repeats))


def admission_cost(held: int, count: int) -> tuple[float, float, float]:
    """Seconds to admit one boundary (two chunks, three states) into a CPU budget
    holding `held` such boundaries on chains of two (one of each pair superseded): the
    first admission that needs room, then the mean and longest of `count` more. Eviction
    frees ahead (core/index.py), so most admissions find room and a few choose victims;
    the first choice also drops every chunk stored since from the index's list of
    possible orphans (they all belong to boundaries), once."""
    per = 2 * ATTN_BYTES + 3 * STATE_BYTES
    index = StoreIndex(held * per, recurrent=True)
    n = 0

    def add() -> None:
        nonlocal n
        chain = (n // 2).to_bytes(8, "little")
        c = n % 2
        key = lambda ch, g: group_key(chain + ch.to_bytes(8, "little"), g)  # noqa: E731
        for ch in (2 * c, 2 * c + 1):
            index.admit(key(ch, 0), ATTN_BYTES)
        parent = index.boundary_id(key(1, 1)) if c else None
        states = [(key(2 * c + 1, g), STATE_BYTES) for g in (1, 2, 3)]
        needs = [key(ch, 0) for ch in range(2 * c + 2)]
        index.admit_boundary(states, needs, (2 * c + 2) * BLOCK, per, parent)
        index.take_orders()  # as each engine step does
        n += 1

    for _ in range(held):
        add()
    first = samples(add, 1)[0]
    times = samples(add, count)
    assert index.stats.evicted_superseded > 0
    return first, statistics.mean(times), max(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--held", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--json", type=Path, default=RESULTS / "lookup.json")
    args = p.parse_args()

    rng = random.Random(3)
    prompt = [rng.randrange(1, 150000) for _ in range(args.prompt_tokens)]
    chunks = args.prompt_tokens // BLOCK
    results: dict[str, float] = {}

    side = side_with(1 << 40)
    miss = request("miss", prompt)
    results["lookup, miss (nothing stored)"] = timed(
        lambda: side.num_new_matched_tokens(miss, 0), args.repeats
    )
    hit = request("hit", prompt)
    keys = side._keys(side._state(hit), len(prompt))
    results["of which: chain keys (blake3)"] = timed(
        lambda: chunk_keys(side._state(hit).ctx.seed, prompt, BLOCK), args.repeats
    )
    store_prompt(side, hit, keys)
    assert side.num_new_matched_tokens(hit, 0) == side.policy.prompt_checkpoint(len(prompt))
    results["lookup, hit to the prompt's checkpoint"] = timed(
        lambda: side.num_new_matched_tokens(hit, 0), args.repeats
    )
    waiting = side_with(1 << 40, disk=True)
    req = request("waiting", prompt)
    ckpt = waiting.planner.max_hit_chunks(len(prompt))
    on_disk = [group_key(k, 0) for k in keys[:ckpt]]
    on_disk += [group_key(keys[ckpt - 1], g) for g in (1, 2, 3)]
    listing = WorkerReport(listed=True, disk=[(k, True) for k in on_disk])
    waiting.index.apply(0, listing)
    assert waiting.num_new_matched_tokens(req, 0) is None  # its promotions start
    results["lookup, waiting for its promotions"] = timed(
        lambda: waiting.num_new_matched_tokens(req, 0), args.repeats
    )
    for held in args.held:
        first, mean, longest = admission_cost(held, max(held, 200))
        results[f"admit a boundary, {held} held: first"] = first
        results[f"admit a boundary, {held} held: mean"] = mean
        results[f"admit a boundary, {held} held: longest"] = longest

    print(f"scheduler side, {args.prompt_tokens}-token prompt ({chunks} chunks, 4 groups)")
    print(f"{'':46}{'total ms':>10}{'us/chunk':>10}")
    for name, secs in results.items():
        per_chunk = f"{secs * 1e6 / chunks:10.1f}" if name.startswith(("lookup", "of")) else ""
        print(f"{name:46}{secs * 1e3:10.3f}{per_chunk}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"prompt_tokens": args.prompt_tokens, "seconds": results}, indent=2)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
