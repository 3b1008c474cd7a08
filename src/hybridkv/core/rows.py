"""Records kept as rows of native columns, with row ids handed out again once freed: the
boundary graph's boundaries and segments (core/boundary_graph.py), the KV cache events'
resumable graph and its watch links (core/resumable.py), the chain memo's chains
(core/keys.py).

Why columns: a Python object per record is one more thing for every full collection of
the garbage collector to walk on the scheduler's thread, and those records grow with the
tier. Each column is a native `Column` (src/hybridkv/_columns.c), which grows a page at a
time: `array.array` columns all reached their allocation's end on the same new row and
were copied whole (up to 2.4-3.7 ms for one row at 100,000 rows, 12-13 ms at a million:
`bench/lookup.py --row-growth`).
"""

from __future__ import annotations

from typing import Any

from hybridkv._columns import Column


class Rows:
    """Columns named by `COLUMNS` (name -> `Column` kind: a subclass's, or `columns`
    given), each an attribute, and a list of freed row ids."""

    COLUMNS: dict[str, str] = {}

    def __init__(self, columns: dict[str, str] | None = None) -> None:
        if columns is not None:
            self.COLUMNS = columns
        for name, kind in self.COLUMNS.items():
            setattr(self, name, Column(kind))
        self._free = Column("q")

    def add_row(self, *values: Any) -> int:
        """A row with the columns' values, in `COLUMNS` order: a freed one if any."""
        if self._free:
            row = self._free.pop()
            for name, value in zip(self.COLUMNS, values, strict=True):
                getattr(self, name)[row] = value
            return row
        for name, value in zip(self.COLUMNS, values, strict=True):
            getattr(self, name).append(value)
        return len(getattr(self, next(iter(self.COLUMNS)))) - 1

    def free_row(self, row: int) -> None:
        self._free.append(row)

    def clear_rows(self) -> None:
        for name in self.COLUMNS:
            getattr(self, name).clear()
        self._free.clear()
