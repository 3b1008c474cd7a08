"""Run a vLLM engine with hybridkv in a fresh Python process, for restart and sharing tests.

Reads a JSON spec on stdin: {"model", "extra", "steps": [...], "shutdown"?, "engine"?
(LLM keyword arguments), "env"?} and prints one line `RESULT <json>` with every
generation, the scheduler side's snapshot and, when the worker runs in this process,
its tier stats.
Steps: {"op": "generate", "name", "prompt", "max_tokens"?, "fresh"?, "salt"?} (fresh:
empty vLLM's own prefix cache and hybridkv's CPU tier first, so only the disk can serve a
hit; with the worker in this process only; salt: vLLM's `cache_salt`),
{"op": "reset", "connector"?} (empty vLLM's own prefix cache only; with "connector": true
hybridkv's too, as after new weights),
{"op": "flush"}, {"op": "touch", "path"}, {"op": "wait", "path", "timeout"?},
{"op": "limit_file_size", "bytes"}, {"op": "stall_disk_writes", "path"} (see
`stall_disk_writes`).

`python engine_proc.py --zygote SOCKET` imports vLLM once (about 75 % of an engine
process's start) and then forks one such engine process per request on the Unix socket
(see `zygote`); conftest.EngineProc uses it so the suite stays within CI's time. It also
forks the test servers' API server process (`python -m vllm.entrypoints.openai.api_server`,
tests/serving.py), whose import of vLLM is about half a server's start, and the
command line (`python -m hybridkv.cli`, test_cli_bench.py), whose benchmarks fork their
engines from it in turn.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from hybridkv import forked  # noqa: E402


def main() -> None:
    spec = json.load(sys.stdin)
    os.environ.update(spec.get("env", {}))
    from hybridkv.engine import (
        drop_cpu_tier,
        generate,
        make_llm,
        scheduler_connector,
        shutdown,
        sync_tiers,
        worker_connector,
    )

    llm = make_llm(spec["model"], spec.get("extra"), **spec.get("engine", {}))
    side = scheduler_connector(llm).scheduler_side
    # The worker is in this process with the 'uni' executor only.
    in_process = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "uni"
    store = worker_connector().worker_side.store if in_process else None
    runs = {}
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            if step.get("fresh"):
                llm.reset_prefix_cache()
                drop_cpu_tier(llm)
            out = generate(llm, [step["prompt"]], step.get("max_tokens", 8), step.get("salt"))[0]
            runs[step["name"]] = dataclasses.asdict(out)
        elif op == "reset":
            llm.reset_prefix_cache(reset_connector=step.get("connector", False))
        elif op == "limit_file_size":  # a full disk from here on (also for child processes)
            resource.setrlimit(resource.RLIMIT_FSIZE, (step["bytes"], step["bytes"]))
        elif op == "stall_disk_writes":
            stall_disk_writes(Path(step["path"]))
        elif op == "flush":
            sync_tiers(llm)
        elif op == "touch":
            Path(step["path"]).touch()
        elif op == "wait":
            deadline = time.monotonic() + step.get("timeout", 300)
            while not Path(step["path"]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(step["path"])
                time.sleep(0.1)
        else:
            raise ValueError(f"unknown step {op!r}")
    stats = {name: dataclasses.asdict(s) for name, s in store.stats().items()} if store else {}
    result = {
        "runs": runs,
        "stats": stats,
        "snapshot": side.snapshot(),
        "chunk_tokens": side.planner.chunk_tokens,
    }
    print("RESULT " + json.dumps(result), flush=True)
    if spec.get("shutdown", True):
        shutdown(llm)
    # Otherwise the interpreter exits with the engine up: queued disk writes must still
    # be finished by hybridkv's exit hook.


def stall_disk_writes(flag: Path) -> None:
    """From here on every disk entry write stops halfway and never ends, `flag` touched
    once one has: a kill then finds a write in progress by construction, whatever the
    machine's speed."""
    import threading

    from hybridkv.core.tiers import disk

    def stalled(f, *args, **kwargs) -> None:
        f.write(bytes(4096))
        f.flush()
        flag.touch()
        threading.Event().wait()

    disk.write_entry = stalled


def zygote(path: str) -> None:
    """Serve engine processes forked from this one, which has imported vLLM already.

    A request on the Unix socket `path` carries the engine's stdin and stdout as file
    descriptors and, as JSON, its environment and, for a server or the command line, the
    argv of `python -m MODULE` (see `_serve`; run in a session of its own, as
    `start_new_session`). A forked helper forks the process (`hybridkv.forked`: a child
    of a process that ran no engine and no torch kernel, only imports), sends its pid
    back, waits for it and sends its exit status (negative: the signal that killed it).
    Every engine process shares this process's hash seed; keys never depend on Python's
    hash (a fresh process for a restart test shows it).
    """
    import vllm.entrypoints.openai.api_server  # noqa: F401

    import hybridkv.cli  # noqa: F401
    import hybridkv.server  # noqa: F401

    forked.preload()

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the helpers reap themselves
    print("READY", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os._exit(_helper(conn))
        conn.close()


def _helper(conn: socket.socket) -> int:
    size = int.from_bytes(_recv_exactly(conn, 8), "little")
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(size, socket.CMSG_LEN(2 * fds.itemsize))
    data += _recv_exactly(conn, size - len(data))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    stdin, stdout = fds
    request = json.loads(data)
    argv = request.get("argv")

    def entry() -> None:
        conn.close()  # the child's copy: the test sees this helper's answers alone
        if argv is None:
            main()
        else:
            _serve(argv)

    pid = forked.fork_child(entry, request["env"], stdin, stdout, stdout, argv is not None)
    os.close(stdin)
    os.close(stdout)
    conn.sendall(pid.to_bytes(8, "little"))
    _, status = os.waitpid(pid, 0)
    conn.sendall(os.waitstatus_to_exitcode(status).to_bytes(8, "little", signed=True))
    return 0


def _serve(argv: list[str]) -> None:
    """What `python -m MODULE ARGS` runs, `argv` being that whole command line: the
    module as `__main__` (so the engine core, which vLLM spawns from an API server,
    imports it as the main module, as it would). MODULE is vLLM's API server or
    hybridkv's command line."""
    from serving import FORK_ENGINE

    from hybridkv.server import API_SERVER

    served = (API_SERVER, "hybridkv.cli")
    if len(argv) < 3 or argv[1] != "-m" or argv[2] not in served:
        raise ValueError(f"the zygote serves only `python -m` of {served}: {argv[:3]}")
    if argv[2] == API_SERVER and os.environ.get(FORK_ENGINE) == "1":
        _fork_engine_processes()
    forked.run_module(argv[2], argv[3:])


def _fork_engine_processes() -> None:
    """vLLM's CPU platform forces `spawn` for the engine core and the model worker, and
    each spawned interpreter imports vLLM again (about 17 s apiece on the 2-core VM, most
    of a server's start). Forked from this process, which has imported it, they start at
    once; the layout (API server, engine core, model worker, each a process of its own)
    is the same, and fork is what vLLM uses on a GPU, where no platform forces spawn.
    What differs from spawn: the processes share this one's hash seed, miss the
    platform's LD_PRELOAD (torch's libgomp, tcmalloc: it applies to exec'd children
    only), and end with `os._exit`, so exit hooks (the tiers' fallback drain) do not
    run; vLLM's own shutdown calls still do. Hence some servers stay spawned
    (test_server.SPAWNED, `hybridkv serve`'s test)."""
    from vllm.platforms.cpu import CpuPlatform

    forcing = CpuPlatform.check_and_update_config.__func__

    def then_fork(cls: type, vllm_config: object) -> None:
        forcing(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(then_fork)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("engine zygote: connection closed")
        data += chunk
    return data


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        zygote(sys.argv[2])
    else:
        main()
