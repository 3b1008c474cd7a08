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
