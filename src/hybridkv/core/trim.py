"""Trimming a disk directory that engines may be using: `hybridkv gc`.

What goes together: a *unit*, every entry of one chunk key in one layout — the chunk's
attention KV (full and sliding-window groups) and the recurrent states at its end
boundary. A hit at a boundary needs all of them, so a state is never left behind without
its chunk's attention KV, nor the reverse. What the files cannot show is which chunks
*precede* a boundary: chunk keys are a one-way hash chain over the tokens, so gc cannot
keep a boundary's earlier chunks with it. Removing an earlier chunk makes the later
boundaries of that prompt misses (recomputed and stored again), never wrong answers.

Order (`--max-bytes`): least recently used unit first, a unit's last use being its
newest file's modification time. That is the engines' own order: their budget evicts
by modification time, a hit refreshes the time of every file it reads, and a prompt's
chunks are written in order, so the earlier chunks a later boundary needs are used at
least as recently as one another and are removed after the chunks nothing reads.

Why this is safe while engines run (docs/format.md, "Index, budget and sharing"):
every read is verified and an unlink never disturbs a reader that already opened the
file; a file removed under an engine is a counted miss (`DiskTier.get`, FileNotFoundError)
and the engine recomputes; engines rescan within a minute and drop what is gone from
their index. A file is removed only while its name still holds the file listed (same
device and inode): an entry an engine rewrote meanwhile is fresh, and stays. Until an
engine rescans, its index still counts the bytes removed, so its own budget may evict a
little early; nothing worse.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hybridkv.core.inventory import Entry, Inventory, LayoutInventory
from hybridkv.core.tiers.disk import (
    LAYOUT_JSON,
    STALE_TMP_SECONDS,
    discard,
    is_temporary,
    scan_layout_dir,
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as `90s`, `30m`, `12h`, `7d`, `2w`; ValueError otherwise."""
    m = _DURATION.match(text)
    seconds = float(m[1]) * _SECONDS[m[2]] if m is not None else math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"expected a duration like 30m, 12h or 7d, got {text!r}")
    return seconds


def find_layout(inventory: Inventory, ident: str) -> LayoutInventory:
    """The layout whose fingerprint is `ident` or starts with it (at least 4 hex
    digits); ValueError when none or several match."""
    ident = ident.strip().lower()
    if len(ident) < 4:
        raise ValueError(f"layout {ident!r}: give at least 4 hex digits of the fingerprint")
    found = [lay for lay in inventory.layouts if lay.fingerprint.startswith(ident)]
    if len(found) != 1:
        known = ", ".join(lay.fingerprint for lay in inventory.layouts) or "none"
        what = "no layout" if not found else "several layouts"
        raise ValueError(f"{what} matching {ident!r} (layouts: {known})")
    return found[0]


@dataclass
class Unit:
    """Every entry of one chunk key in one layout: removed together."""

    layout: LayoutInventory
    chunk_key: bytes
    entries: list[Entry]

    @property
    def used_ns(self) -> int:
        return max(e.used_ns or 0 for e in self.entries)

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries)


def units(layouts: Iterable[LayoutInventory]) -> list[Unit]:
    """The units of `layouts`, least recently used first (ties in a fixed order)."""
    out = []
    for lay in layouts:
        by_chunk: dict[bytes, list[Entry]] = {}
        for e in lay.entries:
            by_chunk.setdefault(e.chunk_key, []).append(e)
        out.extend(Unit(lay, k, es) for k, es in by_chunk.items())
    out.sort(key=lambda u: (u.used_ns, u.layout.fingerprint, u.chunk_key))
    return out


@dataclass
class Plan:
    """What gc removes: whole layouts (`--layout`), then units."""

    layouts: list[LayoutInventory] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    total_bytes: int = 0  # entry bytes before

    def entries(self) -> list[Entry]:
        out = [e for lay in self.layouts for e in lay.entries]
        return out + [e for u in self.units for e in u.entries]

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries())


def plan(
    inventory: Inventory,
    *,
    max_bytes: int | None = None,
    older_than_s: float | None = None,
    layout: str | None = None,
    now_ns: int | None = None,
) -> Plan:
    """What to remove: the layout `layout` whole, then every unit last used more than
    `older_than_s` ago, then least recently used units until at most `max_bytes` entry
    bytes remain (all layouts together). Criteria combine; None leaves one out."""
    p = Plan(total_bytes=sum(e.size for lay in inventory.layouts for e in lay.entries))
    if layout is not None:
        p.layouts.append(find_layout(inventory, layout))
    left = units(lay for lay in inventory.layouts if lay not in p.layouts)
    if older_than_s is not None:
        cutoff = (now_ns if now_ns is not None else time.time_ns()) - int(older_than_s * 1e9)
        p.units = [u for u in left if u.used_ns < cutoff]
        left = left[len(p.units) :]  # oldest first: the old ones are a prefix
    if max_bytes is not None:
        remaining = p.total_bytes - p.bytes
        for u in left:
            if remaining <= max_bytes:
                break
            p.units.append(u)
            remaining -= u.bytes
    return p


@dataclass
class Result:
    """What gc did: entries and bytes removed, and those left because an engine had
    replaced or removed the file since it was listed."""

    removed: int = 0
    removed_bytes: int = 0
    skipped: int = 0
    layout_dirs_removed: list[str] = field(default_factory=list)
    layout_dirs_left: list[str] = field(default_factory=list)


def execute(plan: Plan, progress: Callable[[int], None] | None = None) -> Result:
    """Remove what `plan` lists, each file only while it is the file listed;
    `progress(bytes)` after each. A removed layout's directory goes too once nothing
    but its layout.json is left in it (a write under way keeps it, with its files)."""
    result = Result()
    for e in plan.entries():
        if discard(e.where, e.file_id):
            result.removed += 1
            result.removed_bytes += e.size
        else:
            result.skipped += 1
        if progress is not None:
            progress(e.size)
    for lay in plan.layouts:
        gone = _remove_dir(Path(lay.where))
        (result.layout_dirs_removed if gone else result.layout_dirs_left).append(lay.where)
    return result


def _remove_dir(layout_dir: Path) -> bool:
    """Remove an emptied layout directory: temporary files older than the engines'
    leftover age, empty fan-out directories, then, if nothing else is left, layout.json
    and the directory. A write under way (a younger temporary file, or an entry an
    engine wrote meanwhile) keeps the directory as it is."""
    now = time.time()
    try:
        for e in scan_layout_dir(layout_dir):
            with contextlib.suppress(OSError):
                if (
                    is_temporary(e.name)
                    and now - e.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS
                ):
                    discard(e.path)
        for sub in os.scandir(layout_dir):
            if len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):  # not empty: a write landed
                    os.rmdir(sub.path)
        if {e.name for e in os.scandir(layout_dir)} - {LAYOUT_JSON}:
            return False
        (layout_dir / LAYOUT_JSON).unlink(missing_ok=True)
        layout_dir.rmdir()
        return True
    except OSError:
        return False
