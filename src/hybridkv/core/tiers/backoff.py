"""How long a tier that went down waits before it is probed again.

The delay doubles with every failed probe and every fall soon after coming back, up to a
maximum, so a dead or overloaded server is asked rarely. It starts over once the tier has
stayed up `RESET_AFTER` times as long as the last delay (or the maximum, whichever is
shorter). Waiting for the maximum instead, as a first version did, kept a server that
stalls now and then (a starved redis-server missing a 1 s timeout every 15-40 s beside
vLLM on two cores) down for 30 s after each stall: it was down 393 of 600 s in a soak
while it answered almost every call (docs/benchmarks.md). A stall after a long enough
run of service is news, and costs the first delay again; a server that falls again
before it has served that long is still sick, and the delay keeps growing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RESET_AFTER = 4.0  # the uptime, in last delays, after which a fall is a first fall again


@dataclass
class Backoff:
    """Delays before the next probe of a tier that is down (not thread-safe: the tier
    calls it under its lock)."""

    first_s: float
    max_s: float
    _next_s: float = field(init=False)
    _last_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._next_s = self.first_s

    @property
    def last_s(self) -> float:
        """The delay given last (0 before the first fall)."""
        return self._last_s

    def delay(self, up_for: float | None) -> float:
        """The wait before the next probe after a fall: `up_for` seconds after coming up,
        or None for a failed probe (or a tier never up)."""
        if up_for is not None and up_for > min(self.max_s, RESET_AFTER * self._last_s):
            self._next_s = self.first_s
        self._last_s = self._next_s
        self._next_s = min(2 * self._next_s, self.max_s)
        return self._last_s
