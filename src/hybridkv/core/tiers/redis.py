"""Redis / Valkey tier: entries shared by every engine replica that reaches one server or
one Redis Cluster, through redis-py.

Names: an entry lives under `{prefix}:{layout fingerprint hex}:{{key hex}}`, its value the
bytes of a disk entry file (entry_file.py: self-describing header, checksum, and under an
integrity key a MAC), so every reader checks what it loads. A value longer than
`max_entry_bytes` is cut into parts of that size: the first under the name above, part i
under `…:p{i}`. The braces are a Redis Cluster hash tag: all parts of an entry share one
slot, so one MGET reads them all at one instant. Writes set the first part last, so no
reader finds an entry before all its parts are there; on a standalone server each batch
of writes is also one MULTI/EXEC, so no reader ever sees parts of two writes. On a
cluster (a transaction spans one slot, and redis-py before 6 has none there) a reader of
an entry being rewritten may: the checksum over the reassembled entry makes a mix of two
different writes a counted miss. Standalone servers use the same names. The first part's
header says how many bytes the entry has, so a reader finds every part without an index.

Round trips: `get_many` is one pipeline of one MGET per entry, of the parts this process's
layout predicts (`entry_bytes` and `max_entry_bytes`); only an entry cut into smaller
parts than predicted costs a second one, for the parts still missing. `contains_many` is
one pipeline of EXISTS. `put` queues the entry (bounded in bytes: a full queue drops the
put, counted) and returns; a writer thread writes what has queued up as one pipeline of
`SET … EX ttl_s` (a MULTI/EXEC on a standalone server). `delete` returns at once too: the
writer UNLINKs the entry's parts in queue order (a put after the delete ends stored), and
reads miss it meanwhile. No call of the engine's (its model runner calls `put` and
`delete`, and `clear` at a reset) ever waits on the network but reads.

Replicas share the entries, so this tier never removes another replica's: `clear` (vLLM's
`reset_prefix_cache`) drops this process's queued writes and forgets what it stored, and
leaves every entry in Redis. An entry's name says exactly what it was computed from (the
tokens, cache salt, layout and model identity in its key and fingerprint), so a reset
makes none of them wrong for anyone, and deleting them would cost every other replica
its hits; Redis evicts them (`maxmemory-policy`, `ttl_s`). After weights change in place
without a new model identity, use another `key_prefix`.

Redis does the eviction, not this tier: give the server a bound and a policy that evicts,
e.g. `maxmemory 64gb` and `maxmemory-policy allkeys-lru` (`volatile-lru` works with
`ttl_s`). Under `noeviction`, Redis's default, a full server refuses every write with an
OOM error; the tier warns about it at start. An entry that lost a part to eviction is a
miss (and removed); the tier's `capacity_bytes` is the server's `maxmemory` (0: none or
unknown), shared with whatever else the server holds.

Faults: a server unreachable (at start or later), restarted, slower than `timeout_ms`, or
refusing writes (OOM) marks the tier down. While down every call answers a miss or False
at once, without the network, and stores are dropped (counted); a background probe PINGs
with exponential backoff (`backoff_s` doubling to `backoff_max_s`, starting over once the
tier has stayed up four times its last delay: tiers/backoff.py) and brings it back up.
No method raises (tiers/queued.py): faults are logged (once per kind) and counted in
TierStats (`errors`; `write_errors` for puts a failed write lost). A value that is not a
usable entry is a counted miss (`corrupt`), deleted only when no reader of any key or
version can use it (entry_file's `damaged`); the delete may remove an entry another
writer stored between the read and the delete: a later miss, never wrong data.

Statistics: `entries` and `bytes_used` count what this process stored (at most the
latest 2**18 entries) and has seen no sign of losing: not deleted, cleared, read as
missing, or lost in a server restart (its run id changed). Other replicas' entries and
Redis's own evictions are not in them.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from hybridkv.core.background import lower_priority
from hybridkv.core.config import mask_url
from hybridkv.core.linked_keys import LruMap
from hybridkv.core.tiers.backoff import Backoff
from hybridkv.core.tiers.base import TierStats
from hybridkv.core.tiers.entry_file import (
    HEADER_BYTES,
    EntryFileError,
    claimed_bytes,
    decode_entry,
    encode_entry,
    file_bytes,
)
from hybridkv.core.tiers.queued import QueuedTier, never_raises

log = logging.getLogger(__name__)

# The first part must hold a whole header; more parts than this is no entry of ours.
MIN_PART_BYTES = 4096
MAX_PARTS = 4096
# One write pipeline carries up to this much.
_WRITE_BATCH_BYTES = 64 << 20
# Entries this process stored that `stats` counts (the most recent ones).
_STORED_LIMIT = 1 << 18
# Errors that say the server (or the way to it) is unusable, not one value.
_SERVER_FAULTS = (redis.RedisError, RedisClusterException, OSError)


def glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class _Delete:
    """A delete of `key`'s entry, queued for the writer."""

    key: bytes


class RedisTier(QueuedTier):
    name = "redis"
    _label = "Redis"
    _log = log

    def __init__(
        self,
        url: str,
        fingerprint: bytes,
        *,
        cluster: bool = False,
        ttl_s: int | None = None,
        key_prefix: str = "hybridkv",
        timeout_ms: int = 1000,
        max_entry_bytes: int = 8 << 20,
        entry_bytes: Sequence[int] | None = None,
        integrity_key: str | None = None,
        queue_bytes: int = 256 << 20,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        alloc: Callable[[int], torch.Tensor] | None = None,
    ):
        """`url`: `redis://host:port/db` or `rediss://…` (on a cluster, any node).
        `fingerprint`: the 16-byte layout fingerprint, in every name and header.
        `ttl_s`: expiry of every value written (None: none; Redis evicts). `timeout_ms`:
        the longest any socket connect or read may wait. `entry_bytes`: payload bytes of
        an entry of each group, by group id; a value claiming another size is rejected
        before anything is allocated. `integrity_key`: read and write only entries MACed
        under this secret. `alloc`: where reads land (nbytes -> int8 tensor).

        Connects (at most `timeout_ms`) to read the server's eviction policy; a server
        that does not answer leaves the tier down, retried in the background."""
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("a Redis key prefix must not hold braces (the hash tag is ours)")
        if max_entry_bytes < MIN_PART_BYTES:
            raise ValueError(f"max_entry_bytes must be at least {MIN_PART_BYTES}")
        if ttl_s is not None and ttl_s < 1:
            raise ValueError("ttl_s must be at least 1 second (None: no expiry)")
        super().__init__(fingerprint, entry_bytes, integrity_key, queue_bytes, alloc)
        self._url = url
        self.where = mask_url(url)  # for logs
        self.cluster = cluster
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes
        self.timeout_s = timeout_ms / 1000
        self._namespace = f"{key_prefix}:{fingerprint.hex()}:"
        self._backoff = Backoff(backoff_s, backoff_max_s)
        self._client: redis.Redis | RedisCluster | None = None
        self._wake = threading.Condition(self._lock)  # the probe waits on it
        self._stored = LruMap()
        self._stored_bytes = 0
        # The write queue (self._queue) takes keys (to write), `_Delete`s and lists of
        # names (to unlink), in order. Deletes queued, by key, until done: reads miss them.
        self._deleting: Counter[bytes] = Counter()
        self._run_ids: tuple[str, ...] | None = None
        self._up = False
        self._up_since = 0.0
        self._next_probe = 0.0
        self._connect()
        self._writer = threading.Thread(target=self._write_loop, name="hybridkv-redis-writer")
        self._prober = threading.Thread(target=self._probe_loop, name="hybridkv-redis-probe")
        for t in (self._writer, self._prober):
            t.daemon = True
            t.start()
        atexit.register(self.close)  # daemon threads die with the interpreter

    @property
    def up(self) -> bool:
        """Whether calls reach the server; False from a fault until a probe succeeds."""
        return self._up

    # ---- names --------------------------------------------------------------------------------
    def names(self, key: bytes, parts: int = 1) -> list[str]:
        """The names of an entry's first `parts` parts."""
        base = f"{self._namespace}{{{key.hex()}}}"
        return [base] + [f"{base}:p{i}" for i in range(1, parts)]

    def _predicted_parts(self, key: bytes) -> int:
        """How many parts an entry of `key` has when written by a tier set up like this."""
        n = self._payload_bytes(key)
        if n is None:
            return 1
        return -(-file_bytes(n, self._mac_key is not None) // self.max_entry_bytes)

    # ---- the tier interface -------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    @never_raises(lambda self, keys: [False] * len(keys))
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has an entry (its first part), in one round trip."""
        with self._lock:
            out = [k in self._pending for k in keys]
            todo = [i for i, held in enumerate(out) if not held and keys[i] not in self._deleting]
        if not todo or not self._up:
            return out
        pipe = self._pipeline()
        for i in todo:
            pipe.exists(self.names(keys[i])[0])
        for i, found in zip(todo, self._execute(pipe), strict=True):
            if isinstance(found, Exception):
                raise found
            out[i] = bool(found)
            if not found:
                with self._lock:
                    self._forget(keys[i])
        return out

    def get(self, key: bytes) -> torch.Tensor | None:
        return self.get_many([key])[0]

    @never_raises(lambda self, keys: self._misses(len(keys)))
    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        out = self._queued_hits(keys)
        with self._lock:  # an entry being deleted is a miss
            todo = [i for i, e in enumerate(out) if e is None and keys[i] not in self._deleting]
        missed = sum(e is None for e in out) - len(todo)
        if not self._up:
            missed, todo = missed + len(todo), []
        if missed:
            self._misses(missed)
        if not todo:
            return out
        pipe = self._pipeline()
        for i in todo:
            pipe.execute_command("MGET", *self.names(keys[i], self._predicted_parts(keys[i])))
        values = dict(zip(todo, self._execute(pipe), strict=True))
        self._fetch_missing_parts(keys, values)
        for i in todo:
            out[i] = self._decode(keys[i], values[i])
        return out

    @never_raises(lambda self, key, entry: False)
    def put(self, key: bytes, entry: torch.Tensor) -> bool:
        size = self._file_bytes(key, entry)
        with self._lock:
            if key in self._pending:
                return True
            if -(-size // self.max_entry_bytes) > MAX_PARTS or size > self.queue_bytes:
                self._stats.rejected_puts += 1
                return False
            if not self._up or self._closed:  # down or closing: dropped, as when full
                self._stats.dropped_puts += 1
                return False
            return self._enqueue(key, entry, size)

    def _remove(self, key: bytes) -> bool:
        """The writer UNLINKs every part (as many as the first one's header counts), in
        queue order; while down nothing is removed (Redis evicts the entry in time)."""
        if not self._up or self._closed:
            return False
        self._deleting[key] += 1
        self._queue.put(_Delete(key))
        return True

    @never_raises()
    def clear(self) -> None:
        """Drop queued writes and forget what this process stored; the entries in Redis
        stay: every replica shares them (see the module docstring)."""
        with self._lock:
            self._cancel_all()
            self._forget_all()

    @never_raises()
    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._stop_writers([self._writer])
        self._prober.join()
        if self._client is not None:
            self._client.close()
        atexit.unregister(self.close)

    @never_raises(lambda self: TierStats())
    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.entries, s.bytes_used = len(self._stored), self._stored_bytes
            return s

    # ---- reads --------------------------------------------------------------------------------
    def _pipeline(self) -> Any:
        assert self._client is not None
        return self._client.pipeline(transaction=False)

    def _execute(self, pipe: Any) -> list[Any]:
        """Run a pipeline; an error reply of a command comes back in its place (a foreign
        value's WRONGTYPE, say), any other fault raises."""
        return pipe.execute(raise_on_error=False)

    def _fetch_missing_parts(self, keys: Sequence[bytes], values: dict[int, Any]) -> None:
        """Second round trip, only for entries cut into more parts than predicted: the
        parts not yet fetched, as the first part's length and header count them."""
        more: list[tuple[int, int]] = []
        for i, parts in values.items():
            if isinstance(parts, list) and parts[0] is not None:
                n = self._parts_of(keys[i], parts[0][:HEADER_BYTES], len(parts[0]))
                if n > len(parts):
                    more.append((i, n))
                else:
                    del parts[n:]  # predicted more than written: never mix in strays
        if not more:
            return
        pipe = self._pipeline()
        for i, n in more:
            pipe.execute_command("MGET", *self.names(keys[i], n)[len(values[i]) :])
        for (i, _), rest in zip(more, self._execute(pipe), strict=True):
            if isinstance(rest, Exception):
                values[i] = rest
            else:
                values[i].extend(rest)

    def _parts_of(self, key: bytes, head: bytes, length: int) -> int:
        """How many parts `key`'s entry has whose first part is `length` bytes and begins
        with `head` (1 for anything that is no split entry of ours, or claims another
        size than the layout gives it: a forged header would have every replica fetch
        thousands of parts on its word)."""
        total = claimed_bytes(head)
        if total is None or total <= length or length < MIN_PART_BYTES:
            return 1
        if total != self._counted_bytes(key, total):
            return 1
        n = -(-total // length)
        return n if n <= MAX_PARTS else 1

    def _decode(self, key: bytes, parts: Any) -> torch.Tensor | None:
        """The entry in `parts` (a reply of MGET: None for a name without a value, or
        with a value of another type than string), or None: a counted miss."""
        if isinstance(parts, Exception):
            raise parts
        if parts[0] is None:
            with self._lock:
                self._forget(key)
            self._misses(1)
            return None
        try:
            missing = parts.index(None)
        except ValueError:
            pass
        else:
            error = EntryFileError("truncated", f"part {missing} of {len(parts)} is missing")
            self._reject(key, error, len(parts))
            return None
        try:
            entry = decode_entry(parts, self.fingerprint, key, **self._read_checks(key))
        except EntryFileError as e:
            self._reject(key, e, len(parts))
            return None
        with self._lock:
            self._stats.hits += 1
        return entry

    def _reject(self, key: bytes, err: EntryFileError, parts: int) -> None:
        """An unusable value: a counted miss, deleted (in the background) only when no
        reader can use it; another version's or another key's stays."""
        self._count_rejected(key, self.names(key)[0], err)
        if err.damaged:
            self._queue.put(self.names(key, max(parts, self._parts_hint(key))))

    def _parts_hint(self, key: bytes) -> int:
        return self._predicted_parts(key) if self._entry_bytes is not None else 1

    def _forget(self, key: bytes) -> bool:
        size = self._stored.pop(key, None)
        if size is not None:
            self._stored_bytes -= size
        return size is not None

    def _remember(self, key: bytes, size: int) -> None:
        """Count an entry written (the most recent `_STORED_LIMIT`). Holds the lock."""
        self._stored_bytes += size - self._stored.pop(key, 0)
        self._stored[key] = size
        if len(self._stored) > _STORED_LIMIT:
            self._stored_bytes -= self._stored.popitem(last=False)[1]

    def _forget_all(self) -> None:
        """Holds the lock."""
        self._stored.clear()
        self._stored_bytes = 0

    # ---- writes -------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        lower_priority()
        while True:
            item = self._queue.get()
            batch = [item]
            size = 0
            try:
                while item is not None and size < _WRITE_BATCH_BYTES:
                    if isinstance(item, bytes):
                        size += self._pending.get(item, (None, 0))[1]
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    batch.append(item)
                self._write([i for i in batch if i is not None])
            except Exception as e:  # the writer must survive anything: flush() waits on it
                self._fault("writer", e)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if batch[-1] is None:
                return

    def _write(self, items: list[Any]) -> None:
        """Do what queued, in queue order, in one pipeline: write entries (keys), delete
        entries (`_Delete`: every part the first one's header counts, read in one round
        trip before) and unlink damaged values (lists of names). A write with a delete
        of its key queued after it is skipped: the delete would drop it, and a put made
        after the delete has its own, later place in the queue."""
        deletes = [i.key for i in items if isinstance(i, _Delete)]
        try:
            with self._lock:
                keys = {i for i in items if isinstance(i, bytes)} | set(deletes)
                later = Counter({k: self._deleting[k] for k in keys if k in self._deleting})
                plan: list[Any] = []
                for item in items:
                    if isinstance(item, bytes):
                        pending = self._pending.get(item)
                        if pending is not None and later[item] <= 0:
                            plan.append((item, pending))
                        continue
                    if isinstance(item, _Delete):
                        later[item.key] -= 1
                    plan.append(item)
                writes = [op for op in plan if isinstance(op, tuple)]
                if not self._up or self._client is None:  # went down: drop what queued
                    for k, p in writes:
                        self._unqueue(k, p)
                    self._stats.dropped_puts += len(writes)
                    return
            if plan:
                self._execute_plan(plan, writes, deletes)
        finally:
            with self._lock:
                self._deleting.subtract(deletes)
                for k in deletes:
                    if self._deleting[k] <= 0:
                        del self._deleting[k]

    def _count_parts(self, keys: list[bytes]) -> dict[bytes, int]:
        """How many parts each key's entry has, as its first part says (one round trip)."""
        if not keys:
            return {}
        pipe = self._pipeline()
        for key in keys:
            first = self.names(key)[0]
            pipe.strlen(first)
            pipe.getrange(first, 0, HEADER_BYTES - 1)
        replies = self._execute(pipe)
        counted = {}
        for key, length, head in zip(keys, replies[::2], replies[1::2], strict=True):
            whole = isinstance(length, int) and isinstance(head, bytes)
            parts = self._parts_of(key, head, length) if whole else 1
            counted[key] = max(parts, self._parts_hint(key))
        return counted

    def _execute_plan(
        self, plan: list[Any], writes: list[tuple[bytes, Any]], deletes: list[bytes]
    ) -> None:
        """Run `_write`'s plan as one pipeline (a MULTI/EXEC on a standalone server),
        after the round trip that counts the parts of the entries it deletes."""
        try:
            parts = self._count_parts(deletes)
            assert self._client is not None
            pipe = self._client.pipeline(transaction=not self.cluster)
            for op in plan:
                if isinstance(op, tuple):
                    self._set(pipe, op[0], self._encode(op[0], op[1][0]))
                elif isinstance(op, _Delete):
                    pipe.execute_command("UNLINK", *self.names(op.key, parts[op.key]))  # one slot
                else:
                    pipe.execute_command("UNLINK", *op)  # one slot
            pipe.execute()
        except Exception as e:
            self._fault("write", e)
            with self._lock:
                for k, p in writes:
                    if self._unqueue(k, p):
                        self._stats.write_errors += 1
            return
        with self._lock:
            for k, p in writes:
                if self._unqueue(k, p):
                    self._stats.puts += 1
                    self._remember(k, p[1])

    def _encode(self, key: bytes, entry: torch.Tensor) -> list[bytes | memoryview]:
        """The entry file's bytes, cut into parts of `max_entry_bytes` (views, no copy)."""
        value = b"".join(encode_entry(self.fingerprint, key, entry, self._mac_key))
        if len(value) <= self.max_entry_bytes:
            return [value]
        view, step = memoryview(value), self.max_entry_bytes
        return [view[i : i + step] for i in range(0, len(value), step)]

    def _set(self, pipe: Any, key: bytes, parts: list[bytes | memoryview]) -> None:
        """SET the parts, the first one last: it makes the entry visible. One connection
        (one slot) applies them in order."""
        names = self.names(key, len(parts))
        for name, part in zip(names[1:] + names[:1], parts[1:] + parts[:1], strict=True):
            pipe.set(name, part, ex=self.ttl_s)

    # ---- up and down --------------------------------------------------------------------------
    def _make_client(self) -> redis.Redis | RedisCluster:
        options: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 0),  # the tier retries, in the background
        }
        if self.cluster:
            if int(redis.__version__.split(".")[0]) < 6:  # retries of its own before 6
                options["cluster_error_retry_attempts"] = 0
            return RedisCluster.from_url(self._url, **options)  # asks a node for the slots
        return redis.Redis.from_url(self._url, **options)

    def _connect(self) -> bool:
        """PING (making the client first if need be) and read the server's settings; up
        on success, down with the next backoff on failure."""
        try:
            if self._client is None:
                self._client = self._make_client()
            self._client.ping()
            self._read_server_settings()
        except Exception as e:
            self._down("connect", e, probe=True)
            return False
        with self._lock:
            was_down = self._up_since > 0
            self._up, self._up_since = True, time.monotonic()
        if was_down:
            self._log_change("up", "hybridkv: Redis tier at %s up again", self.where)
        return True

    @staticmethod
    def _per_node(reply: dict[str, Any]) -> list[dict[str, Any]]:
        """A reply of several cluster nodes ({node: reply}) or of one server, as a list."""
        if reply and all(isinstance(v, dict) for v in reply.values()):
            return list(reply.values())
        return [reply]

    def _read_server_settings(self) -> None:
        """The eviction policy (warned about if it never evicts), `maxmemory`, and the
        run id (a new one: the server restarted and lost what this process stored).
        Servers that refuse CONFIG or INFO (managed services) are fine."""
        assert self._client is not None
        nodes = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}
        try:
            settings = self._per_node(self._client.config_get("maxmemory*", **nodes))
        except redis.ResponseError as e:
            self._warn_once("config", "hybridkv: cannot read the Redis eviction policy: %s", e)
        else:
            if any(s.get("maxmemory-policy") == "noeviction" for s in settings):
                self._warn_once(
                    "noeviction",
                    "hybridkv: Redis at %s has maxmemory-policy noeviction: once full it "
                    "refuses every store; set maxmemory and maxmemory-policy allkeys-lru",
                    self.where,
                )
            with self._lock:
                self._stats.capacity_bytes = sum(int(s.get("maxmemory", 0)) for s in settings)
        try:
            info = self._per_node(self._client.info("server", **nodes))
        except redis.ResponseError:
            return
        run_ids = tuple(sorted(str(i.get("run_id")) for i in info))
        with self._lock:
            if self._run_ids is not None and run_ids != self._run_ids:
                self._forget_all()
            self._run_ids = run_ids

    def _probe_loop(self) -> None:
        lower_priority()
        while True:
            with self._lock:
                while not self._closed and (self._up or time.monotonic() < self._next_probe):
                    self._wake.wait(None if self._up else self._next_probe - time.monotonic())
                if self._closed:
                    return
            self._connect()

    def _down(self, what: str, err: Exception, probe: bool = False) -> None:
        """Mark the tier down and schedule the next probe (tiers/backoff.py: the delay
        doubles with every failed probe or early fall, and starts over once the tier has
        served long enough). A call's fault is counted; a probe's is not (no call met it)."""
        with self._lock:
            now = time.monotonic()
            was_up, at_start = self._up, self._next_probe == 0.0
            if not probe:
                self._stats.errors += 1
                if not was_up:
                    return  # a call under way when the tier went down: already scheduled
            delay = self._backoff.delay(now - self._up_since if was_up else None)
            self._up = False
            self._next_probe = now + delay
            self._wake.notify_all()
        if was_up or at_start:
            self._log_change(
                f"down:{type(err).__name__}",
                "hybridkv: Redis tier at %s down: %s failed (%s: %s); retrying in %.1f s",
                self.where,
                what,
                type(err).__name__,
                err,
                delay,
            )

    def _fault(self, what: str, err: Exception) -> None:
        """A fault met by a call (counted): a server fault takes the tier down."""
        if isinstance(err, _SERVER_FAULTS):
            self._down(what, err)
        else:
            super()._fault(what, err)

    def _log_change(self, what: str, msg: str, *args: Any) -> None:
        """Going down or up: a warning the first time for each kind, then info (a
        flapping or full server would fill the log)."""
        if what in self._warned:
            log.info(msg, *args)
        else:
            self._warn_once(what, msg, *args)
