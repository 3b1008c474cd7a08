"""Shared fixtures: locally generated tiny models and in-process vLLM engines."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import threading

import pytest

# Engines run inside the test process so tests can reach both connector sides.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

# Settings in the caller's shell (HYBRIDKV_CPU_BYTES, a disk path, ...) would reach every
# test engine and server, above the tests' own: only the model directory and the seed
# below are read from there.
for _name in [k for k in os.environ if k.startswith("HYBRIDKV_")]:
    if _name not in ("HYBRIDKV_HOME", "HYBRIDKV_TEST_SEED"):
        del os.environ[_name]

# Inputs a test draws (prompt lengths, workloads) come from generators seeded from this,
# never from values picked because they pass; every run prints it in its header, and
# HYBRIDKV_TEST_SEED draws other inputs.
SEED = int(os.environ.get("HYBRIDKV_TEST_SEED", "2611"))


def pytest_report_header(config: pytest.Config) -> str:
    return f"hybridkv: inputs drawn with HYBRIDKV_TEST_SEED={SEED}"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    from hybridkv.models import ARCHS, make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(arch, root / arch, size="tiny")) for arch in ARCHS}


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


_salts = itertools.count()


def reference_salt() -> str:
    """A cache salt no other request of the session has: a prompt under it is computed
    from its first token (no hit from vLLM's cache nor from hybridkv)."""
    return f"reference-{next(_salts)}"


def recomputed(llm, prompt: list[int], max_tokens: int = 8):
    """The reference for a restore: `prompt` computed from its first token, under a
    cache salt no other request has (neither vLLM's prefix cache nor hybridkv can serve
    any of it), so no restored byte takes part. A reference taken after the restore from
    vLLM's own prefix cache would read the very blocks the restore wrote."""
    from hybridkv.engine import generate

    ref = generate(llm, [prompt], max_tokens, salt=reference_salt())[0]
    assert ref.num_cached_tokens == 0
    return ref


@pytest.fixture
def engine_factory():
    """Start engines; shut them all down when the test ends."""
    from hybridkv.engine import make_llm, shutdown

    llms = []

    def start(model_dir, extra=None, **kwargs):
        llm = make_llm(model_dir, extra, **kwargs)
        llms.append(llm)
        return llm

    yield start
    for llm in llms:
        shutdown(llm)
    llms.clear()


ENGINE_PROC = os.path.join(os.path.dirname(__file__), "engine_proc.py")


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


class _Zygote:
    """One process per test session that has imported vLLM and forks engine processes
    on request (engine_proc.py --zygote): each engine then starts in about a quarter of
    a fresh interpreter's time."""

    _instance: _Zygote | None = None
    _lock = threading.Lock()  # servers started side by side share one zygote

    def __init__(self) -> None:
        import atexit
        import shutil
        import subprocess
        import sys
        import tempfile

        self.path = os.path.join(tempfile.mkdtemp(prefix="hybridkv-zygote-"), "sock")
        self.proc = subprocess.Popen(
            [sys.executable, ENGINE_PROC, "--zygote", self.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"engine zygote did not start: {line!r}")
        atexit.register(self.proc.kill)
        atexit.register(shutil.rmtree, os.path.dirname(self.path), True)

    @classmethod
    def get(cls) -> _Zygote:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
            return cls._instance


class _Forked:
    """A process the zygote forked (an engine process, or with `argv` a server's API
    server): what the tests use of `subprocess.Popen`."""

    def __init__(
        self,
        stdin: int,
        stdout: int,
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
    ) -> None:
        import json
        import socket

        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_Zygote.get().path)
        request = {"env": _child_env() if env is None else env, "argv": argv}
        data = json.dumps(request).encode()
        self._conn.sendall(len(data).to_bytes(8, "little"))
        socket.send_fds(self._conn, [data], [stdin, stdout])
        self.pid = int.from_bytes(self._recv(8), "little")
        self.returncode: int | None = None

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self._conn.recv(n - len(data))
            if not chunk:
                raise ConnectionError("engine zygote: the helper went away")
            data += chunk
        return data

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                code = self._recv(8)
            except TimeoutError:
                raise subprocess.TimeoutExpired("engine process", timeout) from None
            self.returncode = int.from_bytes(code, "little", signed=True)
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            import select

            if select.select([self._conn], [], [], 0)[0]:
                return self.wait()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def _forked_server(cmd: list[str], log_fd: int, env: dict[str, str]):
    """serving.start_process for the suite: the API server forked by the zygote, which
    has imported vLLM (a server starts about 15 s sooner); other commands as users run
    them."""
    import serving

    from hybridkv.server import API_SERVER

    if cmd[1:3] != ["-m", API_SERVER]:
        return serving.popen(cmd, log_fd, env)
    with open(os.devnull, "rb") as null:
        return _Forked(null.fileno(), log_fd, env, cmd)


class Clock:
    """A module's `time`, moved by the test (monkeypatched over the module's `time`): what
    lapses or goes overdue does so by construction, not by how long a sleep or a round
    trip takes on this machine."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`hybridkv ARGS` as `python -m hybridkv.cli`, forked by the zygote (which has
    imported vLLM: the benchmarks' own engine processes fork from it in turn, each about
    13 s sooner than a fresh interpreter); stdout and stderr together in `stdout`."""
    import sys
    import tempfile

    argv = [sys.executable, "-m", "hybridkv.cli", *args]
    with tempfile.TemporaryFile("w+") as out, open(os.devnull, "rb") as null:
        code = _Forked(null.fileno(), out.fileno(), None, argv).wait()
        out.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), "")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Hypothesis draws from HYBRIDKV_TEST_SEED too (unless --hypothesis-seed is given):
    # a run's examples are the same on any machine, and another seed explores others.
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(SEED)
    try:
        import serving
    except ImportError:  # no serving stack (a lent GPU machine: torch without vLLM)
        return

    serving.start_process = _forked_server


class EngineProc:
    """An engine in a new Python process (see engine_proc.py): forked by the session's
    zygote, or a fresh interpreter with no PYTHONHASHSEED (`fresh`: keys must not
    depend on Python's hash seed, which forked processes share).

    Its output is drained by a thread: processes that wait on each other must never block
    on a full pipe, and a pipe (unlike a file) is not cut short by a file-size limit.
    """

    def __init__(self, spec: dict, fresh: bool = False):
        import json
        import subprocess
        import sys
        import threading

        if fresh:
            self.proc = subprocess.Popen(
                [sys.executable, ENGINE_PROC],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=_child_env(),
            )
            stdin, stdout = self.proc.stdin, self.proc.stdout
        else:
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            try:
                self.proc = _Forked(in_r, out_w)
            finally:
                os.close(in_r)
                os.close(out_w)
            stdin, stdout = os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb")
        self._out: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self._out.extend(line.decode(errors="replace") for line in stdout),
            daemon=True,  # a hung engine must not hold the test process at exit
        )
        self._reader.start()
        with stdin:
            stdin.write(json.dumps(spec).encode())

    def kill(self) -> None:
        """SIGKILL: no exit hook runs, queued writes are lost mid-way."""
        self.proc.kill()
        self.proc.wait()
        self._reader.join()

    def result(self, timeout: float = 600) -> dict:
        import json
        import subprocess

        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()  # a hung engine must not run on through the later tests
            raise
        self._reader.join()
        out = "".join(self._out)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert self.proc.returncode == 0 and lines, f"engine process failed:\n{out[-4000:]}"
        return json.loads(lines[-1][len("RESULT ") :])


def run_engine_proc(spec: dict, fresh: bool = False) -> dict:
    return EngineProc(spec, fresh).result()
