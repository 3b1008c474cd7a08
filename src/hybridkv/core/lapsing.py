"""Answers about a shared tier that hold for a while: what a probe heard (core/probe.py)
and the hints the index keeps from it (core/lower_tiers.py).

Other replicas change a shared tier, so an answer is trusted until a time and then
lapses. Lapsed answers are dropped oldest first as new ones come (two queues in the order
they were given), so each costs O(1), never a pass over all of them; a lookup checks the
time itself, so one not dropped yet is never trusted.

Held as integers in a native `KeyTable` (core/keytable.py), not tuples: a lookup records
hundreds of answers, and each tuple would be an object the garbage collector tracks.
Answers live for seconds, so tens of thousands of them pile up in its youngest generation
(whose count only grows by allocations minus deallocations, and evicted entries keep
deallocating), and one collection of that generation then stalls the scheduler thread for
10-20 ms. A time is kept in whole microseconds; a "no" is its time negated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from hybridkv.core.keytable import KeyTable


def _micros(seconds: float) -> int:
    return round(seconds * 1e6)


class Lapsing:
    """Per key, a yes or no answer good until a time (seconds, `time.monotonic`)."""

    def __init__(self) -> None:
        self._until = KeyTable()  # key -> good until (us); negative: "no"
        self._times: deque[int] = deque()  # when each answer given lapses (us), in order
        self._keys: deque[bytes] = deque()  # and its key

    def __len__(self) -> int:
        return len(self._until)

    def __iter__(self):
        return iter(self._until)

    def put(self, key: bytes, until: float, yes: bool = True) -> None:
        """An answer for `key` until `until`, never earlier than the one put before (a
        tier's answers share one time to live), so the oldest lapse first."""
        until_us = _micros(until)
        self._until[key] = until_us if yes else -until_us
        self._times.append(until_us)
        self._keys.append(key)

    def get(self, key: bytes, now: float) -> bool | None:
        """The answer for `key` if one holds at `now`, else None."""
        until, now_us = self._until.get(key), _micros(now)
        if until is None or abs(until) <= now_us:
            return None
        return until > 0

    def without_yes(self, keys: list[bytes], now: float) -> list[bytes]:
        """Of `keys`, those with no "yes" that holds at `now`."""
        if not self._times:
            return keys
        untils, now_us = self._until.get_many(keys, 0), _micros(now)
        return [key for key, until in zip(keys, untils, strict=True) if until <= now_us]

    def split(self, keys: Sequence[bytes], now: float) -> tuple[list[bytes], list[bytes]]:
        """Of `keys`, those with a "yes" that holds at `now`, and those with no answer
        that does."""
        untils, now_us = self._until.get_many(keys, 0), _micros(now)
        yes = [key for key, until in zip(keys, untils, strict=True) if until > now_us]
        unknown = [k for k, until in zip(keys, untils, strict=True) if -now_us <= until <= now_us]
        return yes, unknown

    def pop(self, key: bytes) -> None:
        self._until.pop(key, None)

    def drop_lapsed(self, now: float) -> None:
        """Forget the answers lapsed at `now` (unless given again since)."""
        times, keys, until, now_us = self._times, self._keys, self._until, _micros(now)
        while times and times[0] <= now_us:
            lapsed, key = times.popleft(), keys.popleft()
            answer = until.get(key)
            if answer is not None and abs(answer) == lapsed:
                del until[key]

    def clear(self) -> None:
        self._until.clear()
        self._times.clear()
        self._keys.clear()
