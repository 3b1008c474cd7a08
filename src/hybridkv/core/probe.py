"""Which keys a shared tier holds, asked off the scheduler thread, for every lookup at once.

Other replicas write to a shared tier (Redis), so no worker report can tell the
scheduler side what it holds: it has to ask. Asking takes a network round trip, which
must never hold up a scheduling step, so a `Probe` asks in one background thread and the
lookup answers "ask again" until the answer is in. The lookups of a step only note the
keys they need (`held`); the scheduler side then sends them all in one pipelined round
trip (`send`, once per step): N new prompts wait for one round trip, not N. Keys noted
while a round trip is out go in the next, right after it. Answers stay fresh for
`ttl_s` from the first lookup after they came back (not from their coming back: a step
longer than `ttl_s`, a long prefill on a CPU, would let every answer lapse before any
lookup read it, and the lookups would wait on the probe until their wait is overdue): a
lookup polled every step, or the next request of a conversation, does not ask again; an
entry another replica stores later is found once the answer lapses. A tier that is down
answers "absent" at once. A reset (`clear`) discards the answers of a round trip still
out, which were asked before it, and answers no lookup read within LANDED_MAX_AGE of
their coming back (every lookup that asked was aborted) are dropped unread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from hybridkv.core.lapsing import Lapsing

log = logging.getLogger(__name__)

# The oldest a round trip's answers may be when a lookup first reads them: a step as
# long as this is far beyond a long prefill on a CPU.
LANDED_MAX_AGE = 60.0
# The longest a key whose reads keep failing is taken as absent, and how many such keys
# are remembered (about 100 bytes each).
FAILED_MAX_HOLD_OFF = 600.0
FAILURES_KEPT = 1 << 16


class Probe:
    def __init__(
        self,
        name: str,
        contains_many: Callable[[Sequence[bytes]], list[bool]],
        ttl_s: float = 5.0,
        release: Callable[[], None] | None = None,
    ):
        """`release`: what `close` calls once no round trip is out (the client's own
        close: its connections and threads)."""
        self.name = name
        self._contains_many = contains_many
        self._release = release
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        # Held or not, per key, until the answer lapses; lapsed answers go oldest first,
        # so a round trip never passes over all of them under the lock lookups take.
        self._answers = Lapsing()
        self._wanted: dict[bytes, None] = {}  # keys with no fresh answer, for the next ask
        # Answers back, no lookup since: key -> (held, when it came back).
        self._landed: dict[bytes, tuple[bool, float]] = {}
        self._epoch = 0  # advanced by `clear`: a round trip asked before lands nothing
        # key -> (failures in a row, when its hold-off ends, how long it is): `failed`
        self._failures: dict[bytes, tuple[int, float, float]] = {}
        self._asking: set[bytes] = set()  # keys of the round trip out
        self._waiting = 0  # lookups whose keys are in `_wanted`
        self._sending = False  # a round trip is out (or about to be)
        self._again = False  # `send` was called meanwhile: ask again right after
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"hybridkv-probe-{name}")
        self.round_trips = 0
        self.lookups = 0  # lookups whose keys went out, over all round trips
        self.errors = 0

    def held(self, keys: Sequence[bytes]) -> tuple[list[bytes], bool]:
        """The keys the tier holds as far as fresh answers go, and whether some of
        `keys` have none: those join the next round trip (`send`)."""
        now = time.monotonic()
        with self._lock:
            if self._landed:  # their time to live starts now
                self._answers.drop_lapsed(now)
                for key, (present, at) in self._landed.items():
                    if now - at <= LANDED_MAX_AGE:
                        self._answers.put(key, now + self.ttl_s, present)
                self._landed = {}
            held, unanswered = self._answers.split(keys, now)
            asking, wanted = self._asking, self._wanted
            new = [key for key in unanswered if key not in asking and key not in wanted]
            wanted.update(dict.fromkeys(new))
            self._waiting += bool(new)
        return held, bool(unanswered)

    def send(self) -> None:
        """Ask about every key the lookups have noted, in one round trip in the
        background; with one out already, right after it."""
        with self._lock:
            if not self._wanted:
                return
            if self._sending:
                self._again = True
                return
            self._sending = True
        try:
            self._pool.submit(self._ask)
        except RuntimeError:  # closed: the engine is shutting down
            with self._lock:
                self._sending = False

    def _ask(self) -> None:
        while True:
            with self._lock:
                keys, self._wanted = list(self._wanted), {}
                lookups, self._waiting = self._waiting, 0
                self._asking = set(keys)
                self._again = False
                epoch = self._epoch
            try:
                found = self._contains_many(keys)
            except Exception:  # a tier must never raise into the engine; count it as absent
                log.exception("hybridkv: probing the %s tier failed", self.name)
                self.errors += 1
                found = [False] * len(keys)
            with self._lock:
                self.round_trips += 1
                self.lookups += lookups
                if epoch == self._epoch:
                    at = time.monotonic()
                    self._landed.update((k, (f, at)) for k, f in zip(keys, found, strict=True))
                self._asking = set()
                if not (self._again and self._wanted):
                    self._sending = False
                    return

    def failed(self, key: bytes) -> None:
        """A read of `key` failed (damaged, gone, or held for rank 0 only, whose copy is
        the one asked about): treat it as absent for a while rather than have the lookup
        retry it every step. A key that fails again soon after its hold-off ended (within
        as long again) is held off twice as long, up to FAILED_MAX_HOLD_OFF, so that an
        entry nothing rewrites does not cost a failing promotion every `ttl_s`; one that
        fails again only much later (a brief outage hours apart) starts over at `ttl_s`."""
        with self._lock:
            self._landed.pop(key, None)
            now = time.monotonic()
            n, until, hold_off = self._failures.pop(key, (0, now, 0.0))
            if now > until + hold_off:
                n = 0
            if len(self._failures) >= FAILURES_KEPT:
                self._failures.clear()  # bounded: forgetting only shortens a hold-off
            n += 1
            hold_off = min(self.ttl_s * 2.0 ** min(n - 1, 30), FAILED_MAX_HOLD_OFF)
            self._failures[key] = (n, now + hold_off, hold_off)
            self._answers.put(key, now + hold_off, False)

    def clear(self) -> None:
        """Forget every answer (a reset of the engine's view): the next lookups ask anew,
        and find what the tier holds now, their own engine's stores included."""
        with self._lock:
            self._answers.clear()
            self._landed = {}
            self._failures = {}
            self._epoch += 1

    def close(self) -> None:
        """At the engine's shutdown: no round trip starts any more, the one out (bounded
        by the client's timeout) ends, then the client is released."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._release is not None:
            try:
                self._release()
            except Exception:  # a tier must never raise into the engine
                log.exception("hybridkv: closing the %s tier's probe failed", self.name)
