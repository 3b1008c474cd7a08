"""Local-disk tier: one self-describing file per entry, persistent across restarts.

Directory: `<disk_path>/<layout fingerprint hex>/` holds `layout.json` and the entries,
fanned out by the first key byte (`ab/ab….kv`). Writes are asynchronous: `put` queues the
entry and returns; writer threads write a temporary file in the same directory and
rename it into place, so a reader sees a whole file or none. Several engine processes may
share the directory: renames are atomic, every process verifies what it reads, and an
unlink never hurts a reader that already opened the file. See docs/format.md.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybridkv.core.keys import KEY_BYTES
from hybridkv.core.tiers.base import Tier, TierStats
from hybridkv.core.tiers.entry_file import (
    FILE_VERSION,
    HEADER_BYTES,
    EntryFileError,
    new_entry,
    read_entry,
    write_entry,
)

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_NAME_CHARS = 2 * (KEY_BYTES + 2)  # hex of a group key
# A temporary file this old is a leftover whatever process wrote it.
STALE_TMP_SECONDS = 3600.0
# Below this many bytes a batch of reads is done in the calling thread.
_PARALLEL_READ_BYTES = 4 << 20
# Tiers of this process still running: their temporary files are not leftovers.
_live_tokens: set[str] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: bytes,
        layout_description: dict[str, Any],
        capacity_bytes: int,
        *,
        queue_bytes: int = 256 << 20,
        writers: int = 2,
        readers: int = 4,
        fsync: bool = False,
        rescan_seconds: float = 60.0,
        alloc: Callable[[int], torch.Tensor] | None = None,
    ):
        self.dir = Path(root) / fingerprint.hex()
        self.fingerprint = fingerprint
        self.capacity = capacity_bytes
        self.queue_bytes = queue_bytes
        self.fsync = fsync
        self.rescan_seconds = rescan_seconds
        self._alloc = alloc or new_entry  # where reads land
        self._host = socket.gethostname().replace(".", "_")
        self._token = uuid.uuid4().hex[:8]
        _live_tokens.add(self._token)
        self._lock = threading.Lock()
        # key -> file bytes, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._used = 0
        # Queued entries and their file sizes, until renamed into place.
        self._pending: dict[bytes, tuple[torch.Tensor, int]] = {}
        self._pending_bytes = 0
        self._seq = itertools.count()
        self._stats = TierStats(capacity_bytes=capacity_bytes)
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._warned: set[str] = set()
        self.usable = self._prepare(layout_description)
        self.writable = self.usable and self._probe_writable()
        self.leftovers_removed = 0
        self._last_scan = 0.0
        if self.usable:
            self.rescan()
        self._threads = [
            threading.Thread(target=self._writer, name=f"hybridkv-disk-{i}", daemon=True)
            for i in range(writers if self.writable else 0)
        ]
        for t in self._threads:
            t.start()
        self._closed = False
        # Reads of one hit run in parallel: file reads and checksums release the GIL.
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="hybridkv-read")
        # Daemon writers die with the interpreter: drain the queue first.
        atexit.register(self.close)

    # ---- start ----------------------------------------------------------------------------
    def _prepare(self, layout_description: dict[str, Any]) -> bool:
        """Create the directory and its layout.json; False if neither exists nor can."""
        meta = {
            "file_version": FILE_VERSION,
            "fingerprint": self.fingerprint.hex(),
            "layout": layout_description,
        }
        path = self.dir / "layout.json"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                tmp = self.dir / self._tmp_name("layout")
                tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
                os.replace(tmp, path)
        except OSError as e:
            if not self.dir.is_dir():
                log.warning("hybridkv: disk tier off, cannot create %s: %s", self.dir, e)
                return False
        else:
            try:
                found = json.loads(path.read_text()).get("fingerprint")
            except (OSError, ValueError) as e:
                found = f"unreadable ({e})"
            if found != self.fingerprint.hex():
                log.warning("hybridkv: %s names layout %s, not this one", path, found)
        return True

    def _probe_writable(self) -> bool:
        probe = self.dir / self._tmp_name("probe")
        try:
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError as e:
            log.warning(
                "hybridkv: %s is read-only (%s): serving its entries, storing none", self.dir, e
            )
            return False

    def _tmp_name(self, stem: str) -> str:
        """Names a writer's temporary file so a later scan can tell whether it died."""
        return f".{stem}.{os.getpid()}-{self._token}.{self._host}{_TMP_SUFFIX}"

    def path_of(self, key: bytes) -> Path:
        """Where the entry named `key` lives (whether or not it exists)."""
        name = key.hex()
        return self.dir / name[:2] / (name + _SUFFIX)

    def rescan(self) -> None:
        """Rebuild the index from the directory, oldest file first, and enforce the budget.

        The directory is the truth: other processes add and evict entries, and a restart
        starts from what is on disk. Temporary files of dead writers are removed here.
        """
        found: list[tuple[int, bytes, int]] = []
        now = time.time()
        try:
            top = list(os.scandir(self.dir))
        except OSError as e:
            log.warning("hybridkv: cannot scan %s: %s", self.dir, e)
            return
        entries = [e for e in top if not e.is_dir()]
        for sub in top:
            if sub.is_dir() and len(sub.name) == 2:
                try:
                    entries.extend(os.scandir(sub.path))
                except OSError:
                    continue
        for e in entries:
            try:
                if e.name.endswith(_SUFFIX) and len(e.name) == _NAME_CHARS + len(_SUFFIX):
                    st = e.stat()
                    key = bytes.fromhex(e.name[:_NAME_CHARS])
                    found.append((st.st_mtime_ns, key, st.st_size))
                elif e.name.endswith(_TMP_SUFFIX) and self._is_leftover(e, now):
                    os.unlink(e.path)
                    self.leftovers_removed += 1
            except (OSError, ValueError):
                continue
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._used = sum(size for _, _, size in found)
            self._last_scan = time.monotonic()
            self._evict_to(self.capacity)

    def _is_leftover(self, e: os.DirEntry, now: float) -> bool:
        """A temporary file whose writer died: this host's with a dead pid, or with our own
        pid (a restarted container reuses pids) but no live tier of this process behind
        it, or any that is old."""
        parts = e.name.split(".")  # ".<stem>.<pid>-<tier token>.<host>.tmp"
        pid, _, token = parts[2].partition("-") if len(parts) == 5 else ("", "", "")
        if parts[3:4] == [self._host] and pid.isdigit():
            if int(pid) == os.getpid():
                if token not in _live_tokens:
                    return True
            elif not _pid_alive(int(pid)):
                return True
        return now - e.stat().st_mtime > STALE_TMP_SECONDS

    # ---- the tier interface -----------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index or key in self._pending:
                return True
        if not self.usable:
            return False
        try:
            size = os.stat(self.path_of(key)).st_size  # another process may have written it
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._used += size
        return True

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                self._stats.hits += 1
                return pending[0]
        if not self.usable:
            self._count_miss()
            return None
        path = self.path_of(key)
        try:
            entry = read_entry(path, self.fingerprint, key, self._alloc)
        except FileNotFoundError:
            self._forget(key)
            self._count_miss()
            return None
        except EntryFileError as e:
            self._reject(key, path, e)
            return None
        except OSError as e:
            self._warn_once(f"read:{e.errno}", "hybridkv: disk tier cannot read %s: %s", path, e)
            self._count_miss()
            return None
        with self._lock:
            self._stats.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
        with contextlib.suppress(OSError):  # recency for other processes and restarts
            os.utime(path)
        return entry

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        with self._lock:
            known = sum(self._index.get(k, 0) for k in keys)
        if known < _PARALLEL_READ_BYTES or not self.usable:
            return [self.get(k) for k in keys]  # handing out small reads costs more
        return list(self._readers.map(self.get, keys))

    def put(self, key: bytes, entry: torch.Tensor) -> bool:
        if entry.dtype != torch.int8 or entry.dim() != 1 or not entry.is_contiguous():
            raise ValueError("a disk entry is a contiguous 1-D int8 tensor")
        if not self.writable or self._closed:
            with self._lock:
                self._stats.rejected_puts += 1
            return False
        size = HEADER_BYTES + entry.numel()
        with self._lock:
            if key in self._index or key in self._pending:
                return True
            if size > self.capacity:
                self._stats.rejected_puts += 1
                return False
            if self._pending_bytes + size > self.queue_bytes:
                # Never stall the engine on the disk: the entry stays in the tiers above.
                self._stats.dropped_puts += 1
                return False
            self._pending[key] = (entry, size)
            self._pending_bytes += size
        self._queue.put(key)
        return True

    def delete(self, key: bytes) -> bool:
        with self._lock:
            pending = self._pending.pop(key, None)
            if pending is not None:
                self._pending_bytes -= pending[1]
            known = self._index.pop(key, None)
            if known is not None:
                self._used -= known
        try:
            os.unlink(self.path_of(key))
            return True
        except OSError:
            return pending is not None or known is not None

    def clear(self) -> None:
        """Remove every entry of this layout, including other processes' ones."""
        with self._lock:
            self._pending.clear()
            self._pending_bytes = 0
        if not self.usable:
            return
        self.rescan()
        with self._lock:
            keys = list(self._index)
            self._index.clear()
            self._used = 0
        for key in keys:
            self._discard(self.path_of(key))

    def flush(self) -> None:
        """Wait until every queued write is on disk (or failed)."""
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._readers.shutdown()
        _live_tokens.discard(self._token)
        atexit.unregister(self.close)

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.entries, s.bytes_used = len(self._index), self._used
            return s

    # ---- internals ---------------------------------------------------------------------------
    def _count_miss(self) -> None:
        with self._lock:
            self._stats.misses += 1

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def _reject(self, key: bytes, path: Path, err: EntryFileError) -> None:
        """A damaged or foreign file: count it, remove it, and report a miss."""
        log.warning("hybridkv: disk entry %s rejected (%s); treated as a miss", path.name, err)
        self._forget(key)
        with self._lock:
            self._stats.corrupt += 1
            self._stats.misses += 1
        self._discard(path)

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def _evict_to(self, limit: int) -> None:
        """Drop least recently used files until `limit` bytes are used. Holds the lock."""
        while self._used > limit and self._index:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self._stats.evictions += 1
            self._discard(self.path_of(key))

    def _writer(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
                if time.monotonic() - self._last_scan > self.rescan_seconds:
                    self.rescan()
            finally:
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            pending = self._pending.get(key)
        if pending is None:
            return  # deleted while queued
        entry = pending[0]
        final = self.path_of(key)
        # Unique even when a key is deleted and queued again while its first write runs.
        tmp = final.with_name(self._tmp_name(f"{final.stem}-{next(self._seq)}"))
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                size = write_entry(f, self.fingerprint, key, entry)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except Exception as e:  # a writer thread must survive anything: flush() waits on it
            what = getattr(e, "errno", None) or type(e).__name__
            self._warn_once(f"write:{what}", "hybridkv: disk tier cannot write %s: %s", tmp, e)
            self._discard(tmp)
            with self._lock:
                self._stats.write_errors += 1
                if self._pending.get(key) is pending:
                    del self._pending[key]
                    self._pending_bytes -= pending[1]
            return
        with self._lock:
            if self._pending.get(key) is not pending:
                self._discard(tmp)  # deleted or cleared meanwhile: never resurrect it
                return
            del self._pending[key]
            self._pending_bytes -= size
            self._evict_to(self.capacity - size)
            try:
                os.replace(tmp, final)
            except OSError as e:
                self._discard(tmp)
                self._stats.write_errors += 1
                self._warn_once(f"rename:{e.errno}", "hybridkv: disk tier rename failed: %s", e)
                return
            if key not in self._index:
                self._used += size
            self._index[key] = size
            self._index.move_to_end(key)
            self._stats.puts += 1

    @staticmethod
    def _discard(path: Path) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
