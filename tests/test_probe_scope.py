"""What a lookup asks the shared tier: only the chunks past the hit CPU memory serves
alone (scheduler_side.SchedulerSide._probe). A boundary below that hit can never be the
one planned, so asking about the states of a conversation's whole history each turn
would only load the round trip. Model-free: hybridkv's scheduler side on real vLLM
`Request`s, the real `Probe` asking a real `redis-server` through the Redis tier; prompt
lengths drawn from the suite's seed."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator

import torch
from conftest import SEED
from redis_servers import redis_server, require_redis

from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import group_key, group_keys
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.core.probe import Probe
from hybridkv.core.tiers.redis import RedisTier
from hybridkv.vllm.metadata import KeyedCopy
from hybridkv.vllm.scheduler_side import SchedulerSide

BLOCK, ATTN, STATE = 16, 64, 32
STATES = (1, 2, 3)


def request(req_id: str, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, prompt, SamplingParams(max_tokens=1), None)


def lookup(side: SchedulerSide, probe: Probe, req) -> int:
    """Ask until answered; between tries, the step's round trip goes out and every rank
    reports the promotions it ordered, all read (as build_meta and the workers' reports)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hit = side.num_new_matched_tokens(req, 0)
        if hit is not None:
            return hit
        probe.send()
        index = side.index
        orders, epoch = index.take_orders(), index.epoch
        promoted = [(epoch, key, True) for key, _ in orders.promote]
        side.worker_reports({r: WorkerReport(epoch, promoted=promoted) for r in range(index.ranks)})
        time.sleep(0.002)
    raise AssertionError("the lookup never got its answer")


def shared_side(tier: RedisTier, name: str, ranks: int = 1) -> tuple[SchedulerSide, list[bytes]]:
    """A scheduler side over a layout of one full-attention group and three recurrent
    ones, with `tier` as its shared tier and the real `Probe` asking it; and the list of
    the keys the probe was asked about."""
    full = GroupSpec(GroupKind.FULL, BLOCK, ATTN, ("attn",))
    states = [GroupSpec(GroupKind.STATE, BLOCK, STATE, (f"gdn.{g}",)) for g in STATES]
    layout = Layout(name, (full, *states))
    planner = Planner(layout.groups)
    asked: list[bytes] = []

    def contains_many(keys):
        asked.extend(keys)
        return tier.contains_many(keys)

    side = SchedulerSide(
        layout,
        planner,
        CheckpointPolicy("prompt_and_end", planner.chunk_tokens),
        StoreIndex(1 << 30, recurrent=True, ranks=ranks),
        True,
        True,
        tiers=[("redis", 1.0)],
        probe=Probe("redis", contains_many, ttl_s=60),
    )
    return side, asked


@contextlib.contextmanager
def shared_tier() -> Iterator[RedisTier]:
    """A Redis tier on a redis-server of its own, closed on exit."""
    require_redis()
    with redis_server() as server:
        tier = RedisTier(server.url, bytes(16), timeout_ms=300, backoff_s=0.05)
        try:
            yield tier
        finally:
            tier.close()


def test_a_next_turn_asks_only_past_its_cpu_hit_and_still_finds_a_longer_boundary():
    with shared_tier() as tier:
        _next_turn(tier)


def _next_turn(tier: RedisTier) -> None:
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    side, asked = shared_side(tier, "test/probe-scope")
    planner, probe, groups = side.planner, side.probe, len(side.layout.groups)
    first_chunks, turn_chunks = rng.randint(4, 9), rng.randint(3, 6)
    turn2_chunks = rng.randint(2, 5)
    history = [rng.randrange(1, 5000) for _ in range(first_chunks * BLOCK + 1)]
    turn = history + [rng.randrange(1, 5000) for _ in range(turn_chunks * BLOCK)]
    later = turn + [rng.randrange(1, 5000) for _ in range(turn2_chunks * BLOCK)]
    print(f"chunks: {first_chunks} in CPU memory, then {turn_chunks} and {turn2_chunks}")

    # The first prompt in CPU memory: its chunks and the states at its checkpoint.
    first = request("first", history)
    st = side._state(first)
    ckpt = planner.max_hit_chunks(len(history))
    keys = side._keys(st, ckpt * BLOCK)
    plan = [EntryCopy(0, c, (0,), (0,)) for c in range(ckpt)]
    plan += [EntryCopy(g, ckpt - 1, (0,), (0,)) for g in STATES]
    side._admit(st, keys, [KeyedCopy(group_key(keys[c.chunk], c.group), c) for c in plan])
    # Another replica stored the next turn's chunks and checkpoint in the shared tier.
    turn_keys = side._keys(side._state(request("other", turn)), len(turn))
    turn_ckpt = planner.max_hit_chunks(len(turn))
    stored = [group_key(k, 0) for k in turn_keys[:turn_ckpt]]
    stored += [group_key(turn_keys[turn_ckpt - 1], g) for g in STATES]
    for key in stored:
        assert tier.put(key, torch.full((ATTN,), 7, dtype=torch.int8))
    tier.flush()

    req = request("later", later)
    assert lookup(side, probe, req) == turn_ckpt * BLOCK  # the shared tier's boundary
    later_keys = side._keys(side._state(req), len(later))
    cap = planner.max_hit_chunks(len(later))
    # Asked: every group of each chunk past the CPU hit; nothing below it.
    assert sorted(asked) == sorted(group_keys(later_keys[ckpt:cap], groups))
    assert not set(asked) & set(group_keys(later_keys[:ckpt], groups))
    probe.close()
