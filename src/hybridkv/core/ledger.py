"""The byte ledger of the CPU tier and what must stay in it: the first part of the
scheduler side's index (core/index.py).

It counts every entry the workers hold in CPU memory, with its bytes over all ranks,
against the budget, and knows which entries may not be evicted now: those *pinned* (a
pending hit or load reads them, a running request owns them) and those being
*promoted* (read into CPU memory from a lower tier, not ready to read yet). An eviction
policy is told each time entries in CPU memory become held or evictable
(`HoldWatcher.hold`), so that it never looks at held entries to pass over them.

Every call costs O(1) per key: the pin total (`pinned`) and the bytes held are counters
kept as pins come and go, not sums taken when asked, because the scheduler side reports
them every step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from hybridkv.core.entry_table import EntryTable
from hybridkv.core.keytable import KeyTable


class HoldWatcher(Protocol):
    def hold(self, keys: list[bytes], held: bool) -> None:
        """Entries in CPU memory were pinned (`held`), or are evictable again (unpinned,
        or read by every rank)."""


class Ledger:
    def __init__(self, capacity: int, ranks: int):
        self.capacity = capacity
        self.ranks = ranks
        # Shared with the boundary graph (core/entry_table.py): one slot per key.
        self.table = EntryTable()
        self.sizes = self.table.sizes  # key -> bytes over all ranks
        self.used = 0
        self.held_bytes = 0  # of the entries in CPU memory that are pinned or promoting
        self._pins = KeyTable()  # key -> pins (a key no longer pinned leaves)
        self.pinned = 0  # every pin, counted as often as it was taken
        self.promoting: dict[bytes, int] = {}  # key -> bitmask of the ranks that read it
        self.watcher: HoldWatcher | None = None

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def held(self, key: bytes) -> bool:
        return key in self._pins or key in self.promoting

    def evictable_bytes(self) -> int:
        """An upper bound on what evicting could free now."""
        return self.used - self.held_bytes

    # ---- pins -----------------------------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> None:
        pins = self._pins
        first = []  # pinned now and not before
        for key in keys:
            n = pins.get(key, 0)
            pins[key] = n + 1
            self.pinned += 1
            if not n:
                first.append(key)
        self._changed(first, True)

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Release one pin of each key (a key not pinned is passed over)."""
        pins = self._pins
        last = []  # pinned no more
        for key in keys:
            n = pins.get(key, 0)
            if n > 1:
                pins[key] = n - 1
            elif n == 1:
                del pins[key]
                last.append(key)
            else:
                continue
            self.pinned -= 1
        self._changed(last, False)

    # ---- promotions -----------------------------------------------------------------------
    def start_promotion(self, key: bytes) -> None:
        """Before the entry is admitted: it enters CPU memory held."""
        self.promoting[key] = 0

    def promoted_on(self, key: bytes, rank: int) -> bool:
        """A rank read the entry; whether every rank has, which ends the promotion."""
        ranks = self.promoting[key] | 1 << rank
        if ranks.bit_count() < self.ranks:
            self.promoting[key] = ranks
            return False
        del self.promoting[key]
        if key not in self._pins and key in self.sizes:
            self._changed([key], False)
        return True

    def cancel_promotion(self, key: bytes) -> None:
        """Of an entry that never entered CPU memory (no room for it)."""
        del self.promoting[key]

    # ---- entries --------------------------------------------------------------------------
    def insert(self, key: bytes, nbytes: int) -> None:
        if not self.table.insert(key, nbytes):
            return  # counted already (callers admit only what is not): never twice
        self.used += nbytes
        if self.held(key):
            self.held_bytes += nbytes

    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget entries (in CPU memory or being promoted there), their promotions too,
        in a few bulk calls. What is held among them (none in an eviction; a lost entry
        or a failed promotion may be) is asked of the pins in one call."""
        sizes = self.table.remove(keys)
        self.used -= sum(n for n in sizes if n is not None)
        promoting = self.promoting
        held = set(self._pins.present(keys))
        if promoting:
            held.update(key for key in keys if key in promoting)
            for key in keys:
                promoting.pop(key, None)
        if held:
            self.held_bytes -= sum(
                n for key, n in zip(keys, sizes, strict=True) if n is not None and key in held
            )

    def clear(self) -> None:
        """Forget every entry; pins stay (their requests release them)."""
        self.table.clear_sizes()
        self.promoting.clear()
        self.used = self.held_bytes = 0

    def _changed(self, keys: list[bytes], held: bool) -> None:
        """`keys` gained their first pin (`held`) or lost their last: those in CPU memory
        and not being promoted became held (or evictable) all at once."""
        if not keys:
            return
        keys = self.sizes.present(keys)
        if self.promoting:
            keys = [key for key in keys if key not in self.promoting]
        if not keys:
            return
        change = self.sizes.total(keys)
        self.held_bytes += change if held else -change
        if self.watcher is not None:
            self.watcher.hold(keys, held)
