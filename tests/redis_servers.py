"""Real `redis-server` processes on loopback ports, for the Redis tier's tests and
bench/redis_load.py: one server, which can be killed and started again on its port, and
a three-master Redis Cluster. Each lives in its own temporary directory and persists
nothing (`--save '' --appendonly no`), so a restart comes back empty.

Debian's `redis-server` package provides both binaries (`make setup` installs it where it
can); `require_redis()` skips a test where it is missing.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
_START_SECONDS = 10.0


def require_redis() -> None:
    """Skip the calling test where the Redis binaries are not installed."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        import pytest

        pytest.skip("redis-server / redis-cli not on PATH (Debian: apt-get install redis-server)")


def free_port(cluster: bool = False) -> int:
    """A loopback port nothing listens on right now (another process may take it before
    the server binds: `RedisServer.start` then tries another). A cluster node also needs
    its bus port, 10000 above, so its port must be at most 55535."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", random.randrange(20000, 55536) if cluster else 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        with contextlib.suppress(OSError), socket.socket() as bus:
            bus.bind(("127.0.0.1", port + 10000))
            return port


class RedisServer:
    """One `redis-server` on 127.0.0.1; `args` are extra server options, such as
    `("--maxmemory", "1mb")`. `cluster`: a cluster node, not yet in any cluster."""

    def __init__(self, workdir: Path, *args: str, cluster: bool = False):
        self.dir = workdir
        self.args = args
        if cluster:
            self.args += ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
            self.args += ("--cluster-node-timeout", "5000")
        self._cluster = cluster
        self.port = free_port(cluster)
        self._started = False
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client, for the tests to look behind the tier's back."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        """Start (again, on the same port) and wait until it answers PING."""
        for _ in range(5):
            if self._launch():
                self._started = True
                return self
            if self._started:
                break  # a restart keeps its port: clients know it
            self.port = free_port(self._cluster)  # someone took the port meanwhile
        raise RuntimeError(f"redis-server did not start on port {self.port}: {self._log()}")

    def _launch(self) -> bool:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the server owns it
        self.proc = subprocess.Popen(
            [REDIS_SERVER or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", "--dir", str(self.dir), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + _START_SECONDS
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if client.ping():
                        return True
                time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        return False

    def stop(self) -> None:
        """Stop the server (nothing is saved, so it comes back empty)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as a crashed or OOM-killed one does."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def _log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        return ""


@contextlib.contextmanager
def redis_server(*args: str, workdir: Path | None = None) -> Iterator[RedisServer]:
    """A started server, stopped (and its directory removed) on exit."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="redis-")))
        server = RedisServer(workdir, *args)
        stack.callback(server.stop)
        yield server.start()


@contextlib.contextmanager
def redis_cluster(masters: int = 3, workdir: Path | None = None) -> Iterator[list[RedisServer]]:
    """A Redis Cluster of `masters` masters and no replicas, ready (`cluster_state:ok`
    on every node); stopped on exit. Connect through any node's `url`."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="redis-")))
        nodes = []
        for i in range(masters):
            node = RedisServer(workdir / f"node{i}", cluster=True)
            stack.callback(node.stop)
            nodes.append(node.start())
        subprocess.run(
            [REDIS_CLI or "redis-cli", "--cluster", "create"]
            + [f"127.0.0.1:{n.port}" for n in nodes]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        for node in nodes:
            client = node.client()
            while client.cluster("INFO").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster on port {node.port} never became ok")
                time.sleep(0.05)
            client.close()
        yield nodes
