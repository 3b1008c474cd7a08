"""A tier a worker reports down is planned around (scheduler_side.SchedulerSide
`_tier_health`): while any worker has its Redis tier down, that tier answers every read
with a miss, so a lookup must neither ask the probe about it nor plan promotions from
it; once every worker has it back, its entries serve hits again. Model-free: the
scheduler side on real vLLM `Request`s, the real `Probe` asking a real `redis-server`
through the Redis tier; prompt lengths drawn from the suite's seed."""

from __future__ import annotations

import random

import torch
from conftest import SEED
from test_probe_scope import ATTN, BLOCK, STATES, lookup, request, shared_side, shared_tier

from hybridkv.core.index import WorkerReport
from hybridkv.core.keys import group_key


def test_a_tier_down_on_any_worker_is_not_asked_nor_promoted_from_until_all_have_it_back():
    print(f"seed {SEED}")
    with shared_tier() as tier:
        rng = random.Random(SEED)
        side, asked = shared_side(tier, "test/tier-down", ranks=2)
        prompt = [rng.randrange(1, 5000) for _ in range(rng.randint(3, 9) * BLOCK + 1)]
        print(f"prompt of {len(prompt)} tokens")
        # Another replica stored the prompt's chunks and checkpoint in the shared tier.
        keys = side._keys(side._state(request("other", prompt)), len(prompt))
        ckpt = side.planner.max_hit_chunks(len(prompt))
        stored = [group_key(k, 0) for k in keys[:ckpt]]
        stored += [group_key(keys[ckpt - 1], g) for g in STATES]
        for key in stored:
            assert tier.put(key, torch.full((ATTN,), 7, dtype=torch.int8))
        tier.flush()

        def report(rank: int, down: list[str]) -> None:
            side.worker_reports({rank: WorkerReport(side.index.epoch, down=down)})

        report(1, ["redis"])  # one rank's tier is down, the other's up
        report(0, [])
        assert side.num_new_matched_tokens(request("a", prompt), 0) == 0  # a miss, at once
        assert not asked and not side.index.take_orders().promote
        report(1, [])  # back on every rank: found and promoted again
        assert lookup(side, side.probe, request("b", prompt)) == ckpt * BLOCK
        assert asked
        side.probe.close()
