"""The local-disk tier and its entry files, on real files and real processes.

Round trips, restarts, damaged and foreign files, the byte budget, the write queue,
deletion while writes are queued, several writers on one directory, a writer killed
mid-write, a full disk and a read-only one.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.core.host_pool import HostPool
from hybridkv.core.keys import KEY_BYTES, group_key, split_group_key
from hybridkv.core.tiers.disk import STALE_TMP_SECONDS, DiskTier, writer_host
from hybridkv.core.tiers.entry_file import (
    FILE_VERSION,
    HEADER_BYTES,
    EntryFileError,
    read_entry,
)

FP = bytes(range(16))
OTHER_FP = bytes(range(100, 116))
DESC = {"model": "tiny", "groups": [{"kind": "full", "block_bytes": 1024}]}
BIG = 1 << 30  # a budget that never evicts
HOST = writer_host()  # as DiskTier names its temporary files
PROPERTY = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ---- helpers ----------------------------------------------------------------------------------
def key(i: int, group: int = 0) -> bytes:
    return group_key(i.to_bytes(KEY_BYTES, "big"), group)


def index_of(k: bytes) -> int:
    return int.from_bytes(split_group_key(k)[0], "big")


def payload(i: int, nbytes: int) -> torch.Tensor:
    """Deterministic content of entry i (the same in every process), cheap even at 64 MiB."""
    gen = torch.Generator().manual_seed(i)
    block = torch.randint(-128, 128, (4099,), dtype=torch.int8, generator=gen)
    return block.repeat(nbytes // 4099 + 1)[:nbytes]


def file_bytes(nbytes: int) -> int:
    return HEADER_BYTES + nbytes


def entry_path(layout_dir: Path, k: bytes) -> Path:
    """Where the documented layout puts key k: `<fp hex>/<2 hex>/<key hex>.kv`."""
    return layout_dir / k.hex()[:2] / f"{k.hex()}.kv"


def entry_names(layout_dir: Path) -> tuple[list[Path], list[Path]]:
    """(.kv files, .tmp files) in the fan-out subdirectories; safe while others write."""
    kv: list[Path] = []
    tmp: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        for sub in os.scandir(layout_dir):
            if sub.is_dir():
                for e in os.scandir(sub.path):
                    if e.name.endswith(".kv"):
                        kv.append(Path(e.path))
                    elif e.name.endswith(".tmp"):
                        tmp.append(Path(e.path))
    return kv, tmp


def kv_sizes(layout_dir: Path) -> dict[bytes, int]:
    """key -> file size of every entry file on disk."""
    return {bytes.fromhex(p.stem): p.stat().st_size for p in entry_names(layout_dir)[0]}


def tmp_files(root: Path) -> list[Path]:
    """Every temporary file anywhere under root (entry writes, probes, layout.json)."""
    return sorted(root.rglob("*.tmp"))


def read_all(layout_dir: Path, fingerprint: bytes = FP) -> dict[bytes, torch.Tensor]:
    """Every entry file, read and verified with the file format's own reader (raises if bad)."""
    return {k: read_entry(entry_path(layout_dir, k), fingerprint, k) for k in kv_sizes(layout_dir)}


def assert_entry(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None
    assert got.dtype == torch.int8 and got.dim() == 1
    assert torch.equal(got, want)


def assert_index_matches_disk(tier: DiskTier) -> None:
    sizes = kv_sizes(tier.dir)
    s = tier.stats()
    assert (s.entries, s.bytes_used) == (len(sizes), sum(sizes.values()))


def put_all(tier: DiskTier, items: dict[bytes, torch.Tensor]) -> None:
    for k, v in items.items():
        assert tier.put(k, v)
    tier.flush()


@pytest.fixture
def make_tier(tmp_path) -> Iterator[Callable[..., DiskTier]]:
    """DiskTier factory (root defaults to tmp_path/cache); closes every tier at the end."""
    tiers: list[DiskTier] = []

    def make(root: Path | None = None, fingerprint: bytes = FP, capacity: int = BIG, **kw):
        tier = DiskTier(root or tmp_path / "cache", fingerprint, DESC, capacity, **kw)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


@pytest.fixture(params=[False, True], ids=["buffered", "direct_io"])
def one_tier(make_tier, request):
    """A tier shared by a property's examples, with a fresh key per example; reading
    through the page cache, and past it (O_DIRECT) where the filesystem allows."""
    tier = make_tier(direct_io=request.param)
    if tier.direct_io != request.param:
        pytest.skip(f"the filesystem of {tier.dir} refuses O_DIRECT")
    return tier, itertools.count()


# Child processes import this module for the same key() and payload().
CHILD_PRELUDE = f"""
import json, os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_disk_tier import BIG, DESC, FP, key, payload
from hybridkv.core.tiers.disk import DiskTier
"""


def spawn(body: str, *args: object, **popen) -> subprocess.Popen:
    """A new Python running CHILD_PRELUDE + body, with args in sys.argv[1:]."""
    code = CHILD_PRELUDE + textwrap.dedent(body)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], text=True, **popen)


def child_result(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """The JSON object a child printed last; fails the test if the child failed."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def wait_until(cond: Callable[[], object], what: str, proc: subprocess.Popen, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := cond()):
        if proc.poll() is not None:
            pytest.fail(f"child exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.0005)
    return found


def mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a real tmpfs of `size` at path; the reason it could not, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return f"cannot mount a tmpfs: {r.stderr.strip().splitlines()[0]}" if r.returncode else None


def umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs mounted at path for the block; skips the test where none can be mounted."""
    if why := mount_tmpfs(path, size):
        pytest.skip(why)
    try:
        yield path
    finally:
        umount(path)


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 4096, (1 << 20) + 3])
def test_round_trip_sizes(make_tier, nbytes):
    tier = make_tier()
    want = payload(nbytes, nbytes)
    assert tier.put(key(1), want)
    tier.flush()
    assert_entry(tier.get(key(1)), want)
    assert kv_sizes(tier.dir) == {key(1): file_bytes(nbytes)}
    # A fresh tier reads the file itself, not what the first one still holds.
    assert_entry(make_tier().get(key(1)), want)


def test_get_while_queued_returns_the_entry(make_tier):
    tier = make_tier(writers=1)
    items = {key(i): payload(i, 1 << 20) for i in range(8)}
    for k, v in items.items():
        assert tier.put(k, v)
        assert tier.contains(k)
        assert_entry(tier.get(k), v)  # from the queue or from disk, never a miss
    tier.flush()
    assert read_all(tier.dir).keys() == items.keys()
    assert tier.stats().misses == 0


def test_put_of_a_stored_key_is_a_no_op(make_tier):
    tier = make_tier()
    put_all(tier, {key(1): payload(1, 100)})
    assert tier.put(key(1), payload(2, 100))
    tier.flush()
    assert_entry(tier.get(key(1)), payload(1, 100))
    assert tier.stats().puts == 1


@PROPERTY
@given(data=st.binary(max_size=5000), group=st.integers(0, 0xFFFF))
def test_round_trip_any_bytes(one_tier, data, group):
    tier, counter = one_tier
    k = group_key(next(counter).to_bytes(KEY_BYTES, "big"), group)
    want = torch.tensor(list(data), dtype=torch.uint8).view(torch.int8)
    put_all(tier, {k: want})
    assert_entry(tier.get(k), want)
    assert entry_path(tier.dir, k).stat().st_size == file_bytes(len(data))


# ---- restarts and layouts -----------------------------------------------------------------------
def test_restart_rebuilds_the_index(make_tier, tmp_path):
    items = {key(i, group=i % 3): payload(i, 1000 * i) for i in range(20)}
    first = make_tier()
    put_all(first, items)
    first.close()

    second = make_tier()
    assert_index_matches_disk(second)
    assert second.stats().entries == len(items)
    for k, v in items.items():
        assert second.contains(k)
        assert_entry(second.get(k), v)
    assert second.stats().hits == len(items)

    other = make_tier(fingerprint=OTHER_FP)
    assert other.dir == tmp_path / "cache" / OTHER_FP.hex() != second.dir
    assert other.stats().entries == 0
    assert not any(other.contains(k) or other.get(k) is not None for k in items)
    assert entry_names(other.dir) == ([], [])
    for tier, fp in ((second, FP), (other, OTHER_FP)):
        meta = json.loads((tier.dir / "layout.json").read_text())
        assert meta == {"file_version": FILE_VERSION, "fingerprint": fp.hex(), "layout": DESC}


def test_restart_orders_by_mtime_and_get_refreshes_it(make_tier):
    """The index is rebuilt oldest mtime first; a budget smaller than the directory evicts the
    oldest at start, and get() makes an entry the newest for the next restart."""
    nbytes = 1000
    writer = make_tier()
    put_all(writer, {key(i): payload(i, nbytes) for i in range(5)})
    writer.close()
    layout_dir = writer.dir
    base = time.time() - 1000
    for i in range(5):  # written in a burst, so give them distinct ages: 0 is the oldest
        os.utime(entry_path(layout_dir, key(i)), (base + i, base + i))

    four = make_tier(capacity=4 * file_bytes(nbytes))
    assert four.stats().evictions == 1
    assert set(kv_sizes(layout_dir)) == {key(i) for i in (1, 2, 3, 4)}
    assert_entry(four.get(key(1)), payload(1, nbytes))
    assert entry_path(layout_dir, key(1)).stat().st_mtime > base + 100
    four.close()

    two = make_tier(capacity=2 * file_bytes(nbytes))
    assert set(kv_sizes(layout_dir)) == {key(1), key(4)}
    assert_index_matches_disk(two)


@pytest.mark.parametrize(
    ("name", "age", "removed"),
    [
        ("own", 0, True),  # our own pid at start: a restarted container reusing it
        ("dead", 0, True),
        ("live", 0, False),
        ("other-host", 0, False),
        ("other-namespace", 0, False),
        ("other-namespace", 2 * STALE_TMP_SECONDS, True),
        ("other-host", 2 * STALE_TMP_SECONDS, True),
        ("live", 2 * STALE_TMP_SECONDS, True),
    ],
)
def test_startup_removes_leftovers_of_dead_writers(make_tier, name, age, removed):
    layout_dir = make_tier().dir
    dead = subprocess.Popen(["true"])
    dead.wait()
    pid, host = {
        "own": (os.getpid(), HOST),
        "dead": (dead.pid, HOST),
        "live": (os.getppid(), HOST),
        "other-host": (dead.pid, HOST + "x"),
        # this host's name in another PID namespace (a container on the host network)
        "other-namespace": (dead.pid, socket.gethostname().replace(".", "_") + "_1"),
    }[name]
    stem = key(7).hex()
    tmp = layout_dir / stem[:2] / f".{stem}-0.{pid}.{host}.tmp"
    tmp.parent.mkdir()
    tmp.write_bytes(b"partial")
    os.utime(tmp, (time.time() - age, time.time() - age))
    tier = make_tier()
    assert (tier.leftovers_removed, tmp.exists()) == ((1, False) if removed else (0, True))
    assert tier.stats().entries == 0


def test_a_second_tier_of_this_process_keeps_the_firsts_writes(make_tier):
    """Own-pid temporary files are leftovers only when no live tier of ours wrote them."""
    first = make_tier(writers=1, queue_bytes=1 << 30)
    items = {key(i): payload(i, 8 << 20) for i in range(12)}
    for k, v in items.items():
        assert first.put(k, v)
    for _ in range(5):
        make_tier()  # each scans the directory while `first` writes
    first.flush()
    assert first.stats().write_errors == 0
    for k, v in items.items():
        assert_entry(first.get(k), v)


# ---- damaged and foreign files ----------------------------------------------------------------
def xor_at(path: Path, offset: int, mask: int = 0x5A) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


NBYTES = 3000
# (damage(path, donors), the reason read_entry gives). Donors: same key written under another
# layout, and another key of this layout, both NBYTES long.
DAMAGE = {
    "payload-byte": (lambda p, d: xor_at(p, HEADER_BYTES + 1234), "checksum"),
    "last-payload-byte": (lambda p, d: xor_at(p, HEADER_BYTES + NBYTES - 1, 1), "checksum"),
    "group-id": (lambda p, d: xor_at(p, 12, 1), "key"),
    "flags": (lambda p, d: xor_at(p, 14), "header"),
    "mac-flag": (lambda p, d: xor_at(p, 14, 1), "truncated"),  # no MAC trailer follows
    "chunk-key": (lambda p, d: xor_at(p, 40), "key"),
    "length": (lambda p, d: xor_at(p, 48, 1), "truncated"),
    "checksum-field": (lambda p, d: xor_at(p, 60), "checksum"),
    "header-bytes": (lambda p, d: write_at(p, 10, (128).to_bytes(2, "little")), "header"),
    "magic": (lambda p, d: write_at(p, 0, b"NOTHYBRD"), "magic"),
    "truncated-payload": (lambda p, d: truncate(p, HEADER_BYTES + NBYTES // 2), "truncated"),
    "truncated-header": (lambda p, d: truncate(p, 40), "truncated"),
    "empty": (lambda p, d: truncate(p, 0), "truncated"),
    "appended": (lambda p, d: append(p, b"\0"), "truncated"),
    "other-layout": (lambda p, d: shutil.copyfile(d["other-layout"], p), "layout"),
    "other-key": (lambda p, d: shutil.copyfile(d["other-key"], p), "key"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_file_is_a_counted_miss_and_removed(make_tier, damage):
    tier = make_tier()
    target, neighbour = key(1), key(2)
    items = {target: payload(1, NBYTES), neighbour: payload(2, NBYTES)}
    put_all(tier, items)
    foreign = make_tier(fingerprint=OTHER_FP)
    put_all(foreign, {target: payload(9, NBYTES)})
    donors = {
        "other-layout": entry_path(foreign.dir, target),
        "other-key": entry_path(tier.dir, neighbour),
    }
    path = entry_path(tier.dir, target)
    do, reason = DAMAGE[damage]
    do(path, donors)

    with pytest.raises(EntryFileError) as err:
        read_entry(path, FP, target)
    assert err.value.reason == reason

    assert tier.get(target) is None
    s = tier.stats()
    assert (s.corrupt, s.misses, s.hits) == (1, 1, 0)
    assert not path.exists()
    assert_index_matches_disk(tier)
    # The tier keeps working: other keys, and the damaged key once stored again.
    assert_entry(tier.get(neighbour), items[neighbour])
    put_all(tier, {target: items[target]})
    assert_entry(tier.get(target), items[target])
    assert tier.stats().corrupt == 1
    assert_entry(foreign.get(target), payload(9, NBYTES))  # the donor is untouched


def _damage_case(
    one_tier, nbytes: int, damage: Callable[[Path, int], None], removed: bool = True
) -> None:
    tier, counter = one_tier
    k = key(next(counter))
    put_all(tier, {k: payload(index_of(k), nbytes)})
    path = entry_path(tier.dir, k)
    damage(path, file_bytes(nbytes))
    before = tier.stats()
    assert tier.get(k) is None
    after = tier.stats()
    assert (after.corrupt - before.corrupt, after.hits - before.hits) == (1, 0)
    assert path.exists() != removed


VERSION_FIELD = range(8, 10)


@PROPERTY
@given(
    nbytes=st.integers(0, 2000), where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255)
)
def test_any_flipped_byte_is_rejected(one_tier, nbytes, where, mask):
    """Rejected wherever it is; removed unless it makes another file version, which a
    reader of that version may use (tests/test_disk_hardening.py)."""
    offset = int(where * file_bytes(nbytes))
    removed = offset not in VERSION_FIELD
    _damage_case(one_tier, nbytes, lambda p, size: xor_at(p, offset, mask), removed)


@PROPERTY
@given(nbytes=st.integers(0, 2000), where=st.floats(0, 1, exclude_max=True))
def test_any_truncation_is_rejected(one_tier, nbytes, where):
    _damage_case(one_tier, nbytes, lambda p, size: truncate(p, int(where * size)))


# ---- byte budget ------------------------------------------------------------------------------
def test_budget_keeps_the_most_recently_used(make_tier):
    nbytes = 1000
    capacity = 5 * file_bytes(nbytes) + 10
    tier = make_tier(capacity=capacity)
    for i in range(20):
        put_all(tier, {key(i): payload(i, nbytes)})
        assert sum(kv_sizes(tier.dir).values()) <= capacity
        assert_index_matches_disk(tier)
    assert set(kv_sizes(tier.dir)) == {key(i) for i in range(15, 20)}
    assert tier.stats().evictions == 15

    assert_entry(tier.get(key(15)), payload(15, nbytes))  # the oldest becomes the newest
    put_all(tier, {key(20): payload(20, nbytes), key(21): payload(21, nbytes)})
    assert set(kv_sizes(tier.dir)) == {key(i) for i in (15, 18, 19, 20, 21)}
    assert tier.stats().evictions == 17
    for k in kv_sizes(tier.dir):
        assert_entry(tier.get(k), payload(index_of(k), nbytes))


def test_budget_holds_with_concurrent_writers(make_tier):
    capacity = 4 << 20
    tier = make_tier(capacity=capacity, writers=4)
    put_all(tier, {key(i): payload(i, (100 + 37 * i) << 10) for i in range(60)})
    sizes = kv_sizes(tier.dir)
    assert 0 < sum(sizes.values()) <= capacity
    assert_index_matches_disk(tier)
    s = tier.stats()
    assert s.puts == 60 and s.evictions == 60 - len(sizes) and s.write_errors == 0
    assert tmp_files(tier.dir) == []


def test_entry_larger_than_the_budget_is_rejected(make_tier):
    tier = make_tier(capacity=file_bytes(1000) - 1)
    assert not tier.put(key(1), payload(1, 1000))
    assert tier.put(key(2), payload(2, 999))
    tier.flush()
    s = tier.stats()
    assert (s.rejected_puts, s.puts) == (1, 1)
    assert set(kv_sizes(tier.dir)) == {key(2)}


class ModelLRU:
    """Reference for the disk tier's budget: sizes in LRU order; a put of a stored key is a
    no-op; a get refreshes; a write evicts until it fits."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.sizes: OrderedDict[bytes, int] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def put(self, k: bytes, size: int) -> None:
        if k in self.sizes:
            return
        while self.sizes and sum(self.sizes.values()) + size > self.capacity:
            self.sizes.popitem(last=False)
            self.evictions += 1
        self.sizes[k] = size

    def get(self, k: bytes) -> bool:
        if k in self.sizes:
            self.sizes.move_to_end(k)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def delete(self, k: bytes) -> None:
        self.sizes.pop(k, None)


@PROPERTY
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7)), max_size=40
    )
)
def test_budget_matches_a_reference_lru(make_tier, tmp_path, ops):
    nbytes = [100, 300, 500, 700, 900, 1100, 1300, 1500]  # entry i has nbytes[i] bytes
    capacity = 3000
    model = ModelLRU(capacity)
    with contextlib.closing(make_tier(tmp_path / os.urandom(4).hex(), capacity=capacity)) as tier:
        for op, i in ops:
            k = key(i)
            if op == "put":
                assert tier.put(k, payload(i, nbytes[i]))
                tier.flush()
                model.put(k, file_bytes(nbytes[i]))
            elif op == "get":
                got = tier.get(k)
                assert (got is not None) == model.get(k)
                if got is not None:
                    assert_entry(got, payload(i, nbytes[i]))
            else:
                tier.delete(k)
                tier.flush()  # a writer thread unlinks the file
                model.delete(k)
            assert kv_sizes(tier.dir) == dict(model.sizes)
        s = tier.stats()
        assert (s.hits, s.misses, s.evictions) == (model.hits, model.misses, model.evictions)
        assert_index_matches_disk(tier)


# ---- write queue ------------------------------------------------------------------------------
def test_full_queue_drops_the_put(make_tier):
    tier = make_tier(queue_bytes=file_bytes(1000) - 1)
    assert not tier.put(key(1), payload(1, 1000))
    tier.flush()
    s = tier.stats()
    assert (s.dropped_puts, s.puts, s.rejected_puts) == (1, 0, 0)
    assert not tier.contains(key(1)) and tier.get(key(1)) is None
    assert entry_names(tier.dir) == ([], [])


def test_queue_room_comes_back_after_writes(make_tier):
    tier = make_tier(queue_bytes=file_bytes(1000) * 3 // 2)
    for i in range(10):
        assert tier.put(key(i), payload(i, 1000))
        tier.flush()
    assert tier.stats().dropped_puts == 0
    assert len(read_all(tier.dir)) == 10


# ---- delete and clear ---------------------------------------------------------------------------
def test_delete_while_queued_never_resurrects(make_tier):
    tier = make_tier(writers=2)
    for i in range(24):
        assert tier.put(key(i), payload(i, 1 << 20))
        assert tier.delete(key(i))  # queued, being written or just written
        assert tier.get(key(i)) is None
    tier.flush()
    assert entry_names(tier.dir) == ([], [])
    assert tier.stats().entries == 0
    assert make_tier().stats().entries == 0


def test_delete_then_put_again_stores_the_new_entry(make_tier):
    tier = make_tier(writers=4)
    for i in range(16):
        assert tier.put(key(i), payload(i, 1 << 20))
        tier.delete(key(i))
        assert tier.put(key(i), payload(100 + i, 1 << 20))
    tier.flush()
    stored = read_all(tier.dir)
    assert stored.keys() == {key(i) for i in range(16)}
    for k, v in stored.items():
        assert_entry(v, payload(100 + index_of(k), 1 << 20))
    assert tmp_files(tier.dir) == []


@pytest.mark.parametrize("put_again", [False, True], ids=["deleted", "put_again"])
def test_a_rescan_racing_an_unlink_keeps_no_ghost(make_tier, put_again):
    """A rescan lists a deleted entry's file, then the writer unlinks it before the new
    index is swapped in (the order forced by events, not by timing): the new index must
    not hold it (a hit the scheduler plans and the read fails, a `put` skipped as
    stored), unless the key was put again meanwhile."""
    import threading

    tier = make_tier(writers=1, rescan_seconds=1e9)
    k = key(1)
    put_all(tier, {k: payload(1, 4096)})
    tier.take_changes()  # the journal watched, as the worker watches it
    listed, unlinked = threading.Event(), threading.Event()
    scan, unlink = tier._scan, tier._unlink

    def scan_then_wait():
        found = scan()
        listed.set()
        assert unlinked.wait(30)
        if put_again:
            assert tier.put(k, payload(2, 4096))
        return found

    def unlink_after_the_listing(keys):
        assert listed.wait(30)
        unlink(keys)
        unlinked.set()

    tier._scan, tier._unlink = scan_then_wait, unlink_after_the_listing
    assert tier.delete(k)
    rescan = threading.Thread(target=tier.rescan)
    rescan.start()
    rescan.join()
    tier.flush()
    assert tier.contains(k) == put_again
    assert_index_matches_disk(tier)
    changes = [present for changed, present in tier.take_changes() if changed == k]
    assert changes[-1:] == [put_again]
    if put_again:
        assert_entry(tier.get(k), payload(2, 4096))
    else:
        assert tier.put(k, payload(3, 4096))  # stored again, not skipped as present
        tier.flush()
        assert_entry(tier.get(k), payload(3, 4096))


def test_delete_of_a_stored_entry(make_tier):
    tier = make_tier()
    put_all(tier, {key(1): payload(1, 10), key(2): payload(2, 10)})
    assert tier.delete(key(1))
    assert not tier.delete(key(1))
    assert tier.get(key(1)) is None and not tier.contains(key(1))  # at once
    tier.flush()  # a writer thread unlinks the file
    assert set(kv_sizes(tier.dir)) == {key(2)}
    assert_index_matches_disk(tier)


def test_clear_removes_this_tiers_entries_only(make_tier):
    """reset_prefix_cache resets this engine's entries: another engine's on the same
    directory (same layout or not) stay."""
    mine, also_mine = make_tier(), make_tier()
    other = make_tier(fingerprint=OTHER_FP)
    put_all(mine, {key(i): payload(i, 500) for i in range(5)})
    put_all(also_mine, {key(i): payload(i, 500) for i in range(5, 10)})
    put_all(other, {key(i): payload(i, 500) for i in range(3)})
    for i in range(10, 20):  # writes still queued when clear() runs must not appear
        mine.put(key(i), payload(i, 1 << 20))

    mine.clear()
    mine.flush()
    assert set(kv_sizes(mine.dir)) == {key(i) for i in range(5, 10)}  # also_mine's
    assert tmp_files(mine.dir) == []
    assert (mine.dir / "layout.json").exists()
    assert not any(mine.contains(key(i)) for i in [*range(5), *range(10, 20)])
    assert_entry(also_mine.get(key(5)), payload(5, 500))
    assert len(read_all(other.dir, OTHER_FP)) == 3
    # Still usable afterwards.
    put_all(mine, {key(1): payload(1, 500)})
    assert_entry(also_mine.get(key(1)), payload(1, 500))


# ---- several processes --------------------------------------------------------------------------
WRITE_SAME_KEYS = """
root, go, n, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tier = DiskTier(root, FP, DESC, BIG, writers=2)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
for i in range(n):
    tier.put(key(i), payload(i, nbytes))
tier.flush()
stats = vars(tier.stats())
tier.close()
print(json.dumps(stats))
"""


def test_two_processes_write_the_same_keys(make_tier, tmp_path):
    root, go, n, nbytes = tmp_path / "cache", tmp_path / "go", 48, 256 << 10
    procs = [spawn(WRITE_SAME_KEYS, root, go, n, nbytes) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        go.touch()  # both start writing at once
        results = [child_result(p) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for s in results:
        assert (s["puts"], s["write_errors"], s["corrupt"]) == (n, 0, 0)
    layout_dir = root / FP.hex()
    stored = read_all(layout_dir)
    assert stored.keys() == {key(i) for i in range(n)}
    for k, v in stored.items():
        assert_entry(v, payload(index_of(k), nbytes))
    assert tmp_files(root) == []
    reader = make_tier(root)
    assert reader.leftovers_removed == 0
    assert all(reader.get(key(i)) is not None for i in range(n))
    assert reader.stats().corrupt == 0


KEEP_WRITING = """
import threading
from hybridkv.core.tiers import disk as disk_module
root, nbytes = sys.argv[1], int(sys.argv[2])
real, calls = disk_module.write_entry, []

def write_then_stall(f, *args, **kwargs):
    calls.append(1)
    if len(calls) > 2:  # the third write stops halfway: the kill finds it in progress
        f.write(bytes(nbytes // 2))
        f.flush()
        threading.Event().wait()
    return real(f, *args, **kwargs)

disk_module.write_entry = write_then_stall
tier = DiskTier(root, FP, DESC, 3 * (nbytes + 64), writers=1, fsync=False)
for i in range(3):
    tier.put(key(i), payload(i, nbytes))
    tier.flush()
"""


def test_writer_killed_mid_write(make_tier, tmp_path):
    """A writer process killed while an entry's file is half written (by construction:
    its third write stops halfway, so no machine's speed decides what the kill finds):
    the entries it finished read back exactly, and the next tier removes the leftover."""
    root, nbytes = tmp_path / "cache", 1 << 20
    layout_dir = root / FP.hex()
    proc = spawn(KEEP_WRITING, root, nbytes, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(entry_names(layout_dir)[0]) >= 2, "two entries", proc, 60)
        wait_until(lambda: entry_names(layout_dir)[1], "a temporary file", proc, 60)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    leftovers = entry_names(layout_dir)[1]
    assert len(leftovers) == 1

    reader = make_tier(root)
    visible = kv_sizes(layout_dir)
    assert sorted(visible) == sorted([key(0), key(1)])
    for k in visible:
        assert_entry(reader.get(k), payload(index_of(k), nbytes))
    assert reader.stats().corrupt == 0
    assert reader.leftovers_removed == 1
    assert tmp_files(root) == []


# ---- full disks ----------------------------------------------------------------------------------
FILE_SIZE_LIMIT = """
import resource
root, limit, n, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
tier = DiskTier(root, FP, DESC, BIG)
accepted = [tier.put(key(i), payload(i, nbytes)) for i in range(n)]
tier.flush()
stats = vars(tier.stats())
tier.close()
print(json.dumps({"accepted": accepted, "writable": tier.writable, **stats}))
"""


def test_file_size_limit_gives_write_errors(make_tier, tmp_path):
    root, n, nbytes = tmp_path / "cache", 4, 256 << 10
    r = child_result(spawn(FILE_SIZE_LIMIT, root, 64 << 10, n, nbytes))
    assert r["writable"] and r["accepted"] == [True] * n
    assert (r["write_errors"], r["puts"], r["entries"], r["bytes_used"]) == (n, 0, 0, 0)
    assert entry_names(root / FP.hex()) == ([], [])
    assert tmp_files(root) == []

    tier = make_tier(root)  # without the limit, the same directory works
    put_all(tier, {key(i): payload(i, nbytes) for i in range(n)})
    assert tier.stats().write_errors == 0
    assert len(read_all(tier.dir)) == n


def test_full_tmpfs_gives_write_errors(make_tier, tmp_path):
    nbytes = 300 << 10  # three fit in 1 MiB, a fourth does not
    with tmpfs(tmp_path / "small", "1m") as root:
        tier = make_tier(root)  # the budget is far larger than the file system
        stored: list[int] = []
        for i in range(6):
            before = tier.stats().puts
            assert tier.put(key(i), payload(i, nbytes))
            tier.flush()
            if tier.stats().puts > before:
                stored.append(i)
        s = tier.stats()
        assert 1 <= len(stored) < 6 and stored == list(range(len(stored)))
        assert (s.puts, s.write_errors) == (len(stored), 6 - len(stored))
        assert set(read_all(tier.dir)) == {key(i) for i in stored}
        assert tmp_files(root) == []
        for i in stored:
            assert_entry(tier.get(key(i)), payload(i, nbytes))
        # Room made by a delete is usable again, once its unlink has run: a delete only
        # queues it, and another writer thread may take a later put of another key first.
        tier.delete(key(stored[0]))
        tier.flush()
        put_all(tier, {key(99): payload(99, nbytes)})
        assert_entry(tier.get(key(99)), payload(99, nbytes))
        assert tier.stats().write_errors == 6 - len(stored)
        tier.close()


# ---- read-only and missing directories ---------------------------------------------------------
@pytest.fixture
def readonly_root(tmp_path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """(root, freeze): populate root, then freeze() makes it read-only. As root, a tmpfs
    remounted read-only (root ignores permissions); otherwise, or where mounting is not
    allowed, chmod 0o555."""
    path = tmp_path / "ro"
    if mount_tmpfs(path, "16m") is None:

        def remount_ro() -> None:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)

        try:
            yield path, remount_ro
        finally:
            umount(path)
        return

    path.mkdir(exist_ok=True)
    dirs: list[Path] = []

    def chmod_ro() -> None:
        dirs.extend(p for p in [path, *path.rglob("*")] if p.is_dir())
        for d in dirs:
            d.chmod(0o555)
        probe = path / "probe"
        with contextlib.suppress(PermissionError):
            probe.touch()
            probe.unlink()
            pytest.skip("cannot make a directory read-only: no tmpfs mount, and chmod is ignored")

    yield path, chmod_ro
    for d in dirs:
        d.chmod(0o755)


def test_read_only_dir_serves_reads(make_tier, readonly_root):
    root, freeze = readonly_root
    items = {key(i): payload(i, 2000) for i in range(3)}
    writer = make_tier(root)
    put_all(writer, items)
    writer.close()
    freeze()

    tier = make_tier(root)
    assert tier.usable and not tier.writable
    assert tier.stats().entries == len(items)
    for k, v in items.items():
        assert tier.contains(k)
        assert_entry(tier.get(k), v)
    assert not tier.put(key(9), payload(9, 2000))
    tier.flush()
    s = tier.stats()
    assert (s.rejected_puts, s.puts, s.write_errors, s.hits) == (1, 0, 0, len(items))
    assert not tier.contains(key(9)) and tier.get(key(9)) is None
    assert set(kv_sizes(tier.dir)) == set(items)

    below = make_tier(root / "new")  # cannot be created on a read-only file system
    assert not below.usable and not below.writable


def test_uncreatable_root_is_an_unusable_tier(make_tier, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tier = make_tier(blocker / "cache")
    assert not tier.usable and not tier.writable
    assert not tier.contains(key(1)) and tier.get(key(1)) is None
    assert not tier.put(key(1), payload(1, 10))
    assert not tier.delete(key(1))
    tier.clear()
    tier.flush()
    s = tier.stats()
    assert (s.rejected_puts, s.puts, s.entries, s.hits) == (1, 0, 0, 0)
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("nbytes", [1000, 3 << 20])  # read in the caller, and in parallel
def test_get_many_matches_get_and_rejects_damage(make_tier, nbytes):
    tier = make_tier()
    items = {key(i): payload(i, nbytes) for i in range(6)}
    put_all(tier, items)
    xor_at(entry_path(tier.dir, key(2)), HEADER_BYTES + 7)
    keys = [*items, key(99)]
    got = dict(zip(keys, tier.get_many(keys), strict=True))
    assert got[key(2)] is None and got[key(99)] is None
    for k, want in items.items():
        if k != key(2):
            assert_entry(got[k], want)
    assert tier.stats().corrupt == 1


def test_reads_land_in_recycled_pool_slots(make_tier):
    """An engine's disk reads go into its host pool: whole, verified, and a dropped entry's
    slot serves the next read; damage is still caught after the bytes landed in a slot."""
    pool = HostPool(pin=False, slab_bytes=1 << 16)
    tier = make_tier(alloc=pool.empty)
    items = {key(i): payload(i, 5000) for i in range(4)}
    put_all(tier, items)
    first = tier.get(key(0))
    assert_entry(first, items[key(0)])
    ptr = first.data_ptr()
    del first
    gc.collect()
    again = tier.get(key(1))
    assert again.data_ptr() == ptr
    assert_entry(again, items[key(1)])
    xor_at(entry_path(tier.dir, key(2)), HEADER_BYTES + 4999)
    assert tier.get(key(2)) is None and tier.stats().corrupt == 1
    assert_entry(tier.get(key(3)), items[key(3)])
    assert pool.slab_count == 1


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priority is Linux's")
def test_reads_and_writes_run_below_the_engines_priority(make_tier):
    """On vLLM's CPU build the model's threads share the cores with these: at equal
    priority a disk restore slowed every decode step several times over."""
    import threading

    from hybridkv.core.background import NICENESS

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    tier = make_tier(writers=1)
    expected = min(19, niceness() + NICENESS)
    assert tier._readers.submit(niceness).result() == expected
    writers = [t.native_id for t in tier._threads]
    deadline = time.monotonic() + 10  # a writer lowers its own on its first run
    while [os.getpriority(os.PRIO_PROCESS, tid) for tid in writers] != [expected]:
        assert time.monotonic() < deadline, "the disk writer runs at the engine's priority"
        time.sleep(0.01)
    assert niceness() < expected  # the calling (engine) thread keeps its own


# ---- direct reads (O_DIRECT) ------------------------------------------------------------------
def resident_pages(path: Path) -> int:
    """How many of the file's pages the OS page cache holds (mincore over a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written back first: DONTNEED leaves dirty pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def direct_tier(make_tier) -> DiskTier:
    tier = make_tier(direct_io=True)
    if not tier.direct_io:
        pytest.skip(f"the filesystem of {tier.dir} refuses O_DIRECT")
    return tier


@pytest.mark.skipif(sys.platform != "linux", reason="mincore and O_DIRECT as Linux has them")
@pytest.mark.parametrize("nbytes", [1, 4096 - HEADER_BYTES, 4096, (1 << 20) + 3, 3 << 20])
def test_direct_reads_bypass_the_page_cache(direct_tier, make_tier, nbytes):
    """With `direct_io` a cold read leaves the file out of the page cache (the entry is
    in the CPU tier already); the same read through the page cache fills it. Sizes around
    the alignment and the per-thread buffer (1 MiB)."""
    want = payload(nbytes, nbytes)
    put_all(direct_tier, {key(1): want})
    path = entry_path(direct_tier.dir, key(1))
    drop_from_page_cache(path)
    if resident_pages(path):
        pytest.skip("this filesystem keeps the file's pages cached after DONTNEED")
    assert_entry(direct_tier.get(key(1)), want)
    assert_entry(direct_tier.get_many([key(1)])[0], want)
    assert resident_pages(path) == 0
    buffered = make_tier(root=direct_tier.dir.parent)
    assert not buffered.direct_io
    assert_entry(buffered.get(key(1)), want)
    assert resident_pages(path) > 0


def test_a_refused_direct_read_goes_through_the_page_cache(direct_tier, monkeypatch):
    """A filesystem may take O_DIRECT at open and still refuse a read (EINVAL: it wants
    another alignment). A fault this machine's filesystems do not make, so it is injected:
    the read is then made through the page cache, and the entry still served."""
    import errno

    want = payload(5, (1 << 20) + 77)
    put_all(direct_tier, {key(5): want})
    real = os.preadv
    refused: list[int] = []

    def preadv(fd, buffers, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "refused")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    assert_entry(direct_tier.get(key(5)), want)
    assert refused == [0]  # refused once; the rest of the file read without O_DIRECT
    s = direct_tier.stats()
    assert (s.hits, s.errors, s.corrupt) == (1, 0, 0)
