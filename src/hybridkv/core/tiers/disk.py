"""Local-disk tier: one self-describing file per entry, persistent across restarts.

Directory: `<disk_path>/<layout fingerprint hex>/` holds `layout.json` and the entries,
fanned out by the first key byte (`ab/ab….kv`). Writes are asynchronous: `put` queues the
entry and returns; writer threads write a temporary file in the same directory and
rename it into place, so a reader sees a whole file or none. Several engine processes may
share the directory: renames are atomic, every process verifies what it reads, and an
unlink never hurts a reader that already opened the file. See docs/format.md.

The engine calls this tier from its scheduler and worker: nothing a file, another
process or the disk does may make a method raise (it would crash the engine). Every
public method turns a fault into a logged (once per reason), counted miss or False
(tiers/queued.py, which the Redis tier shares), and the directory is treated as
untrusted (tiers/files.py, and the MAC of entry_file.py).

Nothing slow runs on the caller's thread, which is the engine's (the model runner's, in
`wait_for_save` and `start_load_kv`): `delete` and `clear` only forget the entries and
hand their files to the writer threads, and budget evictions unlink outside the lock
that `put` takes. A file handed over is *doomed*: reads miss it at once, and a rename of
a new file under its name supersedes the doom, so an entry deleted then stored again
ends stored, whichever thread gets there first (a rename waits while its name is being
unlinked). A rescan builds its index outside the lock and swaps it in, replaying what
changed meanwhile.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybridkv.core.background import lower_priority
from hybridkv.core.keys import KEY_BYTES
from hybridkv.core.keytable import KeyTable
from hybridkv.core.linked_keys import LruMap
from hybridkv.core.tiers.base import TierStats
from hybridkv.core.tiers.entry_file import (
    FILE_VERSION,
    EntryFileError,
    read_entry,
    supports_direct_reads,
    write_entry,
)
from hybridkv.core.tiers.files import (
    DIR_FLAGS,
    create_exclusive,
    dir_mode,
    make_dir,
    read_small,
    real_parent,
)
from hybridkv.core.tiers.queued import QueuedTier, never_raises

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_NAME_CHARS = 2 * (KEY_BYTES + 2)  # hex of a group key
LAYOUT_JSON = "layout.json"
_LAYOUT_JSON_LIMIT = 1 << 20
# A temporary file this old is a leftover whatever process wrote it.
STALE_TMP_SECONDS = 3600.0
# Below this many bytes a batch of reads is done in the calling thread.
_PARALLEL_READ_BYTES = 4 << 20
_U64 = (1 << 64) - 1  # an inode number from its signed 64-bit value in `_written`
# Tiers of this process still running: their temporary files are not leftovers.
_live_tokens: set[str] = set()


def writer_host() -> str:
    """Who can judge a writer's pid: this host and PID namespace. Containers sharing the
    host's network (its name) and a cache directory have PID namespaces of their own, where
    a live writer's pid may be dead or another process's."""
    try:
        namespace = f"_{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        namespace = ""
    return socket.gethostname().replace(".", "_") + namespace


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scan_layout_dir(layout_dir: str | os.PathLike) -> Iterator[os.DirEntry]:
    """Every name in a layout directory and in its fan-out directories (two-character
    subdirectories, never entered through a link): what a rescan and `hybridkv inspect`
    / `gc` look at. A missing layout directory is empty (removed under us); an
    unreadable fan-out directory is passed by.

    One fan-out directory is listed at a time: a `DirEntry` holds its name, its path and
    the stat a caller asks of it, and with every one listed first a tier built on 100,000
    files kept 952 bytes an entry resident, against 355 so, both with the index of then
    (the allocator keeps memory freed among the index's own objects; `bench/disk_index.py`,
    docs/benchmarks.md)."""
    try:
        top = list(os.scandir(layout_dir))
    except FileNotFoundError:
        return
    yield from [e for e in top if not e.is_dir(follow_symlinks=False)]
    for sub in top:
        if sub.is_dir(follow_symlinks=False) and len(sub.name) == 2:
            try:
                names = list(os.scandir(sub.path))
            except OSError:
                continue
            yield from names


def entry_key(name: str) -> bytes | None:
    """The key an entry file's name holds (`<hex of chunk key and group>.kv`), or None
    for any other name (temporary files, layout.json, strays)."""
    if not name.endswith(_SUFFIX) or len(name) != _NAME_CHARS + len(_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:_NAME_CHARS])
    except ValueError:
        return None


def is_temporary(name: str) -> bool:
    """A write in progress or left by a dead writer: never read as an entry."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX)


def read_layout_json(layout_dir: str | os.PathLike) -> Any:
    """The parsed layout.json of a layout directory (any JSON value: the caller checks
    it); raises OSError (missing, a link, too large) or ValueError (not JSON)."""
    return json.loads(read_small(Path(layout_dir) / LAYOUT_JSON, _LAYOUT_JSON_LIMIT))


def discard(path: str | os.PathLike, file_id: tuple[int, int] | None = None) -> bool:
    """Remove `path`; with `file_id` (st_dev, st_ino) only while it names that file (a
    writer may have renamed a new file over it meanwhile). Whether it was removed."""
    try:
        with real_parent(path) as (dir_fd, name):
            if file_id is not None:
                st = os.lstat(name, dir_fd=dir_fd)
                if (st.st_dev, st.st_ino) != file_id:
                    return False
            os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


class _Closing(Exception):
    """The tier closed during a rescan: the scan stops and nothing is swapped in."""


class _JournaledIndex(LruMap):
    """The tier's index (key -> file bytes, least recently used first; native, no Python
    object per file: core/linked_keys.py) that also notes
    which keys came and went, once someone watches (`DiskTier.take_changes`): the worker
    reports them to the scheduler side, which plans hits around what is on disk.

    While a rescan builds the next index outside the tier's lock, `log` holds the latest
    size (None: gone) of every key changed meanwhile, for the rescan to replay on what it
    found; once the new index is swapped in, `noted` holds the keys it noted since, until
    the rescan has journaled the difference between the two (`DiskTier._journal_swap`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.changes: list[tuple[bytes, bool]] | None = None
        self.log: dict[bytes, int | None] | None = None
        self.noted: set[bytes] | None = None
        super().__init__(*args, **kwargs)

    def _note(self, key: bytes, present: bool) -> None:
        if self.changes is not None:
            self.changes.append((key, present))
        if self.noted is not None:
            self.noted.add(key)

    def _log(self, key: bytes, size: int | None) -> None:
        if self.log is not None:
            self.log[key] = size

    def log_gone(self, key: bytes) -> None:
        """A file of a key not in the index was unlinked: a rescan under way must not
        take it from what it listed before."""
        self._log(key, None)

    def __setitem__(self, key: bytes, size: int) -> None:
        if key not in self:
            self._note(key, True)
        super().__setitem__(key, size)
        self._log(key, size)

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        self._note(key, False)
        self._log(key, None)

    def pop(self, key: bytes, *default: Any) -> Any:
        present = key in self
        value = super().pop(key, *default)
        if present:
            self._note(key, False)
        self._log(key, None)
        return value

    def popitem(self, last: bool = True) -> tuple[bytes, int]:
        key, size = super().popitem(last)
        self._note(key, False)
        self._log(key, None)
        return key, size

    def move_to_end(self, key: bytes) -> None:
        super().move_to_end(key)
        self._log(key, self[key])


class DiskTier(QueuedTier):
    name = "disk"
    _label = "disk"
    _log = log

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: bytes,
        layout_description: dict[str, Any],
        capacity_bytes: int,
        *,
        entry_bytes: Sequence[int] | None = None,
        file_mode: int = 0o600,
        integrity_key: str | None = None,
        queue_bytes: int = 256 << 20,
        writers: int = 2,
        readers: int = 4,
        fsync: bool = False,
        direct_io: bool = False,
        rescan_seconds: float = 60.0,
        alloc: Callable[[int], torch.Tensor] | None = None,
    ):
        """`entry_bytes`: payload bytes of one entry of each group, by group id; a file
        claiming another size is rejected before anything is allocated (None: checked
        against the file's size only). `file_mode`: permissions of the files written
        (directories get the matching search bits). `integrity_key`: read and write only
        entries MACed under this secret (docs/format.md). `direct_io`: read files past
        the page cache (O_DIRECT), where the filesystem allows it."""
        super().__init__(
            fingerprint, entry_bytes, integrity_key, queue_bytes, alloc, capacity_bytes
        )
        self.dir = Path(root) / fingerprint.hex()
        self.capacity = capacity_bytes
        self.fsync = fsync
        self.rescan_seconds = rescan_seconds
        self._file_mode = file_mode
        self._dir_mode = dir_mode(file_mode)
        self._meta = {
            "file_version": FILE_VERSION,
            "fingerprint": fingerprint.hex(),
            "layout": layout_description,
        }
        self._host = writer_host()
        self._token = uuid.uuid4().hex[:8]
        _live_tokens.add(self._token)
        # key -> file bytes, least recently used first.
        self._index = _JournaledIndex()
        self._used = 0
        # Files this tier renamed into place, key -> st_ino (as a signed 64-bit value):
        # what clear() removes. Every one is in the layout directory, on its filesystem
        # (`_dev`); a native table, as the index is: one entry per file written.
        self._written = KeyTable()
        self._dev: int | None = None
        # Files found unusable but left in place (another version's or key's), key ->
        # (st_dev, st_ino): absent for contains() and the index until replaced, so that
        # this engine stores the entry again rather than skip it as stored.
        self._kept: dict[bytes, tuple[int, int]] = {}
        # Files handed to a writer thread to unlink, key -> (st_dev, st_ino) of the very
        # file (None: whatever file holds the name); a rename under the name supersedes
        # it. Keys being unlinked right now are in `_unlinking`: a rename of one waits
        # (`_unlinked`), so that no unlink removes the newer file.
        self._doomed: dict[bytes, tuple[int, int] | None] = {}
        self._unlinking: Counter[bytes] = Counter()
        self._unlinked = threading.Condition(self._lock)
        self.leftovers_removed = 0
        self._last_scan = 0.0
        self._scanning = False
        self._scan_lock = threading.Lock()  # one rescan at a time
        self.usable = self._prepare()
        self.writable = self.usable and self._probe_writable()
        # Whether reads bypass the page cache: asked for, and the filesystem serves them.
        self.direct_io = direct_io and self.usable and supports_direct_reads(self.dir / LAYOUT_JSON)
        if direct_io and not self.direct_io and self.usable:
            self._warn_once(
                "direct", "hybridkv: %s refuses O_DIRECT: reads go through the page cache", self.dir
            )
        if self.usable:
            self.rescan()
        self._threads = [
            threading.Thread(target=self._writer, name=f"hybridkv-disk-{i}", daemon=True)
            for i in range(writers if self.writable else 0)
        ]
        for t in self._threads:
            t.start()
        # Reads of one hit run in parallel: file reads and checksums release the GIL.
        self._readers = ThreadPoolExecutor(
            readers, thread_name_prefix="hybridkv-read", initializer=lower_priority
        )
        # Daemon writers die with the interpreter: drain the queue first.
        atexit.register(self.close)

    # ---- start ----------------------------------------------------------------------------
    def _prepare(self) -> bool:
        """Create the directory and its layout.json (at start, and again should the
        directory be removed); False if neither exists nor can, or the layout directory is
        a link (its files would land where the link points)."""
        path = self.dir / LAYOUT_JSON
        try:
            self.dir.parent.parent.mkdir(parents=True, exist_ok=True)
            make_dir(self.dir.parent, self._dir_mode)  # disk_path, if it is new
            make_dir(self.dir, self._dir_mode)
            if not stat.S_ISDIR(os.lstat(self.dir).st_mode):
                self._warn_once("dir", "hybridkv: disk tier off: %s is no directory", self.dir)
                return False
            if not os.path.lexists(path):
                self._write_layout_json(path)
        except OSError as e:
            if not os.path.isdir(self.dir):
                self._warn_once("dir", "hybridkv: disk tier off: cannot create %s: %s", self.dir, e)
                return False
        try:
            meta = read_layout_json(self.dir)
            found = meta.get("fingerprint") if isinstance(meta, dict) else "a non-object"
        except (OSError, ValueError, RecursionError) as e:
            found = f"unreadable ({e})"
        if found != self.fingerprint.hex():
            self._warn_once("json", "hybridkv: %s names layout %s, not this one", path, found)
        return True

    def _write_layout_json(self, path: Path) -> None:
        """Write layout.json atomically (another process may write it at the same time)."""
        tmp = self.dir / self._tmp_name("layout")
        data = (json.dumps(self._meta, indent=2, sort_keys=True) + "\n").encode()
        try:
            with os.fdopen(create_exclusive(str(tmp), self._file_mode), "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            discard(tmp)
            raise

    def _probe_writable(self) -> bool:
        probe = self.dir / self._tmp_name("probe")
        try:
            os.close(create_exclusive(str(probe), self._file_mode))
            probe.unlink()
            return True
        except OSError as e:
            log.warning(
                "hybridkv: %s is read-only (%s): serving its entries, storing none", self.dir, e
            )
            return False

    def _tmp_name(self, stem: str) -> str:
        """A random name that a later scan can tell the writer (and whether it died) by."""
        owner = f"{os.getpid()}-{self._token}.{self._host}"
        return f".{stem}-{os.urandom(8).hex()}.{owner}{_TMP_SUFFIX}"

    def path_of(self, key: bytes) -> Path:
        """Where the entry named `key` lives (whether or not it exists)."""
        name = key.hex()
        return self.dir / name[:2] / (name + _SUFFIX)

    @never_raises()
    def rescan(self) -> None:
        """Rebuild the index from the directory, oldest file first, and enforce the budget.

        The directory is the truth: other processes add and evict entries, and a restart
        starts from what is on disk. Temporary files of dead writers are removed here.
        Only regular files count; links and anything else under an entry name are ignored.

        Only the swap holds the tier's lock: the directory is read and the new index
        built without it (an engine's `put` never waits for a scan of 100k files), what
        changed in the meantime (the old index logs it) is replayed onto the new one,
        and the difference is journaled and the files over budget unlinked after it.
        """
        with self._scan_lock:
            with self._lock:
                self._index.log = {}
            try:
                found, kept = self._scan()
                new = _JournaledIndex((key, size) for _, key, size in found)
                keys = set(new)
                used = sum(size for _, _, size in found)
            except BaseException as e:
                with self._lock:
                    self._index.log = None
                if isinstance(e, _Closing):
                    return
                raise
            with self._lock:
                old = self._index
                log, old.log = old.log or {}, None
                if self._closed:
                    return
                # What changed while the directory was read; files handed to an unlink.
                for key, size in log.items():
                    used -= new.pop(key, 0)
                    keys.discard(key)
                    if size is not None:
                        new[key] = size
                        used += size
                        keys.add(key)
                for key in self._doomed.keys() | self._unlinking.keys():
                    used -= new.pop(key, 0)
                    keys.discard(key)
                new.changes, new.noted = old.changes, set()
                self._index, self._used = new, used
                self._kept = {**kept, **{k: v for k, v in self._kept.items() if k in log}}
                self._last_scan = time.monotonic()
                victims = self._evict_to(self.capacity)
            self._journal_swap(old, new, keys)
            self._unlink(victims)

    def _scan(self) -> tuple[list[tuple[int, bytes, int]], dict[bytes, tuple[int, int]]]:
        """The entry files in the directory, (mtime, key, bytes) oldest first, and the
        unusable ones still kept (see `_kept`); removes leftover temporary files. Stops
        (`_Closing`) once the tier closes: a scan of a large or network directory must not
        hold up the engine's shutdown, which vLLM cuts short after a few seconds."""
        found: list[tuple[int, bytes, int]] = []
        kept: dict[bytes, tuple[int, int]] = {}
        now = time.time()
        for e in scan_layout_dir(self.dir):
            if self._closed:
                raise _Closing
            try:
                if (key := entry_key(e.name)) is not None:
                    if e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        if self._kept.get(key) == (st.st_dev, st.st_ino):
                            kept[key] = (st.st_dev, st.st_ino)
                        else:
                            found.append(
                                (st.st_mtime_ns, key, self._counted_bytes(key, st.st_size))
                            )
                elif e.name.endswith(_TMP_SUFFIX) and self._is_leftover(e, now) and discard(e.path):
                    self.leftovers_removed += 1
            except (OSError, ValueError):
                continue
        found.sort()
        return found, kept

    def _journal_swap(self, old: _JournaledIndex, new: _JournaledIndex, keys: set[bytes]) -> None:
        """Journal the keys a rescan found come or gone: `keys` were the new index's when
        it replaced `old`, which nobody changes any more, so the difference is taken
        without the lock. A key noted since the swap has a newer note already."""
        gone = [k for k in old if k not in keys]
        came = [k for k in keys if k not in old]
        with self._lock:
            noted, new.noted = new.noted or set(), None
            if new.changes is not None:
                new.changes.extend((k, False) for k in gone if k not in noted)
                new.changes.extend((k, True) for k in came if k not in noted)
            for key in gone:
                if key not in new:
                    self._written.pop(key, None)

    def rescan_if_stale(self) -> None:
        """Start a rescan in the background when the last one is `rescan_seconds` old, so
        that entries other engines write to a shared directory are found while this one
        runs (writes trigger rescans too). Never waits on the directory."""
        with self._lock:
            if (
                self._scanning
                or self._closed
                or not self.usable
                or time.monotonic() - self._last_scan <= self.rescan_seconds
            ):
                return
            self._scanning = True

        def scan() -> None:
            try:
                self.rescan()
            finally:
                self._scanning = False

        self._readers.submit(scan)

    def _is_leftover(self, e: os.DirEntry, now: float) -> bool:
        """A temporary file whose writer died: this host's (and PID namespace's:
        `writer_host`) with a dead pid, or with our own pid (a restarted container reuses
        pids) but no live tier of this process behind it, or any that is old."""
        parts = e.name.split(".")  # ".<stem>-<random>.<pid>-<tier token>.<host>.tmp"
        pid, _, token = parts[2].partition("-") if len(parts) == 5 else ("", "", "")
        if parts[3:4] == [self._host] and pid.isdigit():
            if int(pid) == os.getpid():
                if token not in _live_tokens:
                    return True
            elif not _pid_alive(int(pid)):
                return True
        return now - e.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS

    # ---- the tier interface -----------------------------------------------------------------
    @never_raises(lambda self, key: False)
    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index or key in self._pending:
                return True
            if self._gone(key):
                return False
        if not self.usable:
            return False
        try:  # another process may have written it
            st = os.stat(self.path_of(key), follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or self._kept.get(key) == (st.st_dev, st.st_ino):
            return False
        with self._lock:
            if self._gone(key):
                return False
            if key not in self._index:
                size = self._counted_bytes(key, st.st_size)
                self._index[key] = size
                self._used += size
        return True

    @never_raises(lambda self, key: self._misses(1)[0])
    def get(self, key: bytes) -> torch.Tensor | None:
        queued = self._queued_hits([key])[0]
        if queued is not None:
            return queued
        with self._lock:
            gone = self._gone(key)
        if gone or not self.usable:
            self._misses(1)
            return None
        path = self.path_of(key)
        try:
            entry = read_entry(
                path, self.fingerprint, key, direct=self.direct_io, **self._read_checks(key)
            )
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            self._misses(1)
            return None
        except EntryFileError as e:
            self._reject(key, path, e)
            return None
        except OSError as e:  # EIO, EMFILE...: the file may be good, so it stays
            self._warn_once(f"read:{e.errno}", "hybridkv: disk tier cannot read %s: %s", path, e)
            with self._lock:
                self._stats.errors += 1
                self._stats.misses += 1
            return None
        with self._lock:
            self._stats.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
        # Recency for other processes and restarts.
        with contextlib.suppress(OSError), real_parent(path) as (dir_fd, name):
            os.utime(name, dir_fd=dir_fd, follow_symlinks=False)
        return entry

    @never_raises(lambda self, keys: [None] * len(keys))
    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        with self._lock:
            known = sum(self._index.get(k, 0) for k in keys)
        if known < _PARALLEL_READ_BYTES or not self.usable or self._closed:
            return [self.get(k) for k in keys]  # handing out small reads costs more
        return list(self._readers.map(self.get, keys))

    @never_raises(lambda self, key, entry: False)
    def put(self, key: bytes, entry: torch.Tensor) -> bool:
        size = self._file_bytes(key, entry)
        if not self.writable or self._closed:
            with self._lock:
                self._stats.rejected_puts += 1
            return False
        with self._lock:
            if key in self._index or key in self._pending:
                return True
            if size > self.capacity:
                self._stats.rejected_puts += 1
                return False
            return self._enqueue(key, entry, size)

    @never_raises(lambda self, key: False)
    def knows(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    @never_raises()
    def clear(self) -> None:
        """Drop queued writes and forget the files this tier wrote; a writer thread
        removes each only while it is still the file written (another writer may have
        replaced it since) and no put after the clear has renamed a new one in. Other
        writers' entries in a shared directory stay: they are not this engine's to reset."""
        with self._lock:
            self._cancel_all()
            written, self._written = self._written, KeyTable()
            for key in written:
                self._used -= self._index.pop(key, 0)
            self._hand_over({key: (self._dev, ino & _U64) for key, ino in written.items()})

    @never_raises()
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_writers(self._threads)
        self._readers.shutdown()
        _live_tokens.discard(self._token)
        atexit.unregister(self.close)

    @never_raises(lambda self: TierStats(capacity_bytes=self.capacity))
    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.entries, s.bytes_used = len(self._index), self._used
            return s

    @never_raises(lambda self, everything=False: [])
    def take_changes(self, everything: bool = False) -> list[tuple[bytes, bool]]:
        """Keys that entered (True) or left (False) the index since the last call. The
        first call, and one with `everything`, returns every key held and (re)starts
        the watch."""
        with self._lock:
            if self._index.changes is None or everything:
                self._index.changes = []
                return [(key, True) for key in self._index]
            changes, self._index.changes = self._index.changes, []
            return changes

    # ---- internals ---------------------------------------------------------------------------
    def _forget(self, key: bytes) -> bool:
        self._written.pop(key, None)
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size
        return size is not None

    def _remove(self, key: bytes) -> bool:
        """A writer thread unlinks whatever file holds the name (another engine's too):
        a rename of a later put's file supersedes it."""
        return self._hand_over({key: None})

    def _reject(self, key: bytes, path: Path, err: EntryFileError) -> None:
        """An unusable file: a counted miss. Removed only when no reader can use it, and
        only the very file read; another version's or another key's file stays."""
        self._count_rejected(key, path.name, err)
        if err.file_id is None:
            return
        if err.damaged:
            discard(path, err.file_id)
        else:
            with self._lock:
                self._kept[key] = err.file_id

    def _evict_to(self, limit: int) -> list[bytes]:
        """Drop least recently used files from the index until `limit` bytes are used;
        their keys, doomed: the caller unlinks them (`_unlink`) once it has let go of the
        lock. Holds the lock."""
        victims = []
        while self._used > limit and self._index:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self._written.pop(key, None)
            self._stats.evictions += 1
            self._doom(key, None)
            victims.append(key)
        return victims

    def _note_written(self, key: bytes, st: os.stat_result) -> None:
        """Remember the file renamed into place under `key` for clear(); one on another
        filesystem than the first written (something mounted inside the layout
        directory) is not remembered, and stays. Holds the lock."""
        if self._dev is None:
            self._dev = st.st_dev
        if st.st_dev == self._dev:
            self._written[key] = st.st_ino - (1 << 64) if st.st_ino >> 63 else st.st_ino
        else:
            self._written.pop(key, None)

    # ---- unlinks, off the caller's thread ------------------------------------------------------
    def _gone(self, key: bytes) -> bool:
        """Doomed or being unlinked: reads miss it. Holds the lock."""
        return key in self._doomed or key in self._unlinking

    def _doom(self, key: bytes, file_id: tuple[int, int] | None) -> None:
        """Mark `key`'s file for an unlink: that very file, or with None whatever file
        holds the name (the wider of two marks stays). Holds the lock."""
        if key not in self._doomed or file_id is None:
            self._doomed[key] = file_id

    def _hand_over(self, files: dict[bytes, tuple[int, int] | None]) -> bool:
        """Doom `files` (see `_doom`) and queue their unlink for a writer thread; False
        for a tier without writers (read-only, closed), whose files stay. Holds the
        lock."""
        if not self._threads or self._closed:
            return False
        for key, file_id in files.items():
            self._doom(key, file_id)
        if files:
            self._queue.put(list(files))
        return True

    def _unlink(self, keys: Iterable[bytes]) -> None:
        """Unlink the files of `keys` that are still doomed (none renamed over since),
        without holding the lock; a rename of one of them waits meanwhile."""
        with self._lock:
            todo = [(key, self._doomed.pop(key)) for key in keys if key in self._doomed]
            self._unlinking.update(key for key, _ in todo)
        try:
            for key, file_id in todo:
                discard(self.path_of(key), file_id)
        finally:
            with self._lock:
                self._unlinking.subtract(key for key, _ in todo)
                for key, _ in todo:
                    if self._unlinking[key] <= 0:
                        del self._unlinking[key]
                    # A rescan may have listed the file before it went: its log says gone
                    # (unless the key was put again since, whose rename waited for this).
                    if key not in self._index:
                        self._index.log_gone(key)
                self._unlinked.notify_all()

    def _writer(self) -> None:
        """Take the queue in order: a key to write, or a list of keys to unlink."""
        lower_priority()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if isinstance(item, list):
                    self._unlink(item)
                else:
                    self._write(item)
                self.rescan_if_stale()
            except Exception as e:  # a writer thread must survive anything: flush() waits
                self._fault("writer", e)
            finally:
                self._queue.task_done()

    def _open_fanout(self, key: bytes) -> int:
        """A descriptor of `key`'s fan-out directory, made if missing (with the layout
        directory, should that have been removed meanwhile); never through a link."""
        sub = self.path_of(key).parent
        try:
            return os.open(sub, DIR_FLAGS)
        except FileNotFoundError:
            if not os.path.isdir(self.dir):
                self._prepare()
            make_dir(sub, self._dir_mode)
            return os.open(sub, DIR_FLAGS)

    def _write(self, key: bytes) -> None:
        """Write one queued entry to a new temporary file and rename it into place."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is None:
            return  # deleted while queued
        tmp = self._tmp_name(key.hex())
        dir_fd = created = None
        victims: list[bytes] = []
        try:
            dir_fd = self._open_fanout(key)
            with os.fdopen(create_exclusive(tmp, self._file_mode, dir_fd), "wb") as f:
                created = tmp
                write_entry(f, self.fingerprint, key, pending[0], self._mac_key)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                st = os.fstat(f.fileno())
            with self._lock:
                while key in self._unlinking:  # an unlink of the old file: it goes first
                    self._unlinked.wait()
                if not self._unqueue(key, pending):
                    return  # deleted or cleared meanwhile: never resurrect it
                victims = self._evict_to(self.capacity - pending[1])
                os.replace(tmp, self.path_of(key).name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                created = None
                self._doomed.pop(key, None)  # the new file supersedes an unlink still queued
                if key not in self._index:
                    self._used += pending[1]
                self._index[key] = pending[1]
                self._index.move_to_end(key)
                self._note_written(key, st)
                self._kept.pop(key, None)
                self._stats.puts += 1
        except Exception as e:  # a writer thread must survive anything: flush() waits on it
            what = getattr(e, "errno", None) or type(e).__name__
            self._warn_once(f"write:{what}", "hybridkv: disk tier cannot write %s: %s", tmp, e)
            with self._lock:
                self._stats.write_errors += 1
                self._unqueue(key, pending)
        finally:
            if created is not None:
                with contextlib.suppress(OSError):
                    os.unlink(created, dir_fd=dir_fd)
            if dir_fd is not None:
                os.close(dir_fd)
            self._unlink(victims)
