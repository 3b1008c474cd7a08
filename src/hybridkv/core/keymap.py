"""A dict of entry keys split into 64 smaller dicts, for the scheduler side's largest
tables (the byte ledger, the boundary graph's per-entry counts, what the lower tiers
hold).

Why: CPython rebuilds a dict's whole table when an insertion finds it full, and a table
whose keys come and go (entries admitted and evicted all day) fills again every few
hundred thousand insertions, however many keys it holds. At a million keys that one
insertion takes about 50 ms, on vLLM's scheduler thread, stalling every running request.
Split by the key's first byte (keys are blake3 digests, core/keys.py, so the parts fill
evenly), each part holds a 64th of the keys and one rebuild costs a 64th as much (under
1 ms at a million), at about 45 ns more per access (a Python call; `get_many` and
`missing` take a lookup's hundreds of keys in one). Iteration is part by part, not in
insertion order: nothing that keeps one of these maps relies on that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from typing import TypeVar

V = TypeVar("V")
PARTS = 64
_MISSING = object()


class KeyMap(MutableMapping[bytes, V]):
    """A mapping over `PARTS` dicts (the module docstring); the operations the index
    uses are written out, the rest come from `MutableMapping`."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[dict[bytes, V]] = [{} for _ in range(PARTS)]

    def __contains__(self, key: bytes) -> bool:
        return key in self._parts[key[0] & PARTS - 1]

    def __getitem__(self, key: bytes) -> V:
        return self._parts[key[0] & PARTS - 1][key]

    def get(self, key: bytes, default=None):
        return self._parts[key[0] & PARTS - 1].get(key, default)

    def __setitem__(self, key: bytes, value: V) -> None:
        self._parts[key[0] & PARTS - 1][key] = value

    def __delitem__(self, key: bytes) -> None:
        del self._parts[key[0] & PARTS - 1][key]

    def pop(self, key: bytes, default=_MISSING):
        part = self._parts[key[0] & PARTS - 1]
        return part.pop(key) if default is _MISSING else part.pop(key, default)

    def setdefault(self, key: bytes, default: V) -> V:
        return self._parts[key[0] & PARTS - 1].setdefault(key, default)

    def __len__(self) -> int:
        return sum(map(len, self._parts))

    def __bool__(self) -> bool:
        return any(self._parts)

    def __iter__(self) -> Iterator[bytes]:
        for part in self._parts:
            yield from part

    def keys(self) -> Iterator[bytes]:
        return iter(self)

    def values(self) -> Iterator[V]:
        for part in self._parts:
            yield from part.values()

    def items(self) -> Iterator[tuple[bytes, V]]:
        for part in self._parts:
            yield from part.items()

    def get_many(self, keys: Iterable[bytes], default: V) -> list[V]:
        """`get` of each key, in their order: one call for a lookup's hundreds."""
        parts = self._parts
        return [parts[key[0] & PARTS - 1].get(key, default) for key in keys]

    def missing(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys not here, in their order: one call for a lookup's hundreds."""
        parts = self._parts
        return [key for key in keys if key not in parts[key[0] & PARTS - 1]]

    def clear(self) -> None:
        for part in self._parts:
            part.clear()
