"""CPU priority of hybridkv's background threads (disk reads and writes, Redis writes,
promotions; not the copies of a step, nor the shared tier's probe, which a lookup
waits for).

They run below the engine's own threads. On a host whose cores also run the model
(vLLM's CPU build), a background read at the same priority takes cores from the
forward's OpenMP threads, and every thread of a parallel region then waits for the
slowest: while 253 MiB were read from disk, a decode step of 30 ms took 130-240 ms
(bench/stall.py). Lowered, the reads get the cycles the forward leaves and still all of
an idle machine. On a GPU server the forward needs little host CPU, so the threads lose
next to nothing there.

Not the idle scheduling class (SCHED_IDLE), though it cut the decoder's stall further:
such a thread gets almost no CPU while the forward's threads run, so a restore of
253 MiB took 20-27 s instead of 5-6 s, and with one reader thread a single engine step
took 140 s, twice in two runs: the engine waited on a thread that did not get to run
(bench/stall.py, docs/benchmarks.md). A niced thread keeps a small share of the CPU,
which bounds such a wait.
"""

from __future__ import annotations

import os
import threading

NICENESS = 10  # added to the process's niceness (Linux: per thread)


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux; a no-op where it cannot)."""
    try:
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + NICENESS))
    except (AttributeError, OSError):
        pass
