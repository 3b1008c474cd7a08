"""Engine processes forked from a parent that has imported vLLM, instead of fresh
interpreters.

Importing vLLM and torch is most of an engine process's start: a short replay took
20-22 s in a fresh interpreter and 7-9 s forked, on a 2-core VM (docs/benchmarks.md). A
child forked from a parent that imported them, and ran no engine, no torch kernel and no
thread, skips that and is still a process of its own: its own engine, caches, memory and
exit, so a run sees no other run's state and a restart is a real one.
The benchmarks' engine processes (`benchmarks.figures.engine_process`) and the test
suite's zygote (tests/engine_proc.py) start their children here.

Fork is safe only from a single-threaded parent (a lock held by another thread stays
held in the child), on Linux: `can_fork` says whether this process may, and callers fall
back to a fresh interpreter when it may not.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import sys
import threading
import weakref
from collections.abc import Callable


def preload() -> None:
    """Import what an engine process imports (vLLM's offline engine and hybridkv's
    helpers), so that forked children start with it."""
    import vllm  # noqa: F401
    import vllm.entrypoints.llm  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401
    import vllm.v1.worker.gpu_model_runner  # noqa: F401

    import hybridkv.engine  # noqa: F401


def can_fork() -> bool:
    """Whether a child forked now starts in a consistent state: Linux (elsewhere torch's
    libraries are not fork-safe), and no thread other than this one (a benchmark's
    parent that started a pool must not fork)."""
    return sys.platform == "linux" and threading.active_count() == 1


def run_module(module: str, args: list[str] | tuple[str, ...] = ()) -> None:
    """What `python -m module ARGS` runs: the module as `__main__`, `args` after its file
    in `sys.argv`."""
    sys.argv = ["", *args]  # runpy puts the module's file first
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def fork_child(
    entry: Callable[[], object],
    env: dict[str, str],
    stdin: int,
    stdout: int,
    stderr: int,
    new_session: bool = False,
) -> int:
    """Fork a child that runs `entry` with exactly `env` and the given descriptors as its
    standard streams (with `new_session`, in a session of its own, as `start_new_session`)
    and then exits as an interpreter would; its pid. The caller closes its own copies of
    the descriptors and waits for the child."""
    sys.stdout.flush()  # as multiprocessing does before it forks: nothing buffered twice
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1
    try:
        _forget_parent_finalizers()
        os.environ.clear()
        os.environ.update(env)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            if fd != target:
                os.dup2(fd, target)
        for fd in {stdin, stdout, stderr} - {0, 1, 2}:
            os.close(fd)
        _own_streams()
        if new_session:
            os.setsid()
        code = run_to_exit(entry)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _own_streams() -> None:
    """Streams of the child's own descriptors, for `sys` and for the log handlers that
    wrote to the old ones (vLLM's writes to the `sys.stdout` of when it was configured):
    the parent's objects may hold buffered input, or write elsewhere than fd 1 and 2 (a
    redirect, pytest's capture)."""
    old = {id(sys.stdout): 1, id(sys.stderr): 2}
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    logging = sys.modules.get("logging")
    if logging is None:
        return
    loggers = [logging.root, *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            fd = old.get(id(getattr(handler, "stream", None)))
            if isinstance(handler, logging.StreamHandler) and fd is not None:
                # logging's last resort reads `sys.stderr` each time (no setter)
                with contextlib.suppress(AttributeError):
                    handler.stream = sys.stdout if fd == 1 else sys.stderr


def _forget_parent_finalizers() -> None:
    """Drop the finalizers and child processes the child inherited, as multiprocessing's
    own fork children do: they stand for the parent's resources (a `TemporaryDirectory`
    it still uses is removed by one at exit; multiprocessing's exit hook would stop the
    parent's daemon processes), not the child's. Those the child makes itself still run.
    Exit hooks stay: modules register theirs as they are imported (logging's flush), and
    a fresh interpreter importing them would run them too."""
    weakref.finalize._registry.clear()  # type: ignore[attr-defined]
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util._finalizer_registry.clear()
        util._run_after_forkers()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process._children = set()  # type: ignore[attr-defined]


def run_to_exit(entry: Callable[[], object]) -> int:
    """`entry`, then what an interpreter does on its way out (join non-daemon threads, run
    atexit hooks: the disk tier finishes its queued writes there); the exit status."""
    code = 0
    try:
        entry()
    except SystemExit as e:  # as the interpreter reads it: None 0, a message 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if code == 1 and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code
