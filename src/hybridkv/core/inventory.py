"""What a hybridkv store holds, read without an engine: `hybridkv inspect` and `gc`.

A disk directory (`disk_path`, or one layout directory in it) or a Redis / Valkey server
(standalone or Cluster) is listed as the tiers lay it out (docs/format.md): per layout
fingerprint, its entries (key, size, last use) and what is there that no tier wrote.
Listing reads names and sizes only; `verify` reads every entry through the tiers' own
reader (`entry_file.read_entry` / `decode_entry`), so an entry the tool calls good is one
an engine would load, and a damaged one is what an engine would reject.

Nothing here writes (gc is core/trim.py), and nothing in a store is trusted: a damaged,
truncated, foreign or vanishing file or value is reported, never raised. Only a store
that cannot be read at all (no such directory, no server) raises `InventoryError`.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.core.config import mask_url
from hybridkv.core.keys import KEY_BYTES, split_group_key
from hybridkv.core.tiers.disk import (
    LAYOUT_JSON,
    entry_key,
    is_temporary,
    read_layout_json,
    scan_layout_dir,
)
from hybridkv.core.tiers.entry_file import (
    EntryFileError,
    decode_entry,
    derive_mac_key,
    read_entry,
)

_FINGERPRINT_HEX = re.compile(r"^[0-9a-f]{32}$")
# Names listed per batch of Redis commands (one round trip each).
_REDIS_BATCH = 500
# Strays kept by name (all are counted): enough to point at the problem.
STRAYS_LISTED = 20
UNKNOWN_KIND = "?"


class InventoryError(Exception):
    """The store cannot be read at all (no such directory, no server reached)."""


@dataclass
class Entry:
    """One stored entry as listed: what gc removes and verify reads."""

    key: bytes  # chunk key ‖ group id
    where: str  # its file, or its first part's Redis name
    size: int  # bytes stored: header, payload, MAC (all parts on Redis)
    used_ns: int | None  # last use: mtime on disk (a hit refreshes it), now - idle on Redis
    file_id: tuple[int, int] | None = None  # disk: (st_dev, st_ino) when listed
    parts: list[str] = field(default_factory=list)  # Redis: the names of parts 1, 2, …

    @property
    def chunk_key(self) -> bytes:
        return self.key[:KEY_BYTES]

    @property
    def group(self) -> int:
        return split_group_key(self.key)[1]


@dataclass
class Strays:
    """What lies where entries do but is none: counted, the first few named."""

    count: int = 0
    bytes: int = 0
    names: list[str] = field(default_factory=list)

    def add(self, name: str, why: str, size: int = 0) -> None:
        self.count += 1
        self.bytes += size
        if len(self.names) < STRAYS_LISTED:
            self.names.append(f"{name} ({why})")


@dataclass
class LayoutInventory:
    """One layout fingerprint's entries and what its descriptor says about them."""

    fingerprint: str  # 32 hex
    where: str  # the layout directory, or the Redis namespace
    description: dict[str, Any] | None  # layout.json's "layout" (disk only)
    note: str | None = None  # why there is no description, or what is wrong with it
    entries: list[Entry] = field(default_factory=list)
    temporary: int = 0  # writes in progress, or left by dead writers (disk)
    temporary_bytes: int = 0
    strays: Strays = field(default_factory=Strays)

    def kind_of(self, group: int) -> str:
        """The group's kind (full, sliding, state) as the descriptor records it."""
        groups = (self.description or {}).get("groups")
        if isinstance(groups, list) and 0 <= group < len(groups):
            g = groups[group]
            if isinstance(g, dict) and isinstance(g.get("kind"), str):
                return g["kind"]
        return UNKNOWN_KIND

    def summary(self) -> dict[str, Any]:
        """Counts and bytes per group and per kind, chunks and state boundaries, oldest
        and newest use: what `inspect` shows (JSON-able)."""
        per_group: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        by_chunk: dict[bytes, set[int]] = defaultdict(set)
        for e in self.entries:
            per_group[e.group][0] += 1
            per_group[e.group][1] += e.size
            by_chunk[e.chunk_key].add(e.group)
        groups = [
            {"group": g, "kind": self.kind_of(g), "entries": n, "bytes": b}
            for g, (n, b) in sorted(per_group.items())
        ]
        kinds: dict[str, dict[str, int]] = {}
        for g in groups:
            k = kinds.setdefault(g["kind"], {"entries": 0, "bytes": 0})
            k["entries"] += g["entries"]
            k["bytes"] += g["bytes"]
        used = [e.used_ns for e in self.entries if e.used_ns is not None]
        return {
            "fingerprint": self.fingerprint,
            "where": self.where,
            "layout": self.description,
            "note": self.note,
            "entries": len(self.entries),
            "bytes": sum(e.size for e in self.entries),
            "groups": groups,
            "kinds": kinds,
            "chunks": self._chunks(by_chunk),
            "oldest_use": min(used) / 1e9 if used else None,
            "newest_use": max(used) / 1e9 if used else None,
            "temporary_files": self.temporary,
            "temporary_bytes": self.temporary_bytes,
            "strays": vars(self.strays),
        }

    def _chunks(self, by_chunk: dict[bytes, set[int]]) -> dict[str, int | None]:
        """Chunk keys with entries, split by what the recurrent groups hold at their end
        boundary: all states (a restorable boundary, given its chunks), some (a state
        evicted or still being written: no hit there), none (attention only). Unknown
        (None) without a descriptor naming the kinds."""
        out: dict[str, int | None] = {"total": len(by_chunk)}
        groups = (self.description or {}).get("groups")
        if not isinstance(groups, list) or not groups:
            return out | {"with_all_states": None, "with_some_states": None, "without_states": None}
        state = {g for g in range(len(groups)) if self.kind_of(g) == "state"}
        held = Counter(len(gs & state) for gs in by_chunk.values())
        return out | {
            "with_all_states": held[len(state)] if state else 0,
            "with_some_states": sum(n for k, n in held.items() if 0 < k < len(state)),
            "without_states": held[0] if state else len(by_chunk),
        }


@dataclass
class Inventory:
    """Every layout a store holds, and what lies in it that belongs to none."""

    source: str  # "disk" or "redis"
    where: str  # the directory, or the URL without its password
    layouts: list[LayoutInventory]
    strays: Strays = field(default_factory=Strays)

    def summary(self) -> dict[str, Any]:
        layouts = [lay.summary() for lay in self.layouts]
        return {
            "source": self.source,
            "where": self.where,
            "entries": sum(lay["entries"] for lay in layouts),
            "bytes": sum(lay["bytes"] for lay in layouts),
            "layouts": layouts,
            "strays": vars(self.strays),
        }


@dataclass
class Problem:
    """An entry that failed verification: where, the reader's reason, its words."""

    where: str
    reason: str
    detail: str


@dataclass
class VerifyReport:
    """What `verify` found. `damaged`: entries no reader can use (an engine deletes them
    on sight). `not_usable_here`: entries of another file version or integrity key, which
    their writers' engines may still read. `unreadable`: read errors (EIO, …)."""

    checked: int = 0
    good: int = 0
    gone: int = 0  # removed between listing and reading (an engine evicted it)
    damaged: list[Problem] = field(default_factory=list)
    not_usable_here: list[Problem] = field(default_factory=list)
    unreadable: list[Problem] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.damaged or self.unreadable)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in ("checked", "good", "gone")}
        for k in ("damaged", "not_usable_here", "unreadable"):
            out[k] = [vars(p) for p in getattr(self, k)]
        return out


# ---- disk ---------------------------------------------------------------------------------


class DiskStore:
    """A disk tier's directory: `disk_path` with its layout directories, or one of them."""

    source = "disk"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            if not self.path.is_dir():
                raise InventoryError(f"{self.path} is no directory")
        except OSError as e:  # a parent this user may not search
            raise InventoryError(f"cannot read {self.path}: {e.strerror or e}") from None

    def _layout_dirs(self, strays: Strays) -> list[Path]:
        """The layout directories: `path` itself when it is one (a fingerprint name
        holding layout.json; `.` from inside one too), else its subdirectories named by
        a fingerprint."""
        try:
            # By the name given (a link named by a fingerprint too), else by where it
            # leads (`.` inside a layout directory).
            named = self.path if _FINGERPRINT_HEX.match(self.path.name) else self.path.resolve()
            if _FINGERPRINT_HEX.match(named.name) and (named / LAYOUT_JSON).exists():
                return [named]
        except OSError as e:
            raise InventoryError(f"cannot read {self.path}: {e.strerror or e}") from None
        dirs = []
        try:
            children = sorted(os.scandir(self.path), key=lambda e: e.name)
        except OSError as e:
            raise InventoryError(f"cannot list {self.path}: {e}") from e
        for child in children:
            if _FINGERPRINT_HEX.match(child.name) and child.is_dir(follow_symlinks=False):
                dirs.append(Path(child.path))
            else:
                strays.add(child.name, "no layout directory")
        return dirs

    def inventory(self) -> Inventory:
        strays = Strays()
        layouts = [self._layout(d) for d in self._layout_dirs(strays)]
        return Inventory(self.source, str(self.path), layouts, strays)

    def _layout(self, layout_dir: Path) -> LayoutInventory:
        description, note = _describe(layout_dir)
        lay = LayoutInventory(layout_dir.name, str(layout_dir), description, note)
        try:
            self._list(layout_dir, lay)
        except OSError as e:  # another user's layout in a shared directory, say
            lay.note = "; ".join(filter(None, (lay.note, f"cannot list: {e.strerror or e}")))
        return lay

    @staticmethod
    def _list(layout_dir: Path, lay: LayoutInventory) -> None:
        """The layout directory's entries, writes in progress and strays, into `lay`."""
        for e in scan_layout_dir(layout_dir):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since listed
            key = entry_key(e.name)
            where = os.path.relpath(e.path, layout_dir)
            if key is not None:
                if not stat.S_ISREG(st.st_mode):
                    lay.strays.add(where, "not a regular file")
                elif os.path.basename(os.path.dirname(e.path)) != e.name[:2]:
                    lay.strays.add(where, "outside its fan-out directory", st.st_size)
                else:
                    file_id = (st.st_dev, st.st_ino)
                    lay.entries.append(Entry(key, e.path, st.st_size, st.st_mtime_ns, file_id))
            elif is_temporary(e.name):
                lay.temporary += 1
                lay.temporary_bytes += st.st_size
            elif e.name != LAYOUT_JSON or os.path.dirname(e.path) != str(layout_dir):
                lay.strays.add(where, "no entry name", st.st_size)

    def check(self, layout: LayoutInventory, entry: Entry, mac_key: bytes | None) -> None:
        """Read and verify one entry as an engine would (raises EntryFileError, OSError).
        The payload size is checked against the header and the file, not the layout's:
        the chunk size that sets it is the engine's, recorded nowhere in the store. So
        the payload is never held whole: a sparse file can claim any size on no disk."""
        fingerprint = bytes.fromhex(layout.fingerprint)
        read_entry(entry.where, fingerprint, entry.key, mac_key=mac_key, keep=False)

    def close(self) -> None:
        """Nothing held."""


def _describe(layout_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """layout.json's description of the layout, and a note on what is wrong with it."""
    try:
        meta = read_layout_json(layout_dir)
    except FileNotFoundError:
        return None, f"no {LAYOUT_JSON}"
    except (OSError, ValueError, RecursionError) as e:
        return None, f"{LAYOUT_JSON} unreadable: {e}"
    if not isinstance(meta, dict) or not isinstance(meta.get("layout"), dict):
        return None, f"{LAYOUT_JSON} holds no layout description"
    note = None
    if meta.get("fingerprint") != layout_dir.name:
        note = f"{LAYOUT_JSON} names layout {meta.get('fingerprint')!r}, not its directory's"
    return meta["layout"], note


# ---- Redis --------------------------------------------------------------------------------


class RedisStore:
    """A Redis / Valkey server or Cluster holding the Redis tier's entries under
    `key_prefix` (names: `{prefix}:{fingerprint}:{{key}}`, parts `…:p{i}`). The server
    records no layout descriptions: layouts are known by fingerprint and group id."""

    source = "redis"

    def __init__(self, url: str, key_prefix: str = "hybridkv", timeout_s: float = 10.0):
        import redis
        from redis.cluster import RedisCluster

        self.where = mask_url(url)
        self.prefix = key_prefix
        self._name = re.compile(
            rf"^{re.escape(key_prefix)}:([0-9a-f]{{32}}):\{{([0-9a-f]{{{2 * KEY_BYTES + 4}}})\}}"
            r"(?::p([1-9][0-9]*))?$"
        )
        options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        try:
            client = redis.Redis.from_url(url, **options)
            cluster = str(client.info("cluster").get("cluster_enabled", 0)) == "1"
            if cluster:
                client.close()
                client = RedisCluster.from_url(url, **options)
        except (redis.RedisError, OSError, ValueError, TypeError) as e:
            # ValueError / TypeError: a URL redis-py cannot parse (a port, an option).
            raise InventoryError(f"cannot read {self.where}: {e}") from e
        self.client: Any = client
        self.cluster = cluster

    def _scan(self) -> Iterator[bytes]:
        from hybridkv.core.tiers.redis import glob_escape

        yield from self.client.scan_iter(match=glob_escape(self.prefix) + ":*", count=1000)

    def _batched(self, names: list[bytes], *commands: str) -> Iterator[tuple[bytes, list]]:
        """Each name with the replies of `commands` (each followed by the name), in
        pipelines of `_REDIS_BATCH` names; an error reply comes back in its place."""
        for i in range(0, len(names), _REDIS_BATCH):
            batch = names[i : i + _REDIS_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for name in batch:
                for command in commands:
                    pipe.execute_command(*command.split(), name)
            replies = pipe.execute(raise_on_error=False)
            for j, name in enumerate(batch):
                yield name, replies[j * len(commands) : (j + 1) * len(commands)]

    def inventory(self) -> Inventory:
        import redis

        strays = Strays()
        firsts: dict[tuple[str, str], bytes] = {}
        parts: dict[tuple[str, str], dict[int, bytes]] = defaultdict(dict)
        try:
            names = list(self._scan())
            now_ns = time.time_ns()
            sized = self._batched(names, "STRLEN", "OBJECT IDLETIME")
            info = {name: replies for name, replies in sized}
        except (redis.RedisError, OSError) as e:
            raise InventoryError(f"cannot read {self.where}: {e}") from e
        for name in names:
            text = name.decode(errors="replace")
            m = self._name.match(text)
            if m is None or not isinstance(info[name][0], int):
                strays.add(text, "no entry name" if m is None else "not a string value")
                continue
            entry = (m[1], m[2])
            if m[3] is None:
                firsts[entry] = name
            else:
                parts[entry][int(m[3])] = name
        layouts: dict[str, LayoutInventory] = {}
        for (fp, key), name in sorted(firsts.items()):
            lay = layouts.get(fp)
            if lay is None:
                lay = layouts[fp] = LayoutInventory(fp, f"{self.prefix}:{fp}:", None)
                lay.note = "Redis records no layout description"
            more = parts.pop((fp, key), {})
            idle = info[name][1]
            used = now_ns - idle * 10**9 if isinstance(idle, int) else None
            size = info[name][0] + sum(info[p][0] for p in more.values())
            rest = [more[i].decode() for i in sorted(more)]
            lay.entries.append(Entry(bytes.fromhex(key), name.decode(), size, used, parts=rest))
        for entry_parts in parts.values():  # parts whose first part is gone (evicted)
            for name in entry_parts.values():
                strays.add(name.decode(), "part of no entry", info[name][0])
        return Inventory(self.source, self.where, list(layouts.values()), strays)

    def check(self, layout: LayoutInventory, entry: Entry, mac_key: bytes | None) -> None:
        """Read and verify one entry as the Redis tier would (raises EntryFileError;
        FileNotFoundError when it is gone): all its parts in one MGET, the reassembled
        value through `decode_entry`."""
        values = self.client.execute_command("MGET", entry.where, *entry.parts)
        if values[0] is None:
            raise FileNotFoundError(entry.where)
        if None in values:
            raise EntryFileError("truncated", f"part {values.index(None)} is missing")
        decode_entry(values, bytes.fromhex(layout.fingerprint), entry.key, mac_key=mac_key)

    def close(self) -> None:
        self.client.close()


Store = DiskStore | RedisStore


def open_store(path_or_url: str, key_prefix: str = "hybridkv") -> Store:
    """The store `path_or_url` names: a `redis://` / `rediss://` / `unix://` URL, or a
    directory. Raises InventoryError when it cannot be read."""
    if re.match(r"^(rediss?|unix)://", path_or_url):
        return RedisStore(path_or_url, key_prefix)
    return DiskStore(path_or_url)


def verify(
    store: Store,
    inventory: Inventory,
    integrity_key: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Read every entry of `inventory` and check it as an engine would (header, size,
    checksum; the MAC with `integrity_key`); `progress(bytes)` after each entry.

    Entries written under an integrity key are checked only with that key: without it
    (or with another) they are `not_usable_here`, as they are for an engine so set."""
    mac_key = derive_mac_key(integrity_key) if integrity_key is not None else None
    report = VerifyReport()
    for layout in inventory.layouts:
        for entry in layout.entries:
            report.checked += 1
            try:
                store.check(layout, entry, mac_key)
                report.good += 1
            except FileNotFoundError:
                report.gone += 1
            except EntryFileError as e:
                bad = Problem(entry.where, e.reason, str(e))
                (report.damaged if e.damaged else report.not_usable_here).append(bad)
            except Exception as e:  # EIO, a dropped connection...: the entry may be good
                report.unreadable.append(Problem(entry.where, type(e).__name__, str(e)))
            if progress is not None:
                progress(entry.size)
    return report
