"""A real OpenAI-compatible vLLM server with hybridkv, in a subprocess on loopback.

Why a subprocess: users run hybridkv inside `python -m vllm.entrypoints.openai.api_server`,
where the engine core is its own process, requests arrive concurrently over HTTP, clients
disconnect, and the server is stopped by a signal. The in-process engine tests cannot see
any of that. Used by tests/test_server.py and bench/soak.py, so it imports neither pytest
nor the test fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import httpx
import psutil
from openai import AsyncOpenAI

from hybridkv.engine import TOP_LOGPROBS
from hybridkv.server import server_args

MiB = 1 << 20


def tokens(n: int, seed: int) -> list[int]:
    """Seeded random token ids in [1, 2000): every tiny model's vocabulary holds them."""
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


def drawn_lengths(count: int, seed: int, lo: int = 300, hi: int = 4000) -> list[int]:
    """`count` prompt lengths drawn uniformly from [lo, hi]: a test restores whatever
    length it is given, not lengths chosen because they restore."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(count)]


def last_boundary(prompt_len: int, chunk_tokens: int) -> int:
    """The longest hit a stored prompt can get: its last chunk boundary strictly before
    its last token (vLLM computes that token itself)."""
    return (prompt_len - 1) // chunk_tokens * chunk_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set in a server's environment when the suite's forked API server is to fork its engine
# core and model worker too (tests/engine_proc.py reads it).
FORK_ENGINE = "HYBRIDKV_TEST_FORK_ENGINE"


def server_env(fork_engine: bool = False) -> dict[str, str]:
    """The server's environment: nothing downloaded, POST /reset_prefix_cache available.
    Processes are vLLM's defaults, as users run it: the API server, the engine core, and
    (the CPU platform turns 'uni' into 'mp') the model worker, each in its own.
    `fork_engine`: where the suite forks the API server (conftest), the engine core and
    the worker are forked too rather than spawned (tests/engine_proc.py); set
    HYBRIDKV_TEST_FORK_ENGINE=0 to spawn them everywhere."""
    env = dict(os.environ)
    fork_engine = fork_engine and env.get(FORK_ENGINE) != "0"
    # The test process keeps its own engines in-process (tests/conftest.py); a server
    # inheriting that would run the model worker inside the engine core, a layout no
    # user of the server has.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        **{FORK_ENGINE: "1" if fork_engine else "0"},
    )
    return env


def server_command(
    model: str,
    port: int,
    extra_config: dict[str, Any],
    kv_cache_bytes: int,
    max_num_seqs: int = 16,
    extra_args: tuple[str, ...] = (),
    connector: bool = True,
) -> list[str]:
    """The server's command line (hybridkv.server's, as `hybridkv serve` runs it) on a
    small engine; `connector=False` gives the same server without hybridkv (a baseline)."""
    return server_args(
        model,
        extra_config if connector else None,
        port=port,
        vllm_args=(
            "--skip-tokenizer-init",
            "--enable-prompt-tokens-details",
            "--enforce-eager",
            "--max-model-len",
            "4096",
            "--kv-cache-memory-bytes",
            str(kv_cache_bytes),
            "--max-num-seqs",
            str(max_num_seqs),
            *extra_args,
        ),
    )


def popen(cmd: list[str], log_fd: int, env: dict[str, str]) -> subprocess.Popen:
    """A server process as users start one: output to `log_fd`, in a session of its own."""
    return subprocess.Popen(
        cmd,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


# How `launch` starts a server's process. The test session swaps in one forked from a
# process that has imported vLLM already (tests/conftest.py); the bench scripts keep this.
start_process: Callable[[list[str], int, dict[str, str]], Any] = popen


class ServerDied(RuntimeError):
    pass


@dataclass
class Completion:
    """One finished request: what a client sees."""

    token_ids: list[int]
    cached_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)  # of each chosen token
    top: list[dict[int, float]] = field(default_factory=list)  # as `Generation.top`


# How far a logprob may move when the same request runs in another batch (another
# step's company, a prefix hit one step later): CPU kernels round with the batch shape.
# Measured on an Intel Xeon with AVX-512 (bf16): 0.008 at most on these models, 0 to
# 1e-4 on most prompts; the tiny models' distributions are nearly flat (top logprobs
# about -6.7 over a 2048-token vocabulary), so such a nudge can swap near-tied tokens.
LOGPROB_NOISE = 0.02


def real_difference(a, b, tol: float = LOGPROB_NOISE) -> int | None:
    """Where two greedy generations of one prompt differ by more than batch rounding:
    the first position where the chosen tokens' logprobs, or (where both kept them) the
    best tokens' (`top`: rank by rank, and token by token where both list it), differ
    by more than `tol`; None if none does. Tokens may differ where all of these agree (a
    near tie swapped); from there on the two continue from different text, so the
    comparison stops.

    Why the best tokens and not the chosen one alone: measured on Qwen3-Next and Gemma-3
    (tests/test_engine_serving.py's negative control), output from a wrong prefix (a
    chunk of another prompt's) chose a token within `tol` of the right one's in 2 to 8
    prompts of 40; its best five differed in all but at most one."""
    tops = zip(a.top, b.top, strict=False) if a.top and b.top else repeat(None)
    for i, (ta, tb, la, lb, pair) in enumerate(
        zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, tops, strict=False)
    ):
        if abs(la - lb) > tol or (pair is not None and _best_differ(*pair, tol)):
            return i
        if ta != tb:
            return None
    return None


def _best_differ(x: dict, y: dict, tol: float) -> bool:
    """Whether two positions' best-token logprobs differ by more than `tol`: the k best
    rank by rank, and every token both list."""
    k = min(len(x), len(y), TOP_LOGPROBS)
    best_x, best_y = sorted(x.values(), reverse=True)[:k], sorted(y.values(), reverse=True)[:k]
    ranked = zip(best_x, best_y, strict=True)
    return any(abs(p - q) > tol for p, q in ranked) or any(
        abs(x[t] - y[t]) > tol for t in x.keys() & y.keys()
    )


_RECORD = re.compile(r"^\((?P<proc>[^)]*)\) (?P<level>[A-Z]+) \S+ \S+ \[(?P<site>[^\]]+)\]")
_STATS = re.compile(r"hybridkv stats (\{.*\})\s*$")
_CHUNK = re.compile(r"hybridkv: scheduler side, chunk (\d+) tokens")
_SHUTDOWN = "[shutdown] API server: shutdown triggered"


def _record_key(line: str) -> tuple[str, str, str] | None:
    """(process, level, file:line) of a vLLM log line; None for raw output."""
    m = _RECORD.match(line)
    return (m["proc"], m["level"], m["site"]) if m else None


def log_records(lines: list[str]) -> list[list[str]]:
    """Group lines into records: vLLM prefixes every line of a multi-line record (a
    traceback) with the same process, level and file:line; other lines stand alone."""
    records: list[list[str]] = []
    prev = None
    for ln in lines:
        key = _record_key(ln)
        if key is not None and key == prev:
            records[-1].append(ln)
        else:
            records.append([ln])
        prev = key
    return records


def _harmless(record: list[str], after_shutdown: bool) -> bool:
    """Records that look like failures and are not:
    - --skip-tokenizer-init makes the chat-template warm-up log a traceback at WARNING
      (the quickstart notes it);
    - on SIGTERM, the API server's output handler may log the engine core's exit as
      EngineDeadError once shutdown has begun (a race in vLLM's shutdown; seen with and
      without a clean engine-core exit log)."""
    key = _record_key(record[0])
    if key is None:
        return False
    _, level, _ = key
    if level == "WARNING" and "Chat template warmup failed" in record[0]:
        return True
    return (
        after_shutdown
        and level == "ERROR"
        and "AsyncLLM output_handler failed" in record[0]
        and "EngineDeadError" in record[-1]
    )


def log_problems(lines: list[str]) -> list[str]:
    """Lines of a server log that report an error (' ERROR ', 'CRITICAL', a traceback),
    outside the known harmless records."""
    bad = []
    after_shutdown = False
    for record in log_records(lines):
        after_shutdown = after_shutdown or any(_SHUTDOWN in ln for ln in record)
        if _harmless(record, after_shutdown):
            continue
        bad += [ln for ln in record if " ERROR " in ln or "CRITICAL" in ln or "Traceback" in ln]
    return bad


def hybridkv_stats(lines: list[str]) -> list[dict[str, Any]]:
    """Every `hybridkv stats {json}` record in the log, oldest first (none if hybridkv
    does not log them)."""
    out = []
    for ln in lines:
        m = _STATS.search(ln)
        if m:
            try:
                out.append(json.loads(m.group(1)))
            except json.JSONDecodeError:
                continue
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum over its label sets}."""
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if not ln or ln.startswith("#"):
            continue
        name_labels, _, value = ln.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Server:
    """A running api_server subprocess (its own process group) and its log file. `proc`
    is a `subprocess.Popen` or what the tests fork instead (`start_process`)."""

    model: str
    port: int
    log_path: Path
    proc: Any
    command: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def client(self, timeout: float = 600) -> AsyncOpenAI:
        """No retries: a failed request must show as a failure, not be hidden by a retry.
        No kept-alive connections: the server closes idle ones after 5 s, and a request
        sent on one it is closing fails with a connection error that is not the server's."""
        http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            timeout=timeout,
        )
        return AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key="none",
            max_retries=0,
            timeout=timeout,
            http_client=http,
        )

    def log_lines(self, start: int = 0) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[start:]

    def chunk_tokens(self) -> int:
        """hybridkv's chunk, from its start-up line in the log."""
        for ln in self.log_lines():
            if m := _CHUNK.search(ln):
                return int(m[1])
        raise AssertionError(f"no hybridkv start-up line in {self.log_path}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_lines()[-n:])

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerDied(f"server exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def reset_prefix_cache(self, timeout: float = 60) -> None:
        """Empty vLLM's own prefix cache, so the next hit must come from hybridkv. vLLM
        refuses (`success: false`) while any block is held, and a finished request's
        blocks are held until hybridkv reports its stores landed, a step after its
        output went out (vLLM's delayed free): so ask until it succeeds."""
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(self.base_url + "/reset_prefix_cache", timeout=60)
            r.raise_for_status()
            if r.json().get("success", True):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM kept refusing to reset its prefix cache: {r.text}")
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.base_url + "/metrics", timeout=30)
        r.raise_for_status()
        return parse_metrics(r.text)

    async def ametrics(self) -> dict[str, float]:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(self.base_url + "/metrics")
            r.raise_for_status()
            return parse_metrics(r.text)

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory of the server and of each of its children (engine core,
        workers), by "name:pid"."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out = {}
        for p in procs:
            try:
                out[f"{p.name()}:{p.pid}"] = p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return out

    def stop(self, grace: float = 60) -> int | None:
        """SIGTERM (vLLM shuts the engine core down and hybridkv drains its disk queue),
        then SIGKILL to the whole process group if it is still up after `grace` s.
        Returns the server's exit code (None if it had to be killed)."""
        graceful = True
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                graceful = False
        self._kill_group()
        self.proc.wait()
        return self.proc.returncode if graceful else None

    def _kill_group(self) -> None:
        """The server started its own session: its pgid is its pid. Leftover children
        (an engine core orphaned by a crash) go with it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_server(
    model: str,
    log_path: Path,
    extra_config: dict[str, Any] | None = None,
    kv_cache_bytes: int = 64 * MiB,
    max_num_seqs: int = 16,
    extra_args: tuple[str, ...] = (),
    timeout: float = 300,
    connector: bool = True,
    fork_engine: bool = True,
) -> Server:
    """A server (`server_command`) on a free port, started by `launch`."""
    extra = {"cpu_bytes": "256MiB", **(extra_config or {})}
    port = free_port()
    cmd = server_command(model, port, extra, kv_cache_bytes, max_num_seqs, extra_args, connector)
    return launch(cmd, model, port, log_path, timeout, fork_engine)


def launch(
    cmd: list[str],
    model: str,
    port: int,
    log_path: Path,
    timeout: float = 300,
    fork_engine: bool = False,
) -> Server:
    """Run a server command line (in a session of its own, output to `log_path`) and
    wait for /health on `port`; a start that fails is cleaned up and raises with the
    log's tail. `fork_engine`: see `server_env`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = start_process(cmd, log.fileno(), server_env(fork_engine))
    server = Server(model, port, log_path, proc, cmd)
    try:
        server.wait_healthy(timeout)
    except BaseException:
        server.stop(grace=10)
        raise
    return server


async def complete(
    client: AsyncOpenAI,
    model: str,
    prompt: list[int],
    max_tokens: int = 16,
    **extra: Any,
) -> Completion:
    """One greedy completion of a token-id prompt; `extra` goes to vLLM's extra_body."""
    r = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=TOP_LOGPROBS,
        # The test servers load no tokenizer: logprobs name their tokens by id.
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, **extra},
    )
    choice = r.choices[0]
    details = r.usage.prompt_tokens_details if r.usage else None
    return Completion(
        token_ids=list(getattr(choice, "token_ids", None) or []),
        cached_tokens=(details.cached_tokens or 0) if details else 0,
        prompt_tokens=r.usage.prompt_tokens if r.usage else len(prompt),
        finish_reason=choice.finish_reason,
        logprobs=list(choice.logprobs.token_logprobs) if choice.logprobs else [],
        top=[_by_id(best) for best in choice.logprobs.top_logprobs or []]
        if choice.logprobs
        else [],
    )


def _by_id(best: dict[str, float]) -> dict[int, float]:
    """A position's best tokens, named "token_id:N" by a server with no tokenizer."""
    return {int(name.rpartition(":")[2]): lp for name, lp in best.items()}


async def stream_then_close(
    client: AsyncOpenAI, model: str, prompt: list[int], after: int, max_tokens: int = 64
) -> int:
    """A client that reads `after` streamed chunks and hangs up; returns chunks read."""
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    read = 0
    try:
        async for _ in stream:
            read += 1
            if read >= after:
                break
    finally:
        await stream.close()
    return read


async def cancel_after(coro: Any, delay: float) -> bool:
    """Run `coro` and cancel it after `delay` s (a client that gives up); True if it was
    cancelled before finishing."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=delay)
    if done:
        task.exception()  # retrieve, so a failure is not reported as never retrieved
        return False
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return True


async def gather_all(coros: list[Any]) -> list[Any]:
    """All at once; exceptions are returned in place, so every failure can be counted."""
    return await asyncio.gather(*coros, return_exceptions=True)
