"""What a full collection of CPython's garbage collector costs because of one object: the
references it follows from the tracked objects that object reaches.

Why it matters: CPython runs a full collection on whichever thread allocates when the
objects that survived younger ones have grown by a quarter, and for the scheduler side
that is vLLM's scheduler thread. Its time goes with every reference of every tracked
object (each read once to subtract and once to move, a cache miss apiece at a million
entries), so the index keeps its per-entry and per-boundary records where the collector
does not look: arrays, and dicts of bytes to ints (docs/benchmarks.md). bench/lookup.py
reports it, and tests/test_index_gc.py holds the index to it.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Callable


def references_followed(root: object) -> int:
    """References a full collection follows from the tracked objects `root` reaches
    (itself included) without passing through a class, a module or a function."""
    seen: set[int] = set()
    todo, total = [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not gc.is_tracked(obj):
            continue
        seen.add(id(obj))
        refs = gc.get_referents(obj)
        total += len(refs)
        todo += [r for r in refs if not isinstance(r, (type, types.ModuleType, Callable))]
    return total
