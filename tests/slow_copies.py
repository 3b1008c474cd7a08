"""A CPU copy engine whose copies stay in flight, as on a GPU's side streams.

On a CPU cache every copy lands before the call that makes it returns, so nothing hybridkv
does about copies still in flight would ever be exercised. Here each copy of the copy
engine (`gather_async`: stores, `scatter`: loads) runs, reading its source and writing
its destination, only when it lands: when the test lets it (`land`), or when hybridkv waits
for it (`Landing.wait`: the worker's `hold_compute`, a load waiting for the store it reads).
Copies of one kind land in the order they were made, as on one CUDA stream. A block the
engine rewrote before the copy ran then shows in the bytes. It fakes the one thing a CPU
cannot do (a copy still running), and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.core.copy_engine import CopyEngine, Landing


class _Stream:
    """One side stream's copies, run in order as they land: (the step queued, the copy)."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, Callable[[], object]]] = []
        self.landed = 0  # copies[:landed] have run

    def land_through(self, i: int) -> None:
        while self.landed <= i:
            run = self.copies[self.landed][1]
            self.landed += 1
            run()


class Deferred(Landing):
    def __init__(self, stream: _Stream, i: int) -> None:
        super().__init__()
        self._stream, self._i = stream, i

    def done(self) -> bool:
        return self._stream.landed > self._i

    def wait(self) -> None:
        self._stream.land_through(self._i)


class SlowCopies:
    def __init__(
        self, engine: CopyEngine, clock: Callable[[], int], failing_load: int | None = None
    ) -> None:
        """Hold `engine`'s copies in flight; `clock()` is the step they are queued in.
        `failing_load`: the load batch (counted from 1) whose copy raises, as a device
        error would."""
        self._clock = clock
        self._stores, self._loads = _Stream(), _Stream()
        gather_async, scatter = engine.gather_async, engine.scatter
        loads = 0

        def gather_later(copies):
            outs = [
                engine.pool.empty(len(c.block_ids) * engine.kv.block_bytes(c.group)) for c in copies
            ]

            def run() -> None:
                for out, got in zip(outs, gather_async(copies)[0], strict=True):
                    out.copy_(got)

            return outs, self._queue(self._stores, run)

        def scatter_later(batch, after=()):
            nonlocal loads
            loads += 1
            if loads == failing_load:
                raise RuntimeError("device error")
            batch, after = list(batch), list(after)
            return self._queue(self._loads, lambda: scatter(batch, after))

        engine.gather_async = gather_later
        engine.scatter = scatter_later

    def _queue(self, stream: _Stream, run: Callable[[], object]) -> Deferred:
        stream.copies.append((self._clock(), run))
        return Deferred(stream, len(stream.copies) - 1)

    def land(self, queued_before: int | None = None) -> None:
        """Land, in order, the copies queued before step `queued_before` (all: None)."""
        for stream in (self._stores, self._loads):
            steps = [step for step, _ in stream.copies]
            last = len(steps) - 1
            if queued_before is not None:
                last = max((i for i, step in enumerate(steps) if step < queued_before), default=-1)
            stream.land_through(last)

    def in_flight(self) -> int:
        return sum(len(s.copies) - s.landed for s in (self._stores, self._loads))

    @property
    def queued(self) -> int:
        return sum(len(s.copies) for s in (self._stores, self._loads))
