"""The disk tier against untrusted files and faults, on real files and real processes.

Whatever sits under an entry's name (a FIFO, a directory, a symbolic link, a file of
another version or integrity key, a header claiming a huge payload), whatever happens to
the directory (removed, full, out of descriptors), no tier method raises: a bad file is a
counted miss, never wrong data, and only files no reader can use are deleted. Also: file
and directory permissions, clear() removing only this tier's files, and the MAC.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import test_disk_tier
import torch
import xxhash
from test_disk_tier import (
    BIG,
    DESC,
    FP,
    HEADER_BYTES,
    assert_entry,
    child_result,
    entry_names,
    entry_path,
    key,
    kv_sizes,
    payload,
    put_all,
    spawn,
    tmp_files,
    tmpfs,
    write_at,
    xor_at,
)

from hybridkv.core.config import HybridKVConfig
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.store import TieredStore
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.core.tiers.entry_file import (
    FILE_VERSION,
    MAC_BYTES,
    EntryFileError,
    derive_mac_key,
    new_entry,
    read_entry,
    supports_direct_reads,
)
from hybridkv.core.tiers.files import create_exclusive, dir_mode

make_tier = test_disk_tier.make_tier  # the fixture: DiskTier factory, closes them all

NBYTES = 3000
KEY_A = "a-secret-of-sixteen-or-more"
KEY_B = "another-secret-of-that-size"


def finishes(fn: Callable[[], Any], timeout: float = 20.0) -> Any:
    """fn() in a thread; fails the test if it has not returned within `timeout` (blocked)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} blocked"
    return out[0]


def stats_delta(tier: DiskTier, before: Any) -> dict[str, int]:
    after = vars(tier.stats())
    return {k: v - vars(before)[k] for k, v in after.items() if v != vars(before)[k]}


def keyed_file_bytes(nbytes: int) -> int:
    return HEADER_BYTES + nbytes + MAC_BYTES


def fix_checksum(path: Path, trailer: int = 0) -> None:
    """Recompute the xxh3 checksum after tampering, as anyone with write access can."""
    data = path.read_bytes()
    h = xxhash.xxh3_64(data[:56])  # the header up to its checksum field
    h.update(data[HEADER_BYTES : len(data) - trailer])
    write_at(path, 56, h.intdigest().to_bytes(8, "little"))


# ---- whatever sits under an entry's name ------------------------------------------------------
def test_fifo_under_an_entry_name_never_blocks(make_tier):
    first = make_tier()
    path = entry_path(first.dir, key(1))
    path.parent.mkdir()
    os.mkfifo(path)
    tier = finishes(make_tier)  # the start-up scan passes it by
    assert tier.stats().entries == 0
    assert not tier.contains(key(1))
    before = tier.stats()
    assert finishes(lambda: tier.get(key(1))) is None
    assert finishes(lambda: tier.get_many([key(1), key(2)])) == [None, None]
    assert stats_delta(tier, before) == {"corrupt": 2, "misses": 3}
    assert stat.S_ISFIFO(os.lstat(path).st_mode)  # not ours to delete
    put_all(tier, {key(1): payload(1, NBYTES)})  # a write of the key replaces it
    assert_entry(tier.get(key(1)), payload(1, NBYTES))


def test_directory_under_an_entry_name(make_tier):
    tier = make_tier()
    path = entry_path(tier.dir, key(1))
    path.mkdir(parents=True)
    assert not tier.contains(key(1))
    assert tier.get(key(1)) is None
    assert tier.put(key(1), payload(1, NBYTES))  # the rename onto a directory fails
    tier.flush()
    s = tier.stats()
    assert (s.corrupt, s.write_errors, s.puts, s.errors) == (1, 1, 0, 0)
    assert path.is_dir() and tmp_files(tier.dir) == []
    assert make_tier().stats().entries == 0


def test_symlink_under_an_entry_name_is_not_followed(make_tier, tmp_path):
    elsewhere = make_tier(tmp_path / "elsewhere")  # a valid entry for the key, elsewhere
    put_all(elsewhere, {key(1): payload(1, NBYTES)})
    target = entry_path(elsewhere.dir, key(1))
    tier = make_tier()
    path = entry_path(tier.dir, key(1))
    path.parent.mkdir()
    path.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    entry_path(tier.dir, key(2)).symlink_to(fifo)

    assert make_tier().stats().entries == 0
    assert not tier.contains(key(1)) and not tier.contains(key(2))
    assert finishes(lambda: tier.get_many([key(1), key(2)])) == [None, None]
    s = tier.stats()
    assert (s.corrupt, s.misses, s.hits, s.errors) == (2, 2, 0, 0)
    assert path.is_symlink()
    target_bytes = target.read_bytes()
    put_all(tier, {key(1): payload(11, NBYTES)})  # replaces the link, never writes through
    assert not path.is_symlink()
    assert_entry(tier.get(key(1)), payload(11, NBYTES))
    assert target.read_bytes() == target_bytes
    assert_entry(elsewhere.get(key(1)), payload(1, NBYTES))


def test_linked_fanout_directory_is_never_written_through(make_tier, tmp_path):
    tier = make_tier()
    outside = tmp_path / "outside"
    outside.mkdir()
    (tier.dir / key(1).hex()[:2]).symlink_to(outside)
    assert tier.put(key(1), payload(1, NBYTES))
    tier.flush()
    assert (tier.stats().write_errors, tier.stats().puts) == (1, 0)
    assert list(outside.iterdir()) == []
    assert tier.get(key(1)) is None


def test_linked_fanout_directory_is_never_read_touched_or_unlinked_through(make_tier, tmp_path):
    """A co-user of a shared directory swaps a fan-out directory (holding an entry the
    index knows) for a link to another cache's: this tier's read, recency touch, delete
    and rescan go nowhere through it."""
    victim = make_tier(tmp_path / "private")
    put_all(victim, {key(1): payload(2, NBYTES)})
    theirs = victim.path_of(key(1))
    stamp = theirs.stat().st_mtime_ns
    tier = make_tier()
    put_all(tier, {key(1): payload(1, NBYTES)})
    fanout = tier.path_of(key(1)).parent
    shutil.rmtree(fanout)
    fanout.symlink_to(theirs.parent)
    assert tier.get(key(1)) is None
    assert theirs.stat().st_mtime_ns == stamp
    tier.delete(key(1))
    tier.flush()
    tier.rescan()
    assert theirs.exists() and theirs.stat().st_mtime_ns == stamp
    assert_entry(victim.get(key(1)), payload(2, NBYTES))


@pytest.mark.parametrize(
    "content",
    [b"[1, 2, 3]\n", b'"a string"', b"null", b"\xff\xfe garbage {", b"[" * 200_000, b""],
    ids=["list", "string", "null", "garbage", "deeply-nested", "empty"],
)
def test_bad_layout_json_is_logged_and_left(make_tier, caplog, content):
    layout_dir = make_tier().dir
    (layout_dir / "layout.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="hybridkv"):
        tier = make_tier()
    assert tier.usable and tier.writable
    assert any("layout.json" in r.getMessage() for r in caplog.records)
    put_all(tier, {key(1): payload(1, NBYTES)})
    assert_entry(tier.get(key(1)), payload(1, NBYTES))
    assert (layout_dir / "layout.json").read_bytes() == content


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_layout_json_that_is_no_regular_file(make_tier, tmp_path, kind):
    layout_dir = make_tier(tmp_path / "a").dir
    path = layout_dir / "layout.json"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    tier = finishes(lambda: make_tier(tmp_path / "a"))
    assert tier.usable and tier.writable
    put_all(tier, {key(1): payload(1, NBYTES)})
    assert_entry(tier.get(key(1)), payload(1, NBYTES))


# ---- sizes: checked against the layout before anything is allocated --------------------------
@pytest.fixture
def recording_alloc() -> tuple[list[int], Callable[[int], torch.Tensor]]:
    sizes: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        sizes.append(n)
        return new_entry(n)

    return sizes, alloc


@pytest.mark.parametrize("claim", [2**62, 2**40, NBYTES + 1, NBYTES - 1])
def test_payload_size_claim_is_checked_before_allocation(make_tier, recording_alloc, claim):
    sizes, alloc = recording_alloc
    tier = make_tier(entry_bytes=[NBYTES], alloc=alloc)
    put_all(tier, {key(1): payload(1, NBYTES), key(2): payload(2, NBYTES)})
    path = entry_path(tier.dir, key(1))
    write_at(path, 48, claim.to_bytes(8, "little"))
    with pytest.raises(EntryFileError) as err:
        read_entry(path, FP, key(1), payload_bytes=NBYTES, alloc=alloc)
    assert err.value.reason == "size" and err.value.damaged
    with pytest.raises(EntryFileError, match="truncated"):  # without the layout: file size
        read_entry(path, FP, key(1), alloc=alloc)
    assert tier.get(key(1)) is None
    assert sizes == []
    assert tier.stats().corrupt == 1 and not path.exists()
    assert_entry(tier.get(key(2)), payload(2, NBYTES))
    assert sizes == [NBYTES]


def test_huge_sparse_file_is_never_allocated(make_tier, recording_alloc):
    """A file really as large as its header claims (sparse) still needs the layout's size."""
    sizes, alloc = recording_alloc
    tier = make_tier(entry_bytes=[NBYTES], alloc=alloc)
    put_all(tier, {key(1): payload(1, NBYTES)})
    path = entry_path(tier.dir, key(1))
    huge = 1 << 40
    try:
        os.truncate(path, HEADER_BYTES + huge)
    except OSError as e:
        pytest.skip(f"no sparse file of 1 TiB here: {e}")
    write_at(path, 48, huge.to_bytes(8, "little"))
    assert finishes(lambda: tier.get(key(1))) is None
    assert sizes == [] and tier.stats().corrupt == 1


@pytest.mark.parametrize("found_by", ["lookup", "rescan"])
def test_a_sparse_file_claiming_a_terabyte_evicts_nothing(make_tier, found_by):
    """A file under an entry's name that another writer planted, of the size a header
    could claim (sparse: no disk used), counts what the layout gives its entry: counting
    its size emptied the tier at the next put. Its read is a counted miss."""
    file_bytes = HEADER_BYTES + NBYTES
    tier = make_tier(entry_bytes=[NBYTES], capacity=10 * file_bytes)
    ours = {key(i): payload(i, NBYTES) for i in range(8)}
    put_all(tier, ours)
    other = make_tier(entry_bytes=[NBYTES])
    put_all(other, {key(100): payload(100, NBYTES)})
    other.close()
    planted = entry_path(tier.dir, key(100))
    try:
        os.truncate(planted, 1 << 40)
    except OSError as e:
        pytest.skip(f"no sparse file of 1 TiB here: {e}")
    if found_by == "lookup":
        assert tier.contains(key(100))
    else:
        tier.rescan()
    assert tier.stats().bytes_used == 9 * file_bytes
    put_all(tier, {key(8): payload(8, NBYTES)})  # fits: nothing evicted
    assert tier.stats().evictions == 0
    for k, v in ours.items():
        assert_entry(tier.get(k), v)
    assert tier.get(key(100)) is None and tier.stats().corrupt == 1


def test_store_from_config_checks_the_layouts_entry_size(tmp_path):
    layout = Layout("m", (GroupSpec(GroupKind.FULL, 16, 1024, ("l0",)),))
    config = HybridKVConfig.from_dict({"cpu_bytes": "1MiB", "disk_path": str(tmp_path)})
    writer = DiskTier(tmp_path, layout.fingerprint, DESC, BIG)  # knows no sizes
    put_all(writer, {key(1): payload(1, 1024), key(2): payload(2, 1000)})
    writer.close()
    store = TieredStore.from_config(config, layout, pin=False)
    try:
        got = store.get_many([key(1), key(2)])
        assert set(got) == {key(1)}
        assert_entry(got[key(1)], payload(1, 1024))
        disk = store.stats()["disk"]
        assert (disk.corrupt, disk.hits, disk.errors) == (1, 1, 0)
    finally:
        store.close()


# ---- what is deleted and what is left --------------------------------------------------------
def test_other_file_version_is_a_miss_and_left_alone(make_tier):
    tier = make_tier()
    put_all(tier, {key(1): payload(1, NBYTES)})
    path = entry_path(tier.dir, key(1))
    write_at(path, 8, (FILE_VERSION + 1).to_bytes(2, "little"))  # a future writer's file
    newer = path.read_bytes()
    reader = make_tier()
    assert reader.contains(key(1))  # a stat cannot tell
    assert reader.get(key(1)) is None
    s = reader.stats()
    assert (s.corrupt, s.misses, s.errors) == (1, 1, 0)
    assert path.read_bytes() == newer
    # Not "stored" any more for this reader, so the engine stores the entry again.
    assert not reader.contains(key(1))
    reader.rescan()
    assert not reader.contains(key(1)) and reader.stats().entries == 0
    put_all(reader, {key(1): payload(1, NBYTES)})  # a writer of the key replaces it
    assert_entry(make_tier().get(key(1)), payload(1, NBYTES))


def test_file_replaced_while_read_is_not_deleted(make_tier, tmp_path):
    """A damaged file is deleted only while its name still holds it: another writer may have
    renamed a good file over it after this reader opened the damaged one."""
    actions: list[Callable[[], None]] = []

    def alloc(n: int) -> torch.Tensor:
        while actions:
            actions.pop()()
        return new_entry(n)

    tier = make_tier(alloc=alloc)
    put_all(tier, {key(1): payload(1, NBYTES)})
    path = entry_path(tier.dir, key(1))
    good = tmp_path / "good"
    shutil.copyfile(path, good)
    xor_at(path, HEADER_BYTES + 5)  # damage the file this read opens
    actions.append(lambda: os.replace(good, path))  # meanwhile a good one is renamed in
    assert tier.get(key(1)) is None
    assert tier.stats().corrupt == 1
    assert_entry(tier.get(key(1)), payload(1, NBYTES))


EMFILE_READ = """
import resource
root, nbytes = sys.argv[1], int(sys.argv[2])
tier = DiskTier(root, FP, DESC, BIG)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))  # every new descriptor: EMFILE
first = tier.get(key(1))
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
second = tier.get(key(1))
ok = second is not None and bool((second == payload(1, nbytes)).all())
print(json.dumps({"first": first is None, "second": ok, **vars(tier.stats())}))
"""


def test_transient_read_error_is_a_miss_and_keeps_the_file(make_tier, tmp_path):
    root = tmp_path / "cache"
    put_all(make_tier(root), {key(1): payload(1, NBYTES)})
    r = child_result(spawn(EMFILE_READ, root, NBYTES))
    assert r["first"] and r["second"]
    assert (r["errors"], r["corrupt"], r["misses"], r["hits"]) == (1, 0, 1, 1)
    assert set(kv_sizes(root / FP.hex())) == {key(1)}


def test_file_removed_between_lookup_and_read(make_tier):
    writer, reader = make_tier(), make_tier()
    put_all(writer, {key(1): payload(1, NBYTES)})
    assert reader.contains(key(1))
    writer.delete(key(1))
    writer.flush()  # a writer thread unlinks the file
    assert reader.get(key(1)) is None
    s = reader.stats()
    assert (s.misses, s.corrupt, s.errors, s.entries) == (1, 0, 0, 0)


def test_clear_removes_only_files_this_tier_wrote(make_tier):
    mine, theirs = make_tier(), make_tier()
    put_all(mine, {key(i): payload(i, NBYTES) for i in range(3)})
    put_all(theirs, {key(i): payload(10 + i, NBYTES) for i in (2, 3)})  # 2: renamed over mine
    reader = make_tier()
    assert reader.get(key(0)) is not None
    reader.clear()  # wrote nothing: removes nothing
    assert set(kv_sizes(mine.dir)) == {key(i) for i in range(4)}
    mine.clear()
    mine.flush()  # a writer thread unlinks the files
    assert set(kv_sizes(mine.dir)) == {key(2), key(3)}
    assert_entry(theirs.get(key(2)), payload(12, NBYTES))
    assert_entry(mine.get(key(3)), payload(13, NBYTES))


# ---- the layout directory removed, the disk full ----------------------------------------------
def test_layout_directory_removed_while_running(make_tier):
    tier = make_tier(writers=1)
    put_all(tier, {key(i): payload(i, NBYTES) for i in range(3)})
    for i in range(3, 40):  # writes queued while the directory goes away
        tier.put(key(i), payload(i, 256 << 10))
    os.rename(tier.dir, tier.dir.parent / "gone")  # rmtree could race the writer's mkdir
    tier.flush()
    assert [tier.get(key(i)) for i in range(3)] == [None] * 3
    tier.rescan()
    assert tier.stats().entries == len(kv_sizes(tier.dir))
    put_all(tier, {key(50): payload(50, NBYTES)})  # a write makes it again
    assert_entry(tier.get(key(50)), payload(50, NBYTES))
    assert (tier.dir / "layout.json").is_file()
    tier.clear()
    assert tier.stats().errors == 0
    os.rename(tier.dir.parent, tier.dir.parent.parent / "gone")  # the whole disk_path
    assert not tier.contains(key(50)) or tier.get(key(50)) is None
    tier.rescan()
    put_all(tier, {key(51): payload(51, NBYTES)})
    assert_entry(make_tier().get(key(51)), payload(51, NBYTES))
    assert tier.stats().errors == 0


FULL_DISK = """
import resource
root, nbytes = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))  # no file grows beyond 100 bytes
results = {}
for name, fp in (("existing", FP), ("new", bytes(16))):
    tier = DiskTier(root, fp, DESC, BIG)  # "new": its layout.json cannot be written
    got = tier.get_many([key(0), key(1), key(9)])
    results[name] = {
        "writable": tier.writable,
        "contains": [tier.contains(key(i)) for i in (0, 1, 9)],
        "read": [g is not None and bool((g == payload(i, nbytes)).all())
                 for i, g in zip((0, 1, 9), got)],
        "put": [tier.put(key(i), payload(i, nbytes)) for i in (5, 6)],
    }
    tier.flush()
    tier.rescan()
    results[name]["deleted"] = tier.delete(key(0))
    tier.clear()
    results[name].update(vars(tier.stats()))
    tier.close()
print(json.dumps(results))
"""


def test_full_disk_never_raises(make_tier, tmp_path):
    root = tmp_path / "cache"
    put_all(make_tier(root), {key(i): payload(i, NBYTES) for i in range(2)})
    proc = spawn(FULL_DISK, root, NBYTES)
    r = child_result(proc)
    old, new = r["existing"], r["new"]
    assert old["writable"] and new["writable"]  # creating an empty file still works
    assert old["contains"] == [True, True, False] and old["read"] == [True, True, False]
    assert old["put"] == [True, True] and old["deleted"]
    assert (old["write_errors"], old["puts"], old["errors"], old["hits"]) == (2, 0, 0, 2)
    assert new["read"] == [False] * 3 and (new["write_errors"], new["errors"]) == (2, 0)
    assert tmp_files(root) == []
    assert set(kv_sizes(root / FP.hex())) == {key(1)}


def test_tmpfs_filled_by_something_else(make_tier, tmp_path):
    with tmpfs(tmp_path / "small", "1m") as root:
        tier = make_tier(root)
        put_all(tier, {key(1): payload(1, NBYTES)})
        filler = root / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        other = make_tier(root, fingerprint=bytes(16))  # layout.json: no room
        for t in (tier, other):
            assert t.put(key(2), payload(2, 64 << 10))
            t.flush()
        assert_entry(tier.get(key(1)), payload(1, NBYTES))
        assert (tier.stats().write_errors, other.stats().write_errors) == (1, 1)
        filler.unlink()
        put_all(tier, {key(3): payload(3, NBYTES)})
        assert_entry(tier.get(key(3)), payload(3, NBYTES))
        assert tmp_files(root) == [] and tier.stats().errors == 0
        tier.close()
        other.close()


# ---- nothing raises ----------------------------------------------------------------------------
def test_bad_calls_and_faults_are_counted_not_raised(make_tier, caplog):
    def failing_alloc(n: int) -> torch.Tensor:
        raise RuntimeError("no pinned memory left")

    tier = make_tier(entry_bytes=[NBYTES])
    put_all(tier, {key(1): payload(1, NBYTES)})
    with caplog.at_level(logging.WARNING, logger="hybridkv"):
        assert not tier.put(key(2), torch.zeros(NBYTES, dtype=torch.float32))
        assert not tier.put(key(2), payload(2, NBYTES)[::2])
        assert not tier.put(b"short", payload(2, NBYTES))
        assert tier.get(b"short") is None
        assert not tier.contains(b"short") and not tier.delete(b"short")
        assert tier.get(key(1, group=7)) is None  # no such group in the layout
        tier.flush()
        assert tier.stats().errors == 5
        assert len(caplog.records) == 3  # once per kind: put ValueError, get ValueError, ...
        broken = make_tier(entry_bytes=[NBYTES], alloc=failing_alloc)
        assert broken.get_many([key(1)]) == [None]
        assert broken.stats().errors == 1
        assert entry_path(tier.dir, key(1)).exists()  # a fault is no proof of damage
        assert_entry(tier.get(key(1)), payload(1, NBYTES))
        tier.close()
        assert tier.get_many([key(1)] * 3)[0] is not None  # reads still work after close
        assert not tier.put(key(3), payload(3, NBYTES))
        tier.close()


def test_a_reason_is_logged_once(make_tier, caplog):
    tier = make_tier()
    put_all(tier, {key(i): payload(i, NBYTES) for i in range(4)})
    for i in range(4):
        xor_at(entry_path(tier.dir, key(i)), HEADER_BYTES + i)
    with caplog.at_level(logging.WARNING, logger="hybridkv"):
        assert tier.get_many([key(i) for i in range(4)]) == [None] * 4
    assert tier.stats().corrupt == 4
    assert [r.getMessage().count("checksum") for r in caplog.records] == [1]


# ---- permissions ------------------------------------------------------------------------------
@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> tuple[set[int], set[int]]:
    """(file modes, directory modes) of everything under root, root included."""
    files, dirs = set(), set()
    for p in [root, *root.rglob("*")]:
        m = stat.S_IMODE(p.lstat().st_mode)
        (dirs if p.is_dir() else files).add(m)
    return files, dirs


@pytest.mark.parametrize(
    ("file_mode", "mask", "want_dir"),
    [(0o600, 0o000, 0o700), (0o660, 0o077, 0o770), (0o640, 0o022, 0o750)],
)
def test_files_and_directories_get_exactly_the_mode(make_tier, tmp_path, file_mode, mask, want_dir):
    root = tmp_path / "cache"
    with umask(mask):
        tier = make_tier(root, file_mode=file_mode)
        put_all(tier, {key(i): payload(i, 100) for i in range(3)})
    assert dir_mode(file_mode) == want_dir
    assert modes(root) == ({file_mode}, {want_dir})


def test_store_from_config_uses_disk_mode(tmp_path):
    layout = Layout("m", (GroupSpec(GroupKind.FULL, 16, 1024, ("l0",)),))
    raw = {"disk_path": str(tmp_path / "shared"), "disk_mode": "0660"}
    store = TieredStore.from_config(HybridKVConfig.from_dict(raw), layout, pin=False)
    store.put(key(1), payload(1, 1024))
    store.close()
    assert modes(tmp_path / "shared") == ({0o660}, {0o770})


@pytest.mark.parametrize("direct_io", [False, True])
def test_store_from_config_uses_disk_direct_io(tmp_path, direct_io):
    layout = Layout("m", (GroupSpec(GroupKind.FULL, 16, 1024, ("l0",)),))
    raw = {"disk_path": str(tmp_path), "disk_direct_io": direct_io}
    store = TieredStore.from_config(HybridKVConfig.from_dict(raw), layout, pin=False)
    tier = store.tiers[1]
    try:
        # On where asked for and the filesystem serves O_DIRECT reads.
        assert tier.direct_io == (direct_io and supports_direct_reads(tier.dir / "layout.json"))
    finally:
        store.close()


def test_create_exclusive_never_follows_or_reuses_a_name(tmp_path):
    target = tmp_path / "target"
    (tmp_path / "link").symlink_to(target)  # dangling
    with pytest.raises(FileExistsError):
        create_exclusive(str(tmp_path / "link"), 0o600)
    assert not target.exists()
    target.write_bytes(b"theirs")
    with pytest.raises(FileExistsError):
        create_exclusive(str(target), 0o600)
    assert target.read_bytes() == b"theirs"


# ---- integrity key ------------------------------------------------------------------------------
def test_tiers_with_different_keys_do_not_read_each_other(make_tier):
    a, b = make_tier(integrity_key=KEY_A), make_tier(integrity_key=KEY_B)
    put_all(a, {key(1): payload(1, NBYTES)})
    path = entry_path(a.dir, key(1))
    assert path.stat().st_size == keyed_file_bytes(NBYTES)
    written = path.read_bytes()
    assert b.get(key(1)) is None
    assert (b.stats().corrupt, b.stats().hits) == (1, 0)
    assert path.read_bytes() == written  # another key's reader may use it
    assert not b.contains(key(1)) and a.contains(key(1))
    assert_entry(a.get(key(1)), payload(1, NBYTES))
    assert_entry(make_tier(integrity_key=KEY_A).get(key(1)), payload(1, NBYTES))


def test_forged_entries_are_misses(make_tier):
    a, b = make_tier(integrity_key=KEY_A), make_tier(integrity_key=KEY_B)
    put_all(b, {key(1): payload(1, NBYTES), key(2): payload(2, NBYTES)})
    path = entry_path(b.dir, key(1))
    # Copied from an engine with another key (same layout, same key name).
    other_root = make_tier(b.dir.parent.parent / "other", integrity_key=KEY_A)
    put_all(other_root, {key(1): payload(9, NBYTES)})
    shutil.copyfile(entry_path(other_root.dir, key(1)), path)
    assert b.get(key(1)) is None
    # The payload changed and the checksum recomputed: only the MAC tells.
    path2 = entry_path(b.dir, key(2))
    xor_at(path2, HEADER_BYTES + 10)
    fix_checksum(path2, trailer=MAC_BYTES)
    assert b.get(key(2)) is None
    with pytest.raises(EntryFileError, match="mac"):
        read_entry(path2, FP, key(2), mac_key=derive_mac_key(KEY_B))
    assert (b.stats().corrupt, b.stats().hits) == (2, 0)
    assert a.get(key(1)) is not None  # the copied file is a's kind of file
    put_all(b, {key(1): payload(1, NBYTES)})  # b's own write of the key replaces it
    assert_entry(b.get(key(1)), payload(1, NBYTES))
    # b's own entry of key 3 moved under key 1's name, its header's key rewritten and
    # the checksum recomputed: the MAC covers the header, so only it tells.
    from hybridkv.core.keys import split_group_key

    put_all(b, {key(3): payload(3, NBYTES)})
    chunk, group = split_group_key(key(1))
    moved = entry_path(b.dir, key(1))
    shutil.copyfile(entry_path(b.dir, key(3)), moved)
    write_at(moved, 12, group.to_bytes(2, "little"))
    write_at(moved, 32, chunk)
    fix_checksum(moved, trailer=MAC_BYTES)
    with pytest.raises(EntryFileError, match="mac"):
        read_entry(moved, FP, key(1), mac_key=derive_mac_key(KEY_B))
    assert b.get(key(1)) is None


def test_keyed_and_unkeyed_tiers_do_not_read_each_other(make_tier):
    keyed, plain = make_tier(integrity_key=KEY_A), make_tier()
    put_all(keyed, {key(1): payload(1, NBYTES)})
    put_all(plain, {key(2): payload(2, NBYTES)})
    assert plain.get(key(1)) is None and keyed.get(key(2)) is None
    for t in (plain, keyed):
        s = t.stats()
        assert (s.corrupt, s.hits, s.errors) == (1, 0, 0)
    assert set(kv_sizes(keyed.dir)) == {key(1), key(2)}  # both left for their readers
    assert_entry(keyed.get(key(1)), payload(1, NBYTES))
    assert_entry(plain.get(key(2)), payload(2, NBYTES))
    assert entry_names(plain.dir)[1] == []


def test_store_from_config_uses_integrity_key(tmp_path):
    layout = Layout("m", (GroupSpec(GroupKind.FULL, 16, 1024, ("l0",)),))
    raw = {"disk_path": str(tmp_path), "integrity_key": KEY_A}
    store = TieredStore.from_config(HybridKVConfig.from_dict(raw), layout, pin=False)
    store.put(key(1), payload(1, 1024))
    store.close()
    path = entry_path(tmp_path / layout.fingerprint.hex(), key(1))
    assert path.stat().st_size == keyed_file_bytes(1024)
    plain = DiskTier(tmp_path, layout.fingerprint, DESC, BIG)
    assert plain.get(key(1)) is None
    plain.close()
    keyed = DiskTier(tmp_path, layout.fingerprint, DESC, BIG, integrity_key=KEY_A)
    assert_entry(keyed.get(key(1)), payload(1, 1024))
    keyed.close()
