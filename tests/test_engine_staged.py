"""Staged decode-time states through a real in-process engine: a long decode crosses a
chunk boundary every `chunk_tokens` tokens, and each state stored there replaces the one
before. They stay in CPU memory until the request finishes; only each request's last
one goes down to disk and Redis (real files, a real `redis-server`)."""

from __future__ import annotations

import re

import pytest
from conftest import tokens
from redis_servers import redis_server, require_redis

from hybridkv.core.keys import chain_seed, chunk_keys, group_key
from hybridkv.core.layout import GroupKind
from hybridkv.engine import generate, scheduler_connector, sync_tiers, worker_connector

pytestmark = pytest.mark.engine

# With 256-token chunks the prompt's state is at 256, decode-time ones at 512 .. 1280; with
# 128-token chunks (vLLM's CPU build without AVX-512 BF16) at 256, then 384 .. 1280.
PROMPT, DECODE = 300, 1100


def test_only_each_requests_last_decode_time_state_reaches_disk_and_redis(
    model_dirs, engine_factory, tmp_path
):
    require_redis()
    with redis_server() as server:
        extra = {"cpu_bytes": "64MiB", "disk_path": str(tmp_path), "redis_url": server.url}
        llm = engine_factory(model_dirs["qwen3-next"], extra)
        prompts = [tokens(PROMPT, seed=s) for s in (130, 131)]
        outs = generate(llm, prompts, max_tokens=DECODE, ignore_eos=True)
        sync_tiers(llm)  # the step reporting the finishes, then every queued write done
        raw = server.client()
        names = raw.keys("*")
        in_redis = {bytes.fromhex(re.search(rb"\{(\w+)\}", n)[1].decode()) for n in names}
        redis_sets = raw.info("commandstats")["cmdstat_set"]["calls"]
    side = scheduler_connector(llm).scheduler_side
    C = side.planner.chunk_tokens
    groups = side.layout.groups
    states = [g for g, s in enumerate(groups) if s.kind is GroupKind.STATE]
    full = [g for g, s in enumerate(groups) if s.kind is GroupKind.FULL]
    expected: set[bytes] = set()
    staged: set[bytes] = set()  # decode-time states a later one replaced
    for prompt, out in zip(prompts, outs, strict=True):
        # The last token sampled is never computed: the request ends at `last` tokens.
        last = len(prompt) + len(out.token_ids) - 1
        keys = chunk_keys(chain_seed(side.layout.fingerprint, None), prompt + out.token_ids, C)
        expected |= {group_key(keys[c], g) for c in range(last // C) for g in full}
        for boundary in range(C, last // C * C + 1, C):
            at = {group_key(keys[boundary // C - 1], g) for g in states}
            if boundary == side.policy.prompt_checkpoint(len(prompt)) or boundary > last - C:
                expected |= at
            elif boundary > PROMPT:
                staged |= at
    # Each request staged at least three (512, 768, 1024 with 256-token chunks).
    assert len(staged) >= 2 * 3 * len(states)
    on_disk = {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kv")}
    assert on_disk == expected and in_redis == expected
    # Written once each, no staged state ever: one SET per entry, one file per entry.
    stats = worker_connector().worker_side.store.stats()
    assert redis_sets == stats["redis"].puts == len(expected)
    assert stats["disk"].puts == len(expected)
    # Every staged state a later one replaced has left CPU memory too.
    assert not any(side.index.in_cpu(k) for k in staged) and side.index.pinned() == 0
