"""The shared-tier probe (core/probe.py): asks off the caller's thread, every lookup of a
step in one round trip, answers stay fresh for a while, a failed read or a raising tier
is an absence."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import Clock
from redis_servers import redis_server, require_redis

from hybridkv.core import probe as probe_module
from hybridkv.core.probe import Probe


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(probe_module, "time", c)
    return c


def wait_answered(probe: Probe, keys: list[bytes]) -> list[bytes]:
    """Poll as the scheduler does: a lookup, then the step's `send` (the background
    round trip must come back; the deadline is only against a hang)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held, asking = probe.held(keys)
        if not asking:
            return held
        probe.send()
        time.sleep(0.005)
    raise AssertionError("the probe never answered")


def test_asks_in_the_background_once_and_answers_from_memory_after():
    stored = {b"a", b"c"}
    gate = threading.Event()
    calls: list[list[bytes]] = []

    def contains_many(keys):
        assert gate.wait(60)
        calls.append(list(keys))
        return [k in stored for k in keys]

    probe = Probe("redis", contains_many, ttl_s=60)
    held, asking = probe.held([b"a", b"b", b"c"])
    assert (held, asking) == ([], True)
    probe.send()  # the caller is not held up by the round trip: it has not come back
    assert calls == [] and probe.held([b"a"]) == ([], True)
    gate.set()
    assert wait_answered(probe, [b"a", b"b", b"c"]) == [b"a", b"c"]
    assert probe.held([b"b", b"c"]) == ([b"c"], False)
    assert calls == [[b"a", b"b", b"c"]] and probe.round_trips == 1


def test_answers_lapse_and_failed_reads_count_as_absent(clock):
    stored = {b"a"}
    probe = Probe("redis", lambda keys: [k in stored for k in keys], ttl_s=0.05)
    assert wait_answered(probe, [b"a"]) == [b"a"]
    probe.failed(b"a")
    assert probe.held([b"a"]) == ([], False)
    clock.now += 0.06
    assert probe.held([b"a"])[1]  # lapsed: asked again
    assert wait_answered(probe, [b"a"]) == [b"a"]


def test_a_key_whose_reads_keep_failing_is_held_off_longer_each_time(clock):
    """The tier says it holds the key (rank 0's copy), yet every read fails (another
    rank's copy is missing, or the value is under another integrity key, and nothing
    rewrites it): each failure soon after the last hold-off doubles the time it counts
    as absent, up to a bound, rather than cost a failing promotion every `ttl_s`. A
    failure long after the last (a brief outage) starts over, as does a reset."""
    probe = Probe("redis", lambda keys: [True] * len(keys), ttl_s=1.0)
    limit = probe_module.FAILED_MAX_HOLD_OFF

    def hold_off() -> float:
        """Fail a read of the key the tier claims; how long it then counts as absent
        (to the half second after: lapsing at or just past its end)."""
        assert wait_answered(probe, [b"a"]) == [b"a"]
        probe.failed(b"a")
        held = 0.0
        while not probe.held([b"a"])[1]:  # absent, not asked again, until it lapses
            clock.now += 0.5
            held += 0.5
        return held

    holds = [hold_off() for _ in range(12)]
    for n, h in enumerate(holds):
        assert min(2.0**n, limit) <= h <= min(2.0**n, limit) + 0.5, holds
    clock.now += 2 * limit  # long after the last hold-off ended
    assert hold_off() <= 1.5
    assert hold_off() >= 2.0
    probe.clear()
    assert hold_off() <= 1.5
    # Days of failures in a row: the count grows past what a float's exponent holds.
    probe._failures[b"a"] = (5000, clock.now, limit)
    assert limit <= hold_off() <= limit + 0.5
    probe.close()


def test_lapsed_answers_are_forgotten_and_fresh_ones_kept(clock):
    """A round trip drops the answers that lapsed (memory stays bounded by what was asked
    within `ttl_s`), oldest first; a key answered again keeps its new answer."""
    stored = {b"a"}
    probe = Probe("redis", lambda keys: [k in stored for k in keys], ttl_s=2.0)
    old = [bytes([i]) * 4 for i in range(100)]
    wait_answered(probe, old + [b"a"])
    clock.now += 2.1
    assert wait_answered(probe, [b"a"]) == [b"a"]  # asked again: lapsed
    assert wait_answered(probe, [b"x"]) == []  # this round trip drops the lapsed ones
    assert set(probe._answers) == {b"a", b"x"}
    assert probe.held([b"a"]) == ([b"a"], False)


def test_a_raising_tier_is_an_absence_not_an_error():
    def broken(keys):
        raise ConnectionError("down")

    probe = Probe("redis", broken, ttl_s=60)
    assert wait_answered(probe, [b"a"]) == []
    assert probe.errors == 1
    probe.close()


def test_every_lookup_of_a_step_goes_in_one_round_trip():
    """32 lookups note their keys, the step's `send` asks about all of them at once; the
    32 lookups of the next steps, noted while that round trip is out, go together in the
    one right after it."""
    entered, gate = threading.Event(), threading.Event()
    calls: list[list[bytes]] = []

    def contains_many(keys):
        calls.append(list(keys))
        entered.set()
        assert gate.wait(60)
        return [k.startswith(b"held") for k in keys]

    probe = Probe("redis", contains_many, ttl_s=60)
    first = [[b"held%d" % i, b"gone%d" % i] for i in range(32)]
    later = [[b"held%d" % i, b"next%d" % i] for i in range(32, 64)]
    for keys in first:
        assert probe.held(keys) == ([], True)
    probe.held(first[0])  # polled again: asks nothing twice
    probe.send()
    assert entered.wait(60)  # the round trip is out
    for step in (later[:16], later[16:]):
        for keys in step:
            assert probe.held(keys) == ([], True)
        probe.send()
    gate.set()
    assert wait_answered(probe, first[5]) == [b"held5"]
    assert wait_answered(probe, later[-1]) == [b"held63"]
    assert calls == [[k for ks in first for k in ks], [k for ks in later for k in ks]]
    assert (probe.round_trips, probe.lookups) == (2, 64)
    probe.close()


def _landed(probe: Probe, trips: int) -> None:
    """Until `trips` round trips are back (the deadline only against a hang)."""
    deadline = time.monotonic() + 60
    while probe.round_trips < trips:
        assert time.monotonic() < deadline, "the round trip never came back"
        time.sleep(0.005)


def test_an_answer_lives_from_the_first_lookup_after_it_came_back(clock):
    """A step longer than the answers' time to live (a long prefill on a CPU): the
    answer is read at the next lookup, however late, and lives `ttl_s` from then (it
    used to lapse unread, and the lookup waited on the probe until overdue)."""
    probe = Probe("redis", lambda keys: [True] * len(keys), ttl_s=5.0)
    assert probe.held([b"a"]) == ([], True)
    probe.send()
    _landed(probe, 1)
    clock.now += 6.0  # the step that sent it took longer than ttl_s
    assert probe.held([b"a"]) == ([b"a"], False)
    clock.now += 4.9
    assert probe.held([b"a"]) == ([b"a"], False)
    clock.now += 0.2
    assert probe.held([b"a"]) == ([], True)  # lapsed, ttl_s after it was first read


def test_a_round_trip_out_across_a_clear_lands_nothing():
    """A reset while a round trip is out: what it heard was asked before the reset
    (which deleted this engine's entries there), so it is dropped, and the next lookup
    asks again."""
    entered, gate = threading.Event(), threading.Event()

    def contains_many(keys):
        entered.set()
        assert gate.wait(60)
        return [True] * len(keys)

    probe = Probe("redis", contains_many, ttl_s=60)
    assert probe.held([b"a"]) == ([], True)
    probe.send()
    assert entered.wait(60)
    probe.clear()
    gate.set()
    _landed(probe, 1)
    assert probe.held([b"a"]) == ([], True)
    assert wait_answered(probe, [b"a"]) == [b"a"]
    assert probe.round_trips == 2
    probe.close()


def test_answers_no_lookup_read_for_long_are_dropped_unread(clock):
    """Every lookup that asked was aborted, and the next comes an hour later: the
    hour-old answers are not taken as fresh; the lookup asks again."""
    probe = Probe("redis", lambda keys: [False] * len(keys), ttl_s=5.0)
    assert probe.held([b"a"]) == ([], True)
    probe.send()
    _landed(probe, 1)
    clock.now += probe_module.LANDED_MAX_AGE + 1
    assert probe.held([b"a"]) == ([], True)


def test_the_engines_shutdown_releases_the_probes_redis_client(tmp_path_factory):
    """vLLM's `Scheduler.shutdown` (the engine core's, at exit) reaches the probe: its
    round-trip thread and its Redis tier's threads and connections end, rather than
    outlive every engine an `LLM` or a test built in one process."""
    require_redis()
    from test_async_scheduling import Engine, _prompt, config_dir

    def redis_threads() -> set[threading.Thread]:
        names = ("hybridkv-redis", "hybridkv-probe")
        return {t for t in threading.enumerate() if t.name.startswith(names)}

    before = redis_threads()
    with redis_server() as server:
        extra = {"redis_url": server.url, "redis_timeout_ms": 500}
        eng = Engine(config_dir(tmp_path_factory), False, seed=3, extra=extra)
        eng.add("a", _prompt(40, 7), max_tokens=2)
        eng.run()
        assert eng.side.probe is not None and eng.side.probe.round_trips >= 1
        assert redis_threads() - before
        eng.sched.shutdown()
        eng.worker_conn.shutdown()
        assert not {t for t in redis_threads() - before if t.is_alive()}
