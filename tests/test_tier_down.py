"""A tier a worker reports down is planned around (scheduler_side.SchedulerSide
`_tier_health`): while any worker has its Redis tier down, that tier answers every read
with a miss, so a lookup must neither ask the probe about it nor plan promotions from
it; once every worker has it back, its entries serve hits again. Model-free: the
scheduler side on real vLLM `Request`s, the real `Probe` asking a real `redis-server`
through the Redis tier; prompt lengths drawn from the suite's seed."""

from __future__ import annotations

import random
import time

import torch
from conftest import SEED
from redis_servers import redis_server, require_redis
from test_probe_scope import ATTN, BLOCK, STATE, STATES, request

from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import group_key
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.core.probe import Probe
from hybridkv.core.tiers.redis import RedisTier
from hybridkv.vllm.scheduler_side import SchedulerSide


def test_a_tier_down_on_any_worker_is_not_asked_nor_promoted_from_until_all_have_it_back():
    require_redis()
    with redis_server() as server:
        tier = RedisTier(server.url, bytes(16), timeout_ms=300, backoff_s=0.05)
        try:
            _planned_around(tier)
        finally:
            tier.close()


def _planned_around(tier: RedisTier) -> None:
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    full = GroupSpec(GroupKind.FULL, BLOCK, ATTN, ("attn",))
    states = [GroupSpec(GroupKind.STATE, BLOCK, STATE, (f"gdn.{g}",)) for g in STATES]
    layout = Layout("test/tier-down", (full, *states))
    planner = Planner(layout.groups)
    asked: list[bytes] = []

    def contains_many(keys):
        asked.extend(keys)
        return tier.contains_many(keys)

    probe = Probe("redis", contains_many, ttl_s=60)
    side = SchedulerSide(
        layout,
        planner,
        CheckpointPolicy("prompt_and_end", planner.chunk_tokens),
        StoreIndex(1 << 30, recurrent=True, ranks=2),
        True,
        True,
        tiers=[("redis", 1.0)],
        probe=probe,
    )
    prompt = [rng.randrange(1, 5000) for _ in range(rng.randint(3, 9) * BLOCK + 1)]
    print(f"prompt of {len(prompt)} tokens")
    # Another replica stored the prompt's chunks and checkpoint in the shared tier.
    keys = side._keys(side._state(request("other", prompt)), len(prompt))
    ckpt = planner.max_hit_chunks(len(prompt))
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
    assert _lookup(side, probe, request("b", prompt)) == ckpt * BLOCK
    assert asked
    probe.close()


def _lookup(side: SchedulerSide, probe: Probe, req) -> int:
    """Ask until answered; between tries the step's round trip goes out and both ranks
    report the promotions it ordered, all read."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hit = side.num_new_matched_tokens(req, 0)
        if hit is not None:
            return hit
        probe.send()
        orders, epoch = side.index.take_orders(), side.index.epoch
        promoted = [(epoch, key, True) for key, _ in orders.promote]
        side.worker_reports({r: WorkerReport(epoch, promoted=promoted) for r in (0, 1)})
        time.sleep(0.002)
    raise AssertionError("the lookup never got its answer")
