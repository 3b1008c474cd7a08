"""The scheduler side's per-key tables of integers, in native code (src/hybridkv/_keytable.c).

Why: on the scheduler thread a step that serves new long prompts asks its tables about
thousands of keys that no recent step touched, and in a CPython dict each such lookup
misses the cache about three times (the table's index, its entry, the key object to
compare against): 0.6-1.5 us a key in a dict of 10,000 to a million once other work went
through the caches, against 0.05 us for a key asked again at once (`bench/lookup.py
--cold-lookups`). Much of a p99 step is such misses, not the Python around them
(compiling the index's modules with Cython left the step's time unchanged:
docs/benchmarks.md). A `KeyTable` keeps each key in its slot (32 bytes: the
key, its length and the value), so a lookup reads one or two cache lines, and its bulk
calls (`missing`, `present`, `get_many`) prefetch a batch's slots before probing any, so
the batch's misses overlap. It is split 64 ways (`PARTS`) by the key's hash: CPython
rebuilds a whole dict when an insertion finds it full, and a table whose keys come and go
fills again every few hundred thousand insertions, however many keys it holds (about
50 ms for one dict of a million keys, on the scheduler's thread), where growing one part
rehashes a 64th of the keys. No Python object per key: the garbage collector has nothing
in it to walk.

Keys are byte strings of up to 23 bytes (entry keys have 18: core/keys.py), values
64-bit integers. It is a mutable mapping, with two differences from a dict: iteration
and `keys()`/`values()`/`items()` give lists taken when asked (the table may change
while a caller walks them), in no particular order; and a key that is not `bytes` is a
`TypeError`, not merely absent.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence

from hybridkv._keytable import KeyTable

MutableMapping.register(KeyTable)

PARTS = 64  # the split of a KeyTable (_keytable.c) and of the index's other large maps


def first_found(keys: Sequence[bytes], pick: Callable[[Sequence[bytes]], list[bytes]]) -> int:
    """The place in `keys` (distinct) of the first one `pick` picks, `len(keys)` if none:
    `pick` returns, in their order, the keys of a block it picks (`KeyTable.missing`, say).

    Why blocks: a lookup's run usually ends, or a chain's previous boundary usually lies,
    a few chunks from where the search starts, and one call over all of a 24k-token
    prompt's keys would read every one. Blocks of 16, 32, 64, ... keep the calls few
    (logarithmic) and read at most about twice the keys up to the one found."""
    start, size = 0, 16
    while start < len(keys):
        block = keys[start : start + size]
        picked = pick(block)
        if picked:
            return start + block.index(picked[0])
        start += size
        size *= 2
    return len(keys)


class RowBytes:
    """A byte string per key (a row number, or a byte string), in dicts split 64 ways by
    the key's hash.

    Not one dict: one whose keys come and go rebuilds its whole table every so often, on
    the scheduler's thread (milliseconds at a million entries: the module docstring);
    split, each rebuild costs a 64th. Not a list, nor values of other kinds: the garbage
    collector follows every item of a list, or of a dict holding a container, in each full
    collection, and never looks inside a dict of ints and bytes."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[dict[int | bytes, bytes]] = [{} for _ in range(PARTS)]

    def __getitem__(self, key: int | bytes) -> bytes:
        return self._parts[hash(key) & PARTS - 1][key]

    def get(self, key: int | bytes) -> bytes | None:
        return self._parts[hash(key) & PARTS - 1].get(key)

    def __setitem__(self, key: int | bytes, value: bytes) -> None:
        self._parts[hash(key) & PARTS - 1][key] = value

    def __delitem__(self, key: int | bytes) -> None:
        del self._parts[hash(key) & PARTS - 1][key]

    def pop(self, key: int | bytes) -> bytes | None:
        """The key's value, removed; None if it has none."""
        return self._parts[hash(key) & PARTS - 1].pop(key, None)

    def __contains__(self, key: int | bytes) -> bool:
        return key in self._parts[hash(key) & PARTS - 1]

    def __len__(self) -> int:
        return sum(map(len, self._parts))

    def rows(self) -> list[int | bytes]:
        return [row for part in self._parts for row in part]

    def clear(self) -> None:
        for part in self._parts:
            part.clear()
