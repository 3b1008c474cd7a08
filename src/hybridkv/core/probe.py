"""Which keys a shared tier holds, asked off the scheduler thread.

Other replicas write to a shared tier (Redis), so no worker report can tell the
scheduler side what it holds: it has to ask. Asking takes a network round trip, which
must never hold up a scheduling step, so a `Probe` asks in one background thread (one
pipelined round trip for all keys of a lookup) and the lookup answers "ask again" until
the answer is in. Answers stay fresh for `ttl_s`: a lookup polled every step, or the next
request of a conversation, does not ask again; an entry another replica stores later is
found once the answer lapses. A tier that is down answers "absent" at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)


class Probe:
    def __init__(
        self,
        name: str,
        contains_many: Callable[[Sequence[bytes]], list[bool]],
        ttl_s: float = 5.0,
    ):
        self.name = name
        self._contains_many = contains_many
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._answers: dict[bytes, tuple[bool, float]] = {}  # key -> (held, good until)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"hybridkv-probe-{name}")
        self._running: Future | None = None
        self.round_trips = 0
        self.errors = 0

    def held(self, keys: Sequence[bytes]) -> tuple[list[bytes], bool]:
        """The keys the tier holds as far as fresh answers go, and whether some of
        `keys` have none (a probe for them is then under way)."""
        now = time.monotonic()
        held, unknown = [], []
        with self._lock:
            for key in keys:
                answer = self._answers.get(key)
                if answer is None or answer[1] <= now:
                    unknown.append(key)
                elif answer[0]:
                    held.append(key)
            if unknown and (self._running is None or self._running.done()):
                self._running = self._pool.submit(self._ask, unknown)
        return held, bool(unknown)

    def _ask(self, keys: list[bytes]) -> None:
        try:
            found = self._contains_many(keys)
        except Exception:  # a tier must never raise into the engine; count it as absent
            log.exception("hybridkv: probing the %s tier failed", self.name)
            self.errors += 1
            found = [False] * len(keys)
        until = time.monotonic() + self.ttl_s
        with self._lock:
            self.round_trips += 1
            now = time.monotonic()
            for key in [k for k, (_, t) in self._answers.items() if t <= now]:
                del self._answers[key]
            for key, present in zip(keys, found, strict=True):
                self._answers[key] = (present, until)

    def failed(self, key: bytes) -> None:
        """A read of `key` failed (damaged, gone): treat it as absent until the answer
        would have lapsed, rather than have the lookup retry it every step."""
        with self._lock:
            self._answers[key] = (False, time.monotonic() + self.ttl_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
