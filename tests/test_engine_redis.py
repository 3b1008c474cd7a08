"""The shared Redis tier through real engines: what one engine process stores, another
(its own CPU memory, no shared disk) restores with identical output; the load weights
decide which lower tier serves a hit; a dead server costs hits, never requests or
correctness; a damaged value is a counted miss; a Redis Cluster serves the same hit; a
reset on one replica leaves the others' hits.
Real `redis-server` processes on loopback (tests/redis_servers.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from conftest import EngineProc, run_engine_proc, tokens
from redis_servers import redis_cluster, redis_server, require_redis
from test_engine_disk import PROMPT, gen, hit_tokens, same_but_rounding, same_output

pytestmark = pytest.mark.engine


@pytest.fixture(autouse=True)
def _needs_redis():
    require_redis()


def redis_config(url: str, **more) -> dict:
    return {"cpu_bytes": "64MiB", "redis_url": url, "redis_timeout_ms": 500, **more}


@contextlib.contextmanager
def shared_redis(cluster: bool) -> Iterator[dict]:
    """Settings of a Redis tier on a new standalone server, or on a new 3-master
    Redis Cluster reached through one node."""
    if not cluster:
        with redis_server() as server:
            yield redis_config(server.url)
        return
    with redis_cluster(3) as nodes:
        yield redis_config(nodes[1].url, redis_cluster=True)


@pytest.mark.parametrize(
    ("arch", "cluster"),
    [("qwen3-next", False), ("gemma3", True)],
    ids=["qwen3-next", "gemma3-cluster"],
)
def test_an_engine_restores_what_another_stored_in_redis(arch, cluster, model_dirs):
    prompt = tokens(PROMPT, seed=90)
    with shared_redis(cluster) as extra:
        spec = {"model": model_dirs[arch], "extra": extra}
        a = run_engine_proc({**spec, "steps": [gen("cold", prompt), gen("native", prompt)]})
        b = run_engine_proc({**spec, "steps": [gen("remote", prompt), gen("again", prompt)]})
    assert b["runs"]["remote"]["num_cached_tokens"] == hit_tokens(b["chunk_tokens"])
    assert same_output(b["runs"]["remote"], a["runs"]["native"])
    snap = b["snapshot"]
    assert snap["promoted_from"].get("redis", 0) > 0 and snap["probe_round_trips"] >= 1
    assert snap["held_entries"] == 0


def test_load_weights_pick_the_tier_that_serves_and_the_hit_stays_in_cpu(model_dirs, tmp_path):
    """One engine stores a prompt in both lower tiers; a new engine favouring disk, then
    one favouring Redis, each restores it from the tier it favours only."""
    prompt = tokens(PROMPT, seed=91)
    with redis_server() as server:

        def spec(favoured: str | None) -> dict:
            weights = {"disk": 1.0, "redis": 1.0}
            if favoured is not None:
                weights[favoured] = 2.0
            tiers = [
                {"kind": "cpu", "bytes": "64MiB"},
                {"kind": "disk", "path": str(tmp_path), "load_weight": weights["disk"]},
                {"kind": "redis", "url": server.url, "load_weight": weights["redis"]},
            ]
            return {"model": model_dirs["qwen3-next"], "extra": {"tiers": tiers}}

        a = run_engine_proc({**spec(None), "steps": [gen("cold", prompt), {"op": "flush"}]})
        steps = [gen("restored", prompt), gen("from_cpu", prompt, fresh=False)]
        restores = {f: run_engine_proc({**spec(f), "steps": steps}) for f in ("disk", "redis")}
    for favoured, b in restores.items():
        hit = hit_tokens(b["chunk_tokens"])
        assert b["runs"]["restored"]["num_cached_tokens"] == hit
        promoted = b["snapshot"]["promoted_from"]
        assert set(promoted) == {favoured}, promoted
        # The next request hits (vLLM's own cache or hybridkv's CPU memory), no new reads.
        assert b["runs"]["from_cpu"]["num_cached_tokens"] >= hit
        assert same_output(b["runs"]["from_cpu"], b["runs"]["restored"])
    assert same_output(restores["disk"]["runs"]["restored"], restores["redis"]["runs"]["restored"])
    # and what they restored is what the first engine computed
    assert same_but_rounding(restores["disk"]["runs"]["restored"], a["runs"]["cold"])


def damage_every_value(raw) -> int:
    """Behind the tier's back: flip a byte of one value in three, cut 7 bytes off the
    next, replace the third with a foreign one of the same size; how many values."""
    keys = sorted(raw.keys("*"))
    for i, key in enumerate(keys):
        value = raw.get(key)
        mid = len(value) // 2
        if i % 3 == 0:
            value = value[:mid] + bytes([value[mid] ^ 0xFF]) + value[mid + 1 :]
        elif i % 3 == 1:
            value = value[: len(value) - 7]
        else:
            value = b"FOREIGN" + bytes(len(value))
        raw.set(key, value)
    return len(keys)


def test_a_dead_redis_costs_hits_not_requests_and_damaged_values_are_misses(model_dirs):
    """Redis killed: requests are served, from the engine's own memory where it can.
    Started again (empty): the next engine's stores reach it. Then every value is
    damaged behind the tier's back: the engine after that sees the keys, tries to
    promote them, finds each unusable, counts it and computes the prompt instead, with
    the cold run's output."""
    prompt, other = tokens(PROMPT, seed=92), tokens(PROMPT, seed=93)
    with redis_server() as server:
        spec = {"model": model_dirs["qwen3-next"], "extra": redis_config(server.url)}
        a = run_engine_proc({**spec, "steps": [gen("cold", prompt), gen("native", prompt)]})
        server.kill()
        b = run_engine_proc(
            {**spec, "steps": [gen("no_redis", prompt), gen("other", other), gen("mine", other)]}
        )
        server.start()  # back (empty): the tier comes up again and takes stores
        c = run_engine_proc({**spec, "steps": [gen("cold", other), {"op": "flush"}]})
        assert damage_every_value(server.client()) > 0, "engine C stored nothing in Redis"
        d = run_engine_proc({**spec, "steps": [gen("damaged", other)]})
    runs = b["runs"]
    assert runs["no_redis"]["num_cached_tokens"] == 0
    assert runs["no_redis"]["token_ids"] == a["runs"]["cold"]["token_ids"]
    # Its own CPU memory still works while Redis is down.
    assert runs["mine"]["num_cached_tokens"] >= hit_tokens(b["chunk_tokens"])
    assert c["stats"]["redis"]["puts"] > 0
    damaged = d["runs"]["damaged"]
    assert damaged["num_cached_tokens"] == 0
    assert damaged["token_ids"] == c["runs"]["cold"]["token_ids"]
    assert d["snapshot"]["failed_promotions"] > 0
    assert d["stats"]["redis"]["corrupt"] > 0


def test_a_reset_on_one_replica_leaves_the_shared_entries_to_the_others(model_dirs, tmp_path):
    """Replicas share one Redis. C stores a prompt and exits. A stores another, then resets
    its cache (`reset_prefix_cache(reset_connector=True)`, as after new weights) and
    serves it again, while B runs beside it. The reset forgets A's own view only: A finds
    its prompt in Redis again, and B restores both prompts from Redis with the output of
    vLLM's own prefix hit in the replica that computed it."""
    mine, theirs = tokens(PROMPT, seed=94), tokens(PROMPT, seed=95)
    reset = tmp_path / "a_reset"
    with redis_server() as server:
        spec = {"model": model_dirs["qwen3-next"], "extra": redis_config(server.url)}
        c = run_engine_proc(
            {**spec, "steps": [gen("cold", theirs), gen("native", theirs), {"op": "flush"}]}
        )
        b = EngineProc(
            {
                **spec,
                "steps": [
                    {"op": "wait", "path": str(reset)},
                    gen("theirs", theirs),
                    gen("mine", mine),
                ],
            }
        )
        a = EngineProc(
            {
                **spec,
                "steps": [
                    gen("cold", mine),
                    gen("native", mine),
                    {"op": "flush"},
                    {"op": "reset", "connector": True},
                    gen("after_reset", mine),  # its workers clear in this request's first step
                    {"op": "touch", "path": str(reset)},
                ],
            }
        )
        a_out, b_out = a.result(), b.result()
    hit = hit_tokens(b_out["chunk_tokens"])
    runs = b_out["runs"]
    assert runs["theirs"]["num_cached_tokens"] == hit == runs["mine"]["num_cached_tokens"]
    assert same_output(runs["theirs"], c["runs"]["native"])
    assert same_output(runs["mine"], a_out["runs"]["native"])
    assert b_out["snapshot"]["promoted_from"].get("redis", 0) > 0
    after = a_out["runs"]["after_reset"]
    assert after["num_cached_tokens"] == hit and same_output(after, a_out["runs"]["native"])
    assert a_out["snapshot"]["promoted_from"].get("redis", 0) > 0
