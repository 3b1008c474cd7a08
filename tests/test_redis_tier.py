"""The Redis tier against real `redis-server` processes on loopback ports.

Round trips (whole and split entries, other writers' part sizes), round trips counted on
the wire, TTLs, integrity keys, garbage / truncated / wrong-size / foreign values, and
the faults: a server killed, restarted empty, stopped (timeouts), full (OOM under
noeviction), refusing CONFIG, or absent at start. Then a three-master Redis Cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch
from redis_servers import RedisServer, redis_cluster, redis_server, require_redis

from hybridkv.core.keys import KEY_BYTES, group_key
from hybridkv.core.tiers.backoff import RESET_AFTER
from hybridkv.core.tiers.entry_file import HEADER_BYTES, MAC_BYTES, new_entry
from hybridkv.core.tiers.redis import RedisTier

FP = bytes(range(16))
OTHER_FP = bytes(range(100, 116))
PART = 4096  # the smallest max_entry_bytes: small entries still split
FAST = {"timeout_ms": 300, "backoff_s": 0.05, "backoff_max_s": 0.4}
# A call that must not wait for a dead or stopped server returns within its timeout; the
# tests only check it did not hang, with a bound no machine's speed comes near.
HANG_S = 10.0


def key(i: int, group: int = 0) -> bytes:
    return group_key(i.to_bytes(KEY_BYTES, "big"), group)


def payload(i: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(i)
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)


def same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and torch.equal(got, want)


def eventually(cond: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(autouse=True)
def _needs_redis() -> None:
    require_redis()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.fixture
def make_tier(server: RedisServer) -> Iterator[Callable[..., RedisTier]]:
    """Tiers on `server` (or the given url); closed when the test ends."""
    tiers: list[RedisTier] = []

    def make(url: str | None = None, fingerprint: bytes = FP, **kwargs) -> RedisTier:
        tier = RedisTier(url or server.url, fingerprint, **{**FAST, **kwargs})
        tiers.append(tier)
        return tier

    yield make
    for t in tiers:
        t.close()


def store(tier: RedisTier, entries: dict[bytes, torch.Tensor]) -> None:
    for k, e in entries.items():
        assert tier.put(k, e)
    tier.flush()


@pytest.fixture
def round_trips(monkeypatch) -> list[int]:
    """Counts what goes on the wire: one packed write per command or per pipeline."""
    sent = [0]
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self, *args, **kwargs):
        sent[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    return sent


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("integrity_key", [None, "secret"])
def test_entries_of_many_sizes_round_trip(make_tier, server, integrity_key):
    tier = make_tier(max_entry_bytes=PART, integrity_key=integrity_key)
    sizes = [0, 1, 100, PART - HEADER_BYTES - MAC_BYTES, PART, 3 * PART + 7, 1 << 20]
    entries = {key(i): payload(i, n) for i, n in enumerate(sizes)}
    store(tier, entries)
    got = tier.get_many(list(entries) + [key(99)])
    assert all(same(g, e) for g, e in zip(got, entries.values(), strict=False))
    assert got[-1] is None
    assert tier.contains_many([key(0), key(99), key(6)]) == [True, False, True]
    assert same(tier.get(key(5)), entries[key(5)])
    names = server.client().keys(f"hybridkv:{FP.hex()}:*")
    assert len(names) > len(sizes)  # the larger ones were split
    s = tier.stats()
    assert (s.puts, s.entries, s.hits, s.misses, s.corrupt, s.errors) == (7, 7, 8, 1, 0, 0)
    assert s.bytes_used == sum(len(v) for v in server.client().mget(names))


def test_get_many_is_one_round_trip(make_tier, round_trips):
    nbytes = 3 * PART
    reader = make_tier(max_entry_bytes=PART, entry_bytes=[nbytes])
    entries = {key(i): payload(i, nbytes) for i in range(16)}
    store(reader, entries)
    before = round_trips[0]
    got = reader.get_many(list(entries))
    assert round_trips[0] - before == 1
    assert all(same(g, e) for g, e in zip(got, entries.values(), strict=True))
    before = round_trips[0]
    assert reader.contains_many(list(entries) + [key(99)]) == [True] * 16 + [False]
    assert round_trips[0] - before == 1
    # Without the layout's sizes, split entries need one more (for all of them at once).
    blind = make_tier(max_entry_bytes=PART)
    before = round_trips[0]
    got = blind.get_many(list(entries))
    assert round_trips[0] - before == 2
    assert all(same(g, e) for g, e in zip(got, entries.values(), strict=True))


def test_entries_of_a_writer_with_other_part_sizes(make_tier):
    nbytes = 10 * PART
    entries = {key(i): payload(i, nbytes) for i in range(4)}
    store(make_tier(max_entry_bytes=2 * PART), entries)
    for max_entry_bytes in (PART, 3 * PART, 1 << 20):  # predicts more, fewer, one part
        reader = make_tier(max_entry_bytes=max_entry_bytes, entry_bytes=[nbytes])
        got = reader.get_many(list(entries))
        assert all(same(g, e) for g, e in zip(got, entries.values(), strict=True))
        assert reader.stats().corrupt == 0


def test_values_expire_after_ttl(make_tier, server):
    tier = make_tier(ttl_s=100, max_entry_bytes=PART)
    store(tier, {key(1): payload(1, 3 * PART)})
    client = server.client()
    names = client.keys("*")
    assert len(names) == 4
    assert all(0 < client.ttl(n) <= 100 for n in names)
    no_ttl = make_tier(fingerprint=OTHER_FP)
    store(no_ttl, {key(1): payload(1, 100)})
    assert client.ttl(no_ttl.names(key(1))[0]) == -1


def test_delete_clear_and_namespaces(make_tier, server):
    tier = make_tier(max_entry_bytes=PART)
    other = make_tier(fingerprint=OTHER_FP)
    store(tier, {key(1): payload(1, 5 * PART), key(2): payload(2, 10)})
    store(other, {key(1): payload(1, 10)})
    client = server.client()
    client.set("unrelated", b"x")
    assert tier.delete(key(1)) and not tier.delete(key(99))
    assert tier.get(key(1)) is None and tier.contains_many([key(1)]) == [False]  # at once
    tier.flush()  # the writer has unlinked every part
    assert not client.keys(f"*{FP.hex()}*{key(1).hex()}*")
    assert same(other.get(key(1)), payload(1, 10))
    tier.clear()  # forgets what it stored; the entries stay, every replica's to read
    assert tier.stats().entries == 0 and same(tier.get(key(2)), payload(2, 10))
    assert client.get("unrelated") == b"x" and client.dbsize() == 3


# ---- values that are no entry ------------------------------------------------------------------
def test_integrity_key_decides_which_entries_are_read(make_tier, server):
    store(make_tier(integrity_key="A"), {key(1): payload(1, 1000)})
    for reader_key in (None, "B"):
        reader = make_tier(integrity_key=reader_key)
        assert reader.get(key(1)) is None
        assert reader.stats().corrupt == 1
    assert same(make_tier(integrity_key="A").get(key(1)), payload(1, 1000))  # never deleted
    store(make_tier(fingerprint=OTHER_FP), {key(2): payload(2, 1000)})
    assert make_tier(fingerprint=OTHER_FP, integrity_key="A").get(key(2)) is None


def test_garbage_and_foreign_values_are_counted_misses(make_tier, server):
    tier = make_tier()
    store(tier, {key(i): payload(i, 1000) for i in range(4)})
    client = server.client()
    client.set(tier.names(key(1))[0], b"garbage" * 20)
    client.set(tier.names(key(2))[0], b"")
    client.delete(tier.names(key(3))[0])
    client.hset(tier.names(key(3))[0], "field", "value")  # another type of value
    got = tier.get_many([key(i) for i in range(4)])
    assert same(got[0], payload(0, 1000)) and got[1:] == [None, None, None]
    s = tier.stats()
    assert (s.corrupt, s.misses, s.errors) == (2, 3, 0) and tier.up
    assert eventually(lambda: client.exists(*tier.names(key(1)), *tier.names(key(2))) == 0)
    assert client.type(tier.names(key(3))[0]) == b"hash"  # not ours to remove


def test_damaged_split_entries_are_misses_and_removed(make_tier, server):
    nbytes = 5 * PART
    tier = make_tier(max_entry_bytes=PART, entry_bytes=[nbytes])
    store(tier, {key(i): payload(i, nbytes) for i in range(4)})
    client = server.client()
    client.delete(tier.names(key(1), 3)[2])  # a part evicted
    client.setrange(tier.names(key(2), 2)[1], 100, b"x")  # a part changed
    client.set(tier.names(key(3), 6)[5], b"short")  # the last part cut short
    got = tier.get_many([key(i) for i in range(4)])
    assert same(got[0], payload(0, nbytes)) and got[1:] == [None, None, None]
    assert tier.stats().corrupt == 3
    names = [n for i in (1, 2, 3) for n in tier.names(key(i), 6)]
    assert eventually(lambda: client.exists(*names) == 0)


def test_a_value_of_the_wrong_size_is_rejected_before_allocation(make_tier):
    sizes: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        sizes.append(n)
        return new_entry(n)

    store(make_tier(max_entry_bytes=PART), {key(1): payload(1, 4 * PART), key(2): payload(2, 10)})
    reader = make_tier(max_entry_bytes=PART, entry_bytes=[10], alloc=alloc)
    assert reader.get(key(1)) is None and sizes == []
    assert same(reader.get(key(2)), payload(2, 10)) and sizes == [10]
    assert reader.stats().corrupt == 1


def test_a_header_claiming_thousands_of_parts_fetches_no_more_parts(make_tier, server, monkeypatch):
    """A first part whose header claims another size than the layout gives the entry
    (forged, by anyone who can write to the server) is rejected from that part alone:
    taken at its word, every replica fetched up to 4,095 more names per lookup."""
    nbytes = 3 * PART
    tier = make_tier(max_entry_bytes=PART, entry_bytes=[nbytes])
    store(tier, {key(1): payload(1, nbytes), key(2): payload(2, nbytes)})
    client = server.client()
    claim = 4000 * PART
    client.setrange(tier.names(key(1))[0], 48, claim.to_bytes(8, "little"))
    sent: list[bytes] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def recording(self, command, *args, **kwargs):
        parts = [command] if isinstance(command, (bytes, memoryview)) else command
        sent.append(b"".join(bytes(p) for p in parts))
        return original(self, command, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", recording)
    got = tier.get_many([key(1), key(2)])
    assert got[0] is None and same(got[1], payload(2, nbytes))
    assert tier.stats().corrupt == 1
    # The reads (the writer's removal of the rejected entry, a MULTI/EXEC, may go out
    # meanwhile on its own connection).
    reads = b"".join(c for c in sent if b"MGET" in c and b"EXEC" not in c)
    n = -(-(HEADER_BYTES + nbytes) // PART)  # the parts a true entry has
    assert tier.names(key(1), n)[n - 1].encode() in reads
    assert tier.names(key(1), n + 1)[n].encode() not in reads  # none the header claims


# ---- faults ------------------------------------------------------------------------------------
def test_server_killed_then_restarted_empty(make_tier, server, round_trips):
    tier = make_tier()
    store(tier, {key(i): payload(i, 1000) for i in range(4)})
    server.kill()
    start = time.monotonic()
    assert tier.get_many([key(0), key(1)]) == [None, None]
    # Against a hang only (a refused connection fails at once; the bound is far above
    # the 300 ms timeout, so no machine's speed decides it).
    assert time.monotonic() - start < HANG_S and not tier.up
    sent = round_trips[0]
    assert tier.get(key(2)) is None and tier.contains_many([key(2)]) == [False]
    assert not tier.put(key(5), payload(5, 1000)) and not tier.delete(key(3))
    tier.flush()
    assert round_trips[0] == sent  # down: no call touched the network
    s = tier.stats()
    assert s.dropped_puts == 1 and s.errors == 1 and s.entries == 4
    server.start()
    assert eventually(lambda: tier.up, 5)
    assert tier.get(key(0)) is None  # restarted empty
    assert tier.stats().entries == 0  # its run id changed: nothing stored survived
    store(tier, {key(0): payload(0, 1000)})
    assert same(tier.get(key(0)), payload(0, 1000))


def test_writes_queued_when_the_server_dies_are_dropped(make_tier, server):
    tier = make_tier()
    server.kill()
    assert tier.up  # nothing noticed yet
    for i in range(8):
        tier.put(key(i), payload(i, 1 << 20))
    tier.flush()
    s = tier.stats()
    assert not tier.up and s.puts == 0 and s.write_errors + s.dropped_puts == 8


@pytest.mark.parametrize("clear_while_down", [False, True])
def test_a_stopped_server_times_out_and_comes_back(
    make_tier, server, clear_while_down, round_trips
):
    tier = make_tier(timeout_ms=200)
    store(tier, {key(1): payload(1, 1000)})
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert tier.get(key(1)) is None
        assert time.monotonic() - start < HANG_S and not tier.up  # the timeout, not a hang
        sent = round_trips[0]
        assert tier.get(key(1)) is None and tier.contains_many([key(1)]) == [False]
        assert round_trips[0] == sent  # down: answered without the network
        if clear_while_down:
            tier.clear()  # forgets what it stored; the entry stays, shared
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert eventually(lambda: tier.up, 5)
    assert same(tier.get(key(1)), payload(1, 1000))
    assert tier.stats().entries == (0 if clear_while_down else 1)


def test_a_stall_after_long_service_costs_the_first_delay_again(make_tier, server, caplog):
    """A server that stalls now and then (stopped past the timeout) is down for the first
    delay again once it has served four times its last delay, not for a delay grown by
    every stall since start; a stall right after coming back still doubles it."""
    caplog.set_level(logging.INFO, logger="hybridkv.core.tiers.redis")
    first = 0.3  # a fall 0.2 s (the timeout) after coming back is well inside 4 x 0.3
    tier = make_tier(timeout_ms=200, backoff_s=first, backoff_max_s=600)
    assert server.proc is not None and tier.up

    def stall() -> float:
        """Stop the server until a call meets the stall; the delay the tier logged."""
        caplog.clear()
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            assert tier.get(key(1)) is None and not tier.up
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert eventually(lambda: tier.up, 10)
        delays = [r.args[-1] for r in caplog.records if "retrying in" in r.msg]
        assert len(delays) == 1
        return delays[0]

    assert stall() == first
    assert stall() >= 2 * first  # at once: a sick server, the delay grows
    # Serve four times the last delay (a probe that failed before the server was
    # continued doubled it past the logged one).
    time.sleep(RESET_AFTER * tier._backoff.last_s + 0.1)
    assert stall() == first


def test_unreachable_at_start_then_up(make_tier):
    with tempfile.TemporaryDirectory() as d:
        later = RedisServer(Path(d))
        start = time.monotonic()
        tier = make_tier(later.url)
        assert not tier.up and time.monotonic() - start < HANG_S  # no wait for the server
        assert tier.get(key(1)) is None and not tier.put(key(1), payload(1, 10))
        try:
            later.start()
            assert eventually(lambda: tier.up, 5)
            store(tier, {key(1): payload(1, 10)})
            assert same(tier.get(key(1)), payload(1, 10))
        finally:
            later.stop()


def test_logs_never_show_a_password(make_tier, caplog):
    caplog.set_level(logging.WARNING, logger="hybridkv.core.tiers.redis")
    with tempfile.TemporaryDirectory() as d:
        nobody = RedisServer(Path(d))  # not started: the tier logs that it is down
        tier = make_tier(f"redis://:hunter2@127.0.0.1:{nobody.port}/0")
    assert not tier.up and ":***@127.0.0.1" in caplog.text and "hunter2" not in caplog.text


def test_full_server_under_noeviction(make_tier, caplog):
    caplog.set_level(logging.WARNING, logger="hybridkv.core.tiers.redis")
    with redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as full:
        tier = make_tier(full.url)
        assert "noeviction" in caplog.text
        assert tier.stats().capacity_bytes == 2 << 20
        for i in range(12):
            tier.put(key(i), payload(i, 256 << 10))
            tier.flush()
        s = tier.stats()
        assert 0 < s.puts < 12 and s.write_errors + s.dropped_puts == 12 - s.puts
        assert s.errors >= 1
        assert eventually(lambda: tier.up, 60)  # refused writes are no reason to stay down
        assert same(tier.get(key(0)), payload(0, 256 << 10))


def test_a_server_that_refuses_config(make_tier, caplog):
    caplog.set_level(logging.WARNING, logger="hybridkv.core.tiers.redis")
    with redis_server("--rename-command", "CONFIG", "") as managed:
        tier = make_tier(managed.url)
        assert tier.up and "cannot read the Redis eviction policy" in caplog.text
        store(tier, {key(1): payload(1, 100)})
        assert same(tier.get(key(1)), payload(1, 100))


def test_bad_calls_never_raise(make_tier):
    tier = make_tier()
    assert not tier.put(b"short", payload(1, 10))
    assert not tier.put(key(1), torch.zeros(4, dtype=torch.float32))
    assert tier.get(b"short") is None and tier.get_many([b"x", key(2)]) == [None, None]
    s = tier.stats()
    assert (s.errors, s.misses) == (2, 3) and tier.up


# ---- Redis Cluster -----------------------------------------------------------------------------
def test_cluster_round_trip():
    with redis_cluster(3) as nodes:
        tier = RedisTier(nodes[1].url, FP, cluster=True, max_entry_bytes=PART, **FAST)
        try:
            sizes = [10, PART, 5 * PART + 3, 1 << 20] * 4
            entries = {key(i): payload(i, n) for i, n in enumerate(sizes)}
            store(tier, entries)
            assert tier.up and tier.stats().puts == len(entries)
            got = tier.get_many(list(entries))
            assert all(same(g, e) for g, e in zip(got, entries.values(), strict=True))
            holders = [n.client().dbsize() for n in nodes]
            assert all(holders), holders  # spread over the three masters
            assert tier.contains_many([key(0), key(99)]) == [True, False]
            assert tier.delete(key(2)) and tier.get(key(2)) is None
            tier.flush()  # the writer has unlinked every part of it, on its node
            names = [n for node in nodes for n in node.client().keys("*")]
            assert len(names) == sum(holders) - 6  # 5 * PART + 3 bytes: 6 parts
            assert not any(key(2).hex().encode() in n for n in names)
        finally:
            tier.close()
