"""QueuedTier: what the tiers behind CPU memory (disk, Redis) share, written once.

Both stand on the engine's path (its scheduler and worker call them) in front of storage
that may be slow, full, shared or broken, so both keep the same promises, and one copy of
the code keeps them from drifting apart:

- No method raises: `never_raises` turns a fault into a miss or False, counted (`errors`)
  and logged once per kind.
- No store waits on the storage: `put` hands the entry to a write queue bounded in bytes
  (`queue_bytes`, `_enqueue`); a full queue drops the put (`dropped_puts`), the entry
  staying in the tiers above. Writer threads take the queue in order; until an entry is
  written, reads answer from the queue (a tier reads its own writes), and a delete or
  clear takes it off.
- No delete or clear waits on the storage either: `delete` forgets the entry and queues
  its removal for the writer threads, reads missing it meanwhile; a put of it after the
  delete ends stored (each tier keeps that order, `_remove`). The engine calls both from
  its model runner's thread.
- Entries are entry files (entry_file.py): `put` accepts only what a file can hold, and
  a read is checked against the payload size the layout gives the key's group, under the
  tier's integrity key.

The queue's state (`_pending`, `_pending_bytes`) is under the tier's `_lock`, with the
rest of the tier's state: a tier moves an entry from the queue to where it is stored
under one hold of the lock, so no reader misses it in between.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from hybridkv.core.keys import split_group_key
from hybridkv.core.tiers.base import Tier, TierStats
from hybridkv.core.tiers.entry_file import EntryFileError, derive_mac_key, file_bytes, new_entry

_Method = TypeVar("_Method", bound=Callable[..., Any])


def never_raises(fallback: Callable[..., Any] = lambda *_: None) -> Callable[[_Method], _Method]:
    """A public method of a QueuedTier that answers `fallback(self, *args)` instead of
    raising: the fault goes to `_fault` (counted, logged once per kind)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def guarded(self: QueuedTier, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as e:
                self._fault(method.__name__, e)
                return fallback(self, *args, **kwargs)

        return cast(_Method, guarded)

    return wrap


class QueuedTier(Tier):
    """A tier that stores entry files through a bounded write queue and never raises."""

    # How logs and errors name the tier ("disk", "Redis"), and the logger they go to.
    _label: str
    _log: logging.Logger

    def __init__(
        self,
        fingerprint: bytes,
        entry_bytes: Sequence[int] | None,
        integrity_key: str | None,
        queue_bytes: int,
        alloc: Callable[[int], torch.Tensor] | None,
        capacity_bytes: int = 0,
    ):
        """Arguments as those of the same names of DiskTier and RedisTier."""
        self.fingerprint = fingerprint
        self.queue_bytes = queue_bytes
        self._entry_bytes = entry_bytes
        self._mac_key = derive_mac_key(integrity_key) if integrity_key is not None else None
        self._alloc = alloc or new_entry  # where reads land
        self._lock = threading.Lock()
        self._stats = TierStats(capacity_bytes=capacity_bytes)
        # Queued entries and their file sizes, until written (or failed, deleted, cleared).
        self._pending: dict[bytes, tuple[torch.Tensor, int]] = {}
        self._pending_bytes = 0
        # What the writer threads take, in order (queued keys, and what a tier adds);
        # None stops one.
        self._queue: queue.Queue[Any] = queue.Queue()
        self._warned: set[str] = set()
        self._closed = False

    # ---- entries ------------------------------------------------------------------------------
    def _file_bytes(self, key: bytes, entry: torch.Tensor) -> int:
        """The size of the file `put` would store; raises ValueError for an entry or key
        no entry file can hold."""
        if entry.dtype != torch.int8 or entry.dim() != 1 or not entry.is_contiguous():
            raise ValueError(f"a {self._label} entry is a contiguous 1-D int8 tensor")
        split_group_key(key)  # a malformed key fails here, not in a writer
        return file_bytes(entry.numel(), self._mac_key is not None)

    def _payload_bytes(self, key: bytes) -> int | None:
        """What an entry of `key`'s group holds, if the layout's sizes were given."""
        if self._entry_bytes is None:
            return None
        return self._entry_bytes[split_group_key(key)[1]]

    def _counted_bytes(self, key: bytes, size: int) -> int:
        """What a file of `size` bytes found under `key`'s name counts against the
        budget: the size the layout gives its entry, where the tier knows it. A file of
        another size is damaged or foreign and fails its first read; a sparse one can
        claim a terabyte on no disk, and counting that would evict every other entry."""
        try:
            payload = self._payload_bytes(key)
        except (IndexError, ValueError):  # a group this layout does not have: never read
            return 0
        return size if payload is None else file_bytes(payload, self._mac_key is not None)

    def _read_checks(self, key: bytes) -> dict[str, Any]:
        """The keywords of `read_entry` / `decode_entry` for `key`'s entry."""
        return {
            "payload_bytes": self._payload_bytes(key),
            "alloc": self._alloc,
            "mac_key": self._mac_key,
        }

    # ---- the write queue ----------------------------------------------------------------------
    def _enqueue(self, key: bytes, entry: torch.Tensor, size: int) -> bool:
        """Queue an entry for the writers; False when the queue is full: a counted drop,
        never a stall (the entry stays in the tiers above). Holds the lock."""
        if self._pending_bytes + size > self.queue_bytes:
            self._stats.dropped_puts += 1
            return False
        self._pending[key] = (entry, size)
        self._pending_bytes += size
        self._queue.put(key)
        return True

    def _queued_hits(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each key's entry while it waits in the queue (a counted hit), else None."""
        with self._lock:
            out: list[torch.Tensor | None] = []
            for key in keys:
                pending = self._pending.get(key)
                if pending is not None:
                    self._stats.hits += 1
                out.append(None if pending is None else pending[0])
            return out

    def _unqueue(self, key: bytes, pending: tuple[torch.Tensor, int]) -> bool:
        """Take a written (or failed) entry off the queue; False if it was deleted or
        cleared meanwhile. Holds the lock."""
        if self._pending.get(key) is not pending:
            return False
        del self._pending[key]
        self._pending_bytes -= pending[1]
        return True

    def _cancel(self, key: bytes) -> bool:
        """Take `key`'s entry off the queue before it is written; whether it was queued.
        Holds the lock."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._pending_bytes -= pending[1]
        return pending is not None

    def _cancel_all(self) -> None:
        """Take every entry off the queue. Holds the lock."""
        self._pending.clear()
        self._pending_bytes = 0

    @never_raises()
    def flush(self) -> None:
        """Wait until every queued write is done (written, failed or dropped)."""
        self._queue.join()

    def _stop_writers(self, writers: Sequence[threading.Thread]) -> None:
        """Stop the writer threads once they have taken what is queued, and wait for them."""
        for _ in writers:
            self._queue.put(None)
        for t in writers:
            t.join()

    @never_raises(lambda self, key: False)
    def delete(self, key: bytes) -> bool:
        """Take the entry off the queue, forget it and queue its removal (`_remove`): the
        caller never waits on the storage. Reads miss it from now on; a put of it after
        this ends stored. Whether this tier held it (queued, or stored as far as it
        knows and now being removed)."""
        with self._lock:
            queued = self._cancel(key)
            return self._remove(key) and self._forget(key) or queued

    @abstractmethod
    def _remove(self, key: bytes) -> bool:
        """Queue the removal of `key`'s stored entry for a writer thread, ordered before
        any later put of it, reads missing it meanwhile; False if nothing can be removed
        now (the entry stays). Holds the lock."""

    # ---- misses and faults --------------------------------------------------------------------
    @abstractmethod
    def _forget(self, key: bytes) -> bool:
        """Stop counting `key` as stored (found missing or unusable, or deleted); whether
        it was. Holds the lock."""

    def _misses(self, n: int) -> list[torch.Tensor | None]:
        """Count `n` misses; their answers."""
        with self._lock:
            self._stats.misses += n
        return [None] * n

    def _count_rejected(self, key: bytes, name: str, err: EntryFileError) -> None:
        """An unusable entry read (named `name` in the log): a counted miss, the tier's
        to remove only if `err.damaged`."""
        self._warn_once(
            f"reject:{err.reason}",
            "hybridkv: %s entry %s rejected (%s); treated as a miss%s",
            self._label,
            name,
            err,
            " and removed" if err.damaged else ", left for the writer's readers",
        )
        with self._lock:
            self._forget(key)
            self._stats.corrupt += 1
            self._stats.misses += 1

    def _fault(self, what: str, err: Exception) -> None:
        """A fault met by a call (`what`): counted, and logged once per kind."""
        with self._lock:
            self._stats.errors += 1
        kind = f"{what}:{type(err).__name__}:{getattr(err, 'errno', '')}"
        self._warn_once(
            kind, "hybridkv: %s tier %s failed (%r); answered a miss", self._label, what, err
        )

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self._log.warning(msg, *args)
