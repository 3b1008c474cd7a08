"""Nothing slow on the caller's thread: the engine deletes, clears and (every minute)
rescans from its model runner's thread or beside it, so the disk and Redis tiers do the
I/O of each in their own threads, and keep its order.

Each test makes the concurrency happen by construction: a Redis server stopped with
SIGSTOP (no reply ever comes until SIGCONT), or a background thread held inside the
very call that used to hold the tier's lock (`Pause`), while the test's thread acts.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_disk_tier
from redis_servers import RedisServer, redis_server, require_redis
from test_disk_tier import (
    BIG,
    assert_entry,
    assert_index_matches_disk,
    entry_names,
    key,
    kv_sizes,
    payload,
    put_all,
    tmp_files,
)
from test_redis_tier import FAST, eventually, same

from hybridkv.core.tiers import disk as disk_module
from hybridkv.core.tiers.redis import RedisTier

RELEASE_SECONDS = 30.0  # only ever reached when the test's thread is stuck (a failure)
make_tier = test_disk_tier.make_tier  # the fixture: DiskTier factory, closes them all


class Pause:
    """Holds the first call made from a thread whose name starts with `thread` until the
    test releases it, so that the test acts while that thread is provably inside the
    call. If the test never releases it (its own thread is stuck: the failure this
    catches), the held thread goes on after RELEASE_SECONDS and `starved` says so."""

    def __init__(self, thread: str):
        self.thread = thread
        self.entered = threading.Event()
        self.released = threading.Event()
        self.starved = False

    def __call__(self) -> None:
        if not threading.current_thread().name.startswith(self.thread):
            return
        if self.entered.is_set():
            return
        self.entered.set()
        self.starved = not self.released.wait(RELEASE_SECONDS)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def paused(*args: Any, **kwargs: Any) -> Any:
            self()
            return fn(*args, **kwargs)

        return paused


@pytest.fixture
def pause_unlinks(monkeypatch) -> Callable[[str], Pause]:
    """Pause the first file removal (`disk.discard`) a thread of the given name makes."""

    def pause(thread: str) -> Pause:
        p = Pause(thread)
        monkeypatch.setattr(disk_module, "discard", p.wrap(disk_module.discard))
        return p

    return pause


# ---- disk ---------------------------------------------------------------------------------------
def test_a_rescan_builds_its_index_and_unlinks_without_the_lock_puts_take(
    make_tier, monkeypatch, pause_unlinks
):
    """A rescan of 1000 files another engine wrote, 300 over this tier's budget: held
    while it builds the new index, and again while it unlinks the files over budget,
    it lets the caller put (written and renamed meanwhile), delete, look up and read.
    What changed while it built is replayed onto the index it swaps in: afterwards the
    index, the journal the worker reports and the directory agree."""
    nbytes, n = 100, 1000
    mine = make_tier(capacity=(n - 300) * (nbytes + 64), writers=1)
    mine.take_changes()  # the worker watches from its first report on
    other = make_tier(capacity=BIG)
    put_all(other, {key(i): payload(i, nbytes) for i in range(n)})

    building = Pause("rescan")

    class PausingIndex(disk_module._JournaledIndex):
        def __init__(self, *args: Any, **kwargs: Any):
            if args:  # the index a rescan builds from what it found
                building()
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(disk_module, "_JournaledIndex", PausingIndex)
    unlinking = pause_unlinks("rescan")
    scan = threading.Thread(target=mine.rescan, name="rescan")
    scan.start()
    try:
        assert building.entered.wait(RELEASE_SECONDS)
        assert mine.put(key(n), payload(n, nbytes))  # the writer renames it in meanwhile
        mine.flush()
        assert mine.contains(key(n)) and mine.delete(key(n))
        assert mine.put(key(n + 1), payload(n + 1, nbytes))
        mine.flush()
        building.released.set()
        assert unlinking.entered.wait(RELEASE_SECONDS)
        assert mine.put(key(n + 2), payload(n + 2, nbytes))
        assert_entry(mine.get(key(n + 1)), payload(n + 1, nbytes))
        unlinking.released.set()
    finally:
        building.released.set()
        unlinking.released.set()
        scan.join()
    mine.flush()
    assert not building.starved and not unlinking.starved, "the caller waited for the rescan"
    assert_index_matches_disk(mine)
    on_disk = set(kv_sizes(mine.dir))
    assert {key(n + 1), key(n + 2)} <= on_disk and key(n) not in on_disk
    assert mine.stats().bytes_used <= mine.capacity
    # The journal, applied to what the worker knew (nothing), gives the directory.
    known: set[bytes] = set()
    for k, present in mine.take_changes():
        (known.add if present else known.discard)(k)
    assert known == on_disk


def test_a_put_after_a_delete_waits_for_its_unlink_and_ends_stored(make_tier, pause_unlinks):
    """The file of a deleted entry is unlinked by a writer thread; a put of the entry right
    after is written by the other writer, whose rename waits for that unlink: the new
    entry ends stored, never unlinked by the delete before it."""
    tier = make_tier(writers=2)
    put_all(tier, {key(1): payload(1, 1000)})
    unlinking = pause_unlinks("hybridkv-disk")
    assert tier.delete(key(1))
    try:
        assert unlinking.entered.wait(RELEASE_SECONDS), "no writer thread unlinked the file"
        assert tier.get(key(1)) is None and not tier.contains(key(1))
        assert tier.put(key(1), payload(2, 1000))
        assert_entry(tier.get(key(1)), payload(2, 1000))  # from the queue
        # The other writer has written its temporary file; it waits to rename it.
        assert eventually(lambda: tmp_files(tier.dir))
        unlinking.released.set()
    finally:
        unlinking.released.set()
    tier.flush()
    assert not unlinking.starved
    assert set(kv_sizes(tier.dir)) == {key(1)} and tmp_files(tier.dir) == []
    assert_entry(tier.get(key(1)), payload(2, 1000))
    assert_index_matches_disk(tier)


def test_a_clear_unlinks_in_the_background_what_came_before_it_only(make_tier, pause_unlinks):
    """`clear` forgets this tier's files at once and a writer thread unlinks them; entries
    put again after the clear, while that unlink is held, end stored."""
    tier = make_tier(writers=2)
    put_all(tier, {key(i): payload(i, 1000) for i in range(4)})
    unlinking = pause_unlinks("hybridkv-disk")
    tier.clear()
    try:
        assert unlinking.entered.wait(RELEASE_SECONDS), "no writer thread unlinked the files"
        assert not any(tier.contains(key(i)) for i in range(4))
        for i in range(3):
            assert tier.put(key(i), payload(10 + i, 1000))
        unlinking.released.set()
    finally:
        unlinking.released.set()
    tier.flush()
    assert not unlinking.starved
    assert set(kv_sizes(tier.dir)) == {key(i) for i in range(3)}
    for i in range(3):
        assert_entry(tier.get(key(i)), payload(10 + i, 1000))
    assert_index_matches_disk(tier)


# ---- Redis --------------------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[RedisServer]:
    require_redis()
    with redis_server() as s:
        yield s


def test_redis_delete_and_clear_never_wait_for_the_server_and_keep_their_order(server):
    """With the server stopped, `delete` and `clear` return at once and meet no fault (a
    call that waited for it would time out and take the tier down); reads answer from
    what is queued. Once the server answers again the writer has done it all, in order:
    an entry deleted then stored again ends stored, one stored then deleted ends
    deleted, a put after the clear ends stored, and the clear removed nothing."""
    tier = RedisTier(server.url, bytes(range(16)), **{**FAST, "timeout_ms": 10_000})
    try:
        for i in range(3):
            assert tier.put(key(i), payload(i, 1000))
        tier.flush()
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            assert tier.delete(key(1))
            tier.clear()
            assert tier.delete(key(0)) is False  # forgotten by the clear; removed all the same
            assert tier.put(key(0), payload(100, 1000))
            assert tier.put(key(3), payload(3, 1000))
            assert tier.delete(key(3))
            assert tier.put(key(4), payload(4, 1000))
            assert same(tier.get(key(0)), payload(100, 1000))  # queued
            assert tier.get_many([key(1), key(3)]) == [None, None]  # being deleted
            assert tier.up and tier.stats().errors == 0, "a call waited for the server"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        tier.flush()
        got = tier.get_many([key(i) for i in range(5)])
        assert same(got[0], payload(100, 1000)) and same(got[2], payload(2, 1000))
        assert got[1] is None and got[3] is None and same(got[4], payload(4, 1000))
        assert tier.up and tier.stats().errors == 0
    finally:
        tier.close()


@pytest.mark.parametrize("drop", ["delete", "clear"])
def test_an_entry_deleted_while_its_file_is_written_never_comes_back(make_tier, monkeypatch, drop):
    """The writer is provably inside `write_entry` when the entry is deleted (or the tier
    cleared): its finished file is never renamed into place, and nothing counts it."""
    pause = Pause("hybridkv-disk")
    monkeypatch.setattr(disk_module, "write_entry", pause.wrap(disk_module.write_entry))
    tier = make_tier(writers=1)
    assert tier.put(key(1), payload(1, 4096))
    assert pause.entered.wait(RELEASE_SECONDS)
    if drop == "delete":
        assert tier.delete(key(1))
    else:
        tier.clear()
    assert tier.get(key(1)) is None
    pause.released.set()
    tier.flush()
    assert not pause.starved
    assert entry_names(tier.dir) == ([], []) and tier.stats().entries == 0
    assert tmp_files(tier.dir) == []


def test_closing_stops_a_rescan_under_way(make_tier, monkeypatch):
    """A rescan of a large or network directory can take longer than vLLM lets a worker
    shut down (a few seconds, then a kill): `close` waited for the whole scan, and the
    Redis tier and vLLM's own teardown after it were cut off. Now the scan stops at the
    next file once the tier closes, and swaps nothing in."""
    nbytes, n = 100, 50
    tier = make_tier()
    put_all(tier, {key(i): payload(i, nbytes) for i in range(n)})
    tier.rescan_seconds = 0.0  # after the puts: the next call starts a scan
    real_scan = disk_module.scan_layout_dir
    entered = threading.Event()
    after_close = {"files": 0}

    def scan_layout_dir(path):
        for i, e in enumerate(real_scan(path)):
            if i == 1:
                entered.set()
                deadline = time.monotonic() + RELEASE_SECONDS  # only against a hang
                while not tier._closed and time.monotonic() < deadline:
                    time.sleep(0.001)
            if tier._closed:
                after_close["files"] += 1
            yield e

    monkeypatch.setattr(disk_module, "scan_layout_dir", scan_layout_dir)
    swapped = {"index": 0}
    real_index = disk_module._JournaledIndex

    class CountingIndex(real_index):
        def __init__(self, *args: Any, **kwargs: Any):
            swapped["index"] += bool(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(disk_module, "_JournaledIndex", CountingIndex)
    tier.rescan_if_stale()
    assert entered.wait(RELEASE_SECONDS)
    tier.close()
    assert after_close["files"] == 1  # the one asked for as it closed; no more
    assert swapped["index"] == 0
