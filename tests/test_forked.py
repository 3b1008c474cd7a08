"""Engine processes forked from a parent that imported vLLM (`hybridkv.forked`) behave as
fresh interpreters do: their own environment, streams, exit status and exit hooks (not
the parent's finalizers), and the benchmarks' `engine_process` falls back to a fresh
interpreter where forking is not safe. Each case runs in a subprocess of its own (never
forking the test runner, whose threads may hold locks), with a small module standing in
for an engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ECHO = """
import json, os, sys
spec = json.load(sys.stdin)
if spec.get("fail"):
    print("about to fail", flush=True)
    raise RuntimeError("the engine broke")
print("noise on stderr", file=sys.stderr)
print("RESULT " + json.dumps({
    "pid": os.getpid(),
    "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
    "parent_module_here": "hybridkv.benchmarks.figures" in sys.modules,
    "spec": spec,
}), flush=True)
"""


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "echo_engine.py").write_text(ECHO)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_fork_child_gets_its_env_streams_exit_status_and_exit_hooks(tmp_path):
    script = """
        import atexit, os, sys, tempfile
        from hybridkv import forked

        kept = tempfile.TemporaryDirectory()  # the parent's: the child must not remove it

        def entry():
            global own
            own = tempfile.TemporaryDirectory(dir=kept.name)  # the child's: removed at exit
            atexit.register(lambda: print("exit hook ran", flush=True))
            print("read", sys.stdin.read(), os.environ.get("ONLY"), os.environ.get("HOME"))
            sys.exit(3)

        with tempfile.TemporaryFile("w+") as inp, tempfile.TemporaryFile("w+") as out:
            inp.write("spec"); inp.flush(); inp.seek(0)
            pid = forked.fork_child(entry, {"ONLY": "this"}, inp.fileno(), out.fileno(),
                                    out.fileno())
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            out.seek(0)
            print("|child:", repr(out.read()), "status", status)
        print("left in the parent's directory:", os.listdir(kept.name))
        """
    proc = _run(script, tmp_path)
    assert "|child: 'read spec this None\\nexit hook ran\\n' status 3" in proc.stdout
    assert "left in the parent's directory: []" in proc.stdout


def test_fork_child_writes_to_its_descriptors_and_leaves_the_parents_processes(tmp_path):
    """The parent's `sys.stdout` is not fd 1 (a redirect, a test runner's capture) and it
    runs a daemon multiprocessing process: the child's prints and log lines (its handler
    made on that `sys.stdout`) reach the descriptor it was given, and its exit does not
    stop the parent's process (multiprocessing's exit hook stops the daemon children it
    knows of)."""
    script = """
        import contextlib, io, logging, multiprocessing, os, sys, tempfile, time
        from hybridkv import forked

        daemon = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        daemon.daemon = True
        daemon.start()

        def entry():
            print("RESULT from the child")
            logging.getLogger("child").warning("LOG from the child")

        with tempfile.TemporaryFile("w+") as out, contextlib.redirect_stdout(io.StringIO()):
            logging.basicConfig(stream=sys.stdout, format="%(message)s")
            pid = forked.fork_child(entry, {}, 0, out.fileno(), out.fileno())
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            out.seek(0)
            got = out.read()
        print("|child:", repr(got), "status", status, "daemon alive", daemon.is_alive())
        daemon.terminate()
        """
    proc = _run(script, tmp_path)
    want = "|child: 'RESULT from the child\\nLOG from the child\\n' status 0 daemon alive True"
    assert want in proc.stdout, proc.stdout


def test_engine_process_forks_where_it_may_and_runs_a_fresh_interpreter_where_not(tmp_path):
    script = """
        import json, os, threading
        from hybridkv import forked
        from hybridkv.benchmarks import figures

        forked.preload = lambda: None  # the stand-in engine needs no vLLM
        out = {"pid": os.getpid(), "env_after": None}
        out["forked"] = figures.engine_process("echo_engine", {"n": 1}, "echo")
        try:
            figures.engine_process("echo_engine", {"fail": True}, "failing echo")
        except RuntimeError as e:
            out["failure"] = str(e)
        stop = threading.Event()
        threading.Thread(target=stop.wait).start()  # a thread: forking is not safe now
        try:
            out["fresh"] = figures.engine_process("echo_engine", {"n": 2}, "echo")
        finally:
            stop.set()
        out["env_after"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        print("OUT " + json.dumps(out))
        """
    proc = _run(script, tmp_path)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("OUT ")]
    out = json.loads(line[4:])
    forked_run, fresh = out["forked"], out["fresh"]
    assert forked_run["spec"] == {"n": 1} and fresh["spec"] == {"n": 2}
    assert forked_run["multiprocessing"] == fresh["multiprocessing"] == "0"
    assert out["env_after"] is None  # the parent's own environment is left as it was
    assert len({out["pid"], forked_run["pid"], fresh["pid"]}) == 3
    # Forked: the parent's imports are there. Fresh: a new interpreter without them.
    assert forked_run["parent_module_here"] and not fresh["parent_module_here"]
    failure = out["failure"]
    assert "failing echo failed (exit status 1)" in failure
    assert "about to fail" in failure and "RuntimeError: the engine broke" in failure
