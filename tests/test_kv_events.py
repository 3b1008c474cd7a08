"""KV cache events through vLLM's own publisher, read the way routers read them: a real
API server with `--kv-events-config` (ZMQ over an ipc socket, so nothing leaves this
machine) and a subscriber decoding vLLM's `KVEventBatch` with vLLM's own types.

What a router must be able to rely on (src/hybridkv/vllm/kv_events.py):
- a stored prompt's resumable blocks are announced on hybridkv's media (CPU, and STORAGE
  once the disk tier holds them) with the very hashes vLLM's own GPU events give them;
- `reset_prefix_cache` removes vLLM's own blocks, not hybridkv's, which still restore;
- a boundary's state leaving CPU memory retracts the blocks only it made resumable;
- a scorer that counts each replica's announced blocks along a prompt (as llm-d's
  precise prefix-cache scorer does) picks the replica that then restores the most.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import SEED
from serving import MiB, Server, complete, drawn_lengths, last_boundary, start_server, tokens

pytestmark = pytest.mark.engine

TOPIC = "kv"


class EventStream:
    """A SUB socket on a server's event endpoint, decoded by a thread into a list."""

    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _, _, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(self._decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def events_config(path: Path) -> tuple[str, str]:
    """vLLM's publisher binds an ipc endpoint (docs: a host endpoint would connect)."""
    endpoint = f"ipc://{path}"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    return endpoint, json.dumps({**cfg, "topic": TOPIC})


class Replica:
    """A server with hybridkv and KV events, and the stream of its events."""

    def __init__(self, model: str, root: Path, name: str, extra: dict[str, Any]) -> None:
        endpoint, cfg = events_config(root / f"{name}.sock")
        self.server = start_server(
            model,
            root / f"{name}.log",
            extra,
            kv_cache_bytes=32 * MiB,
            extra_args=("--kv-events-config", cfg),
        )
        self.stream = EventStream(endpoint)

    def run(self, prompt: list[int], max_tokens: int = 2) -> int:
        """One request to the end; its cached tokens."""

        async def go() -> int:
            async with self.server.client() as client:
                c = await complete(client, self.server.model, prompt, max_tokens=max_tokens)
                return c.cached_tokens

        return asyncio.run(go())

    def wait(self, what: str, ok: Callable[[], bool], timeout: float = 120) -> None:
        """Until `ok()`: events come out per engine step, and lower tiers report their
        writes in later steps, so one-token requests keep the engine stepping."""
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, f"no {what} in {len(self.stream.events)} events"
            self.run([3, 1, 4], max_tokens=1)
            time.sleep(0.2)

    def close(self) -> None:
        self.stream.close()
        self.server.stop()


def side_by_side(model: str, root: Path, names: tuple[str, ...], extra: dict[str, Any]) -> list:
    """Replicas started at once: a start is mostly one process importing at a time, so two
    overlap on two cores. If one fails to start, the others are closed and it raises."""
    with ThreadPoolExecutor(len(names)) as pool:
        futures = [pool.submit(Replica, model, root, name, extra) for name in names]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for r in started:
            r.close()
        raise failed[0]
    return started


def ours(events: list[Any], medium: str, stored: bool = True, group: int | None = None) -> list:
    """hybridkv's block hashes stored (or removed) on `medium`, in order."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    kind = BlockStored if stored else BlockRemoved
    return [
        h
        for e in events
        if isinstance(e, kind)
        and e.medium == medium
        and getattr(e, "ownership", None) == "hybridkv"
        and (group is None or e.group_idx == group)
        for h in e.block_hashes
    ]


def gpu_blocks(events: list[Any]) -> dict[int, tuple[str, list]]:
    """vLLM's own GPU events: group -> (kind, block hashes in order)."""
    from vllm.distributed.kv_events import BlockStored

    out: dict[int, tuple[str, list]] = {}
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "GPU":
            kind, hashes = out.setdefault(e.group_idx, (e.kv_cache_spec_kind, []))
            hashes.extend(e.block_hashes)
    return out


def group_sizes(srv: Server) -> tuple[int, list[tuple[str, int]]]:
    """hybridkv's chunk and each group's (kind, bytes of one entry), from its start-up
    line."""
    for ln in srv.log_lines():
        m = re.search(r"hybridkv: scheduler side, chunk (\d+) tokens, groups (\[.*\])", ln)
        if m:
            chunk = int(m[1])
            groups = re.findall(r"\('(\w+)', (\d+), (\d+)\)", m[2])
            return chunk, [(k, int(b) * chunk // int(t)) for k, t, b in groups]
    raise AssertionError(f"no hybridkv start-up line in {srv.log_path}")


@pytest.fixture(params=["qwen3-next", "gemma3"])
def replica(request, model_dirs, tmp_path) -> Iterator[tuple[str, Replica]]:
    arch = request.param
    r = Replica(
        model_dirs[arch],
        tmp_path,
        arch,
        {"cpu_bytes": "256MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "1GiB"},
    )
    try:
        yield arch, r
    finally:
        r.close()


def block_size_of(events: list[Any], group: int) -> int:
    return next(e.block_size for e in events if getattr(e, "group_idx", None) == group)


def test_a_stored_prompt_is_announced_with_vllms_hashes_and_outlives_a_reset(replica):
    """A prompt of a drawn length: hybridkv announces, on CPU and then on STORAGE, the
    full-attention blocks up to its last boundary (hashes equal to vLLM's own GPU events
    for the same blocks) and, per group, the state and window blocks a hit there reads.
    `reset_prefix_cache` clears vLLM's own; hybridkv removes nothing and restores."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    arch, r = replica
    (length,) = drawn_lengths(1, seed=SEED * 100 + 30, lo=600, hi=2000)
    prompt = tokens(length, SEED * 100 + 31)
    assert r.run(prompt) == 0
    chunk, sizes = group_sizes(r.server)
    B = last_boundary(length, chunk)
    r.wait("GPU events", lambda: len(gpu_blocks(r.stream.events)) == len(sizes))
    gpu = gpu_blocks(r.stream.events)
    full = next(g for g, (kind, _) in gpu.items() if kind == "full_attention")
    expected = gpu[full][1][: B // block_size_of(r.stream.events, full)]
    # Blocks arrive on STORAGE as the disk tier reports its writes, boundary by boundary:
    # wait until every group has announced as many blocks as it will, then compare.
    counts = {g: 1 if kind == "mamba" else len(expected) for g, (kind, _) in gpu.items()}
    for medium in ("CPU", "STORAGE"):
        r.wait(
            f"{medium} events",
            lambda m=medium: all(
                len(ours(r.stream.events, m, group=g)) >= n for g, n in counts.items()
            ),
        )
    events = list(r.stream.events)
    for medium in ("CPU", "STORAGE"):
        assert ours(events, medium, group=full) == expected, (medium, length, B)
        for g, (kind, hashes) in gpu.items():
            if kind == "mamba":  # the state at B: vLLM's hash of the block ending there
                assert ours(events, medium, group=g) == [hashes[-1]], (medium, g)
            elif kind == "sliding_window":  # the windows of every boundary up to B, in
                # the order their boundaries became restorable there (disk writes land
                # in any order); the full-attention blocks always come root first
                got = ours(events, medium, group=g)
                assert sorted(got) == sorted(expected) and len(set(got)) == len(got), (medium, g)

    before = len(r.stream.events)
    r.server.reset_prefix_cache()
    assert r.run(prompt) == B  # restored by hybridkv
    r.wait(
        "vLLM's own reset",
        lambda: any(
            isinstance(e, AllBlocksCleared) or (isinstance(e, BlockRemoved) and e.medium == "GPU")
            for e in r.stream.events[before:]
        ),
    )
    assert not ours(r.stream.events[before:], "CPU", stored=False)
    assert not ours(r.stream.events[before:], "STORAGE", stored=False)


@pytest.fixture(scope="module")
def qwen_entries(model_dirs) -> tuple[int, list[tuple[str, int]]]:
    """Qwen3-Next's chunk and each group's (kind, bytes of one entry), from an in-process
    engine's planner: a test sizes a server's CPU budget from them before starting it."""
    from hybridkv.engine import make_llm, scheduler_connector, shutdown

    llm = make_llm(model_dirs["qwen3-next"], {"cpu_bytes": "64MiB"}, kv_cache_bytes=32 * MiB)
    try:
        planner = scheduler_connector(llm).planner
        groups = [(g.kind.value, planner.entry_bytes(i)) for i, g in enumerate(planner.groups)]
        return planner.chunk_tokens, groups
    finally:
        shutdown(llm)


def test_a_state_leaving_cpu_memory_retracts_the_blocks_past_the_previous_boundary(
    model_dirs, tmp_path, qwen_entries
):
    """A document (boundary at two chunks) and two questions on it (boundaries at three)
    fill a CPU budget sized to hold just them; an unrelated prompt then needs room, and
    hybridkv evicts the older question's boundary (a leaf: its states and the chunk only
    it needed; the document, a branch point, stays). Its blocks past two chunks are
    retracted on CPU, the document's are not: it still resumes both questions' shared
    prefix. Lengths are in parts of a chunk, which differs by machine: vLLM's CPU build
    keeps recurrent states in float32 where the CPU has AVX-512 BF16 (256-token chunks
    here), in bfloat16 elsewhere (128)."""
    chunk, groups = qwen_entries
    states = sum(b for kind, b in groups if kind == "state")
    attention = sum(b for kind, b in groups if kind != "state")
    held = (2 * attention + states) + 2 * (attention + states)  # the document, 2 questions
    budget = held + (attention + states) // 2  # the unrelated prompt does not fit beside
    r = Replica(model_dirs["qwen3-next"], tmp_path, "tight", {"cpu_bytes": str(budget)})
    try:
        # The document ends within its third chunk, the questions within their fourth.
        doc = tokens(2 * chunk + chunk * 11 // 32, SEED * 100 + 40)
        q1 = doc + tokens(chunk + chunk * 11 // 64, SEED * 100 + 41)
        q2 = doc + tokens(chunk + chunk * 11 // 64, SEED * 100 + 42)
        for p in (doc, q1, q2):
            r.run(p)
        full = next(g for g, (kind, _) in enumerate(groups) if kind == "full")
        bs = block_size_of(r.stream.events, full) if r.stream.events else chunk
        r.wait(
            "the questions' blocks", lambda: len(set(ours(r.stream.events, "CPU", group=full))) >= 4
        )
        hashes = prompt_hashes(q1, bs)
        q1_own = hashes[2 * chunk // bs : 3 * chunk // bs]
        doc_blocks = hashes[: 2 * chunk // bs]
        before = len(r.stream.events)
        r.run(tokens(chunk + chunk * 11 // 64, SEED * 100 + 43))
        r.wait("a retraction", lambda: bool(ours(r.stream.events[before:], "CPU", stored=False)))
        removed = ours(r.stream.events[before:], "CPU", stored=False, group=full)
        assert set(removed) == set(q1_own), (removed, q1_own)
        assert not set(removed) & set(doc_blocks)
        assert r.run(q2) == 3 * chunk  # q2's boundary and the document stayed
    finally:
        r.close()


def prompt_hashes(prompt: list[int], block_size: int) -> list[Any]:
    """vLLM's block hashes of a prompt, as a router computes them from token ids (sha256,
    vLLM's default, has a fixed seed: every process gets the same)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kvu

    fn = get_hash_fn_by_name("sha256")
    kvu.init_none_hash(fn)
    out, parent = [], None
    for i in range(len(prompt) // block_size):
        parent = kvu.hash_block_tokens(fn, parent, prompt[i * block_size : (i + 1) * block_size])
        out.append(kvu.maybe_convert_block_hash(parent))
    return out


def announced_prefix(events: list[Any], hashes: list[Any]) -> int:
    """Blocks of a prompt a prefix-cache scorer credits a replica with: the leading run
    of its block hashes the replica announces as stored on any medium and not removed
    since (llm-d's precise scorer counts them the same way)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    held: dict[Any, set[str]] = {}
    for e in events:
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                held.setdefault(h, set()).add(e.medium)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                held.get(h, set()).discard(e.medium)
        elif isinstance(e, AllBlocksCleared):
            for media in held.values():
                media.discard("GPU")
    n = 0
    while n < len(hashes) and held.get(hashes[n]):
        n += 1
    return n


def test_a_scorer_on_the_events_picks_the_replica_that_restores_most(model_dirs, tmp_path):
    """Two replicas of Qwen3-Next: one has served a long prompt, the other only its first
    part; both have had vLLM's own cache reset, so only hybridkv holds anything. A scorer
    that counts each replica's announced blocks along a new prompt extending the long one
    picks the first; sent to both, the new prompt restores more there."""
    a, b = side_by_side(model_dirs["qwen3-next"], tmp_path, ("a", "b"), {"cpu_bytes": "256MiB"})
    try:
        try:
            (length,) = drawn_lengths(1, seed=SEED * 100 + 50, lo=1100, hi=2500)
            long = tokens(length, SEED * 100 + 51)
            a.run(long)
            b.run(long[: length // 2])
            for r in (a, b):
                r.server.reset_prefix_cache()
            new = long + tokens(300, SEED * 100 + 52)
            chunk, _ = group_sizes(a.server)
            a.wait("a's blocks", lambda: bool(ours(a.stream.events, "CPU")))
            b.wait("b's blocks", lambda: bool(ours(b.stream.events, "CPU")))
            hashes = prompt_hashes(new, chunk)
            scores = {r: announced_prefix(r.stream.events, hashes) for r in (a, b)}
            picked = max(scores, key=scores.get)
            restored = {r: r.run(new) for r in (a, b)}
            assert picked is a and scores[a] > scores[b] > 0, scores
            assert restored[a] == scores[a] * chunk > restored[b] == scores[b] * chunk
        finally:
            b.close()
    finally:
        a.close()


def test_block_hashes_go_out_as_ints_where_vllm_is_asked_to(monkeypatch):
    """With `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` (vLLM's default; read once per step)
    every hash goes out as the int vLLM's own conversion makes of it; set to 0, as vLLM's
    bytes, unchanged."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from hybridkv.vllm.kv_events import _Payload

    hashes = [bytes(range(i, i + 32)) for i in range(3)] + [b"\xff" * 8, b"\x01" * 16]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    for width in (32, 8, 16):
        same = [h for h in hashes if len(h) == width]
        p = _Payload(0, b"".join(same), width, None, b"", 16, None, None, None)
        assert p.block_hashes(False) == same
        ints = p.block_hashes(True)
        assert ints == [maybe_convert_block_hash(h) for h in same]
        assert all(isinstance(h, int) for h in ints)


@pytest.mark.parametrize("kinds", [("state",), ("sliding", "state")])
def test_a_layout_without_full_attention_keeps_no_chunk_nodes(monkeypatch, kinds):
    """With no full-attention group no chunk has entries to announce and no boundary
    hangs on a chunk: the events register no chunks at all (they were registered and
    never freed, one per distinct chunk stored, for good). Model-free: a real index,
    planner and vLLM requests; 200 distinct prompts stored, then all evicted."""
    import types

    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    from hybridkv.core import resumable
    from hybridkv.core.index import StoreIndex
    from hybridkv.core.keys import extend_chain, group_key
    from hybridkv.core.layout import GroupKind, GroupSpec, Layout
    from hybridkv.core.planner import Planner
    from hybridkv.vllm.kv_events import KVEvents

    monkeypatch.setattr(resumable, "DORMANT_LIMIT", 8)
    init_none_hash(sha256)
    bs, window = 16, 32
    specs = {
        "sliding": SlidingWindowSpec(
            block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=window
        ),
        "state": MambaSpec(
            block_size=bs, shapes=((4,),), dtypes=(torch.float16,), mamba_cache_mode="align"
        ),
    }
    groups = tuple(
        GroupSpec(GroupKind(k), bs, 100, (f"l{i}",), window if k == "sliding" else None)
        for i, k in enumerate(kinds)
    )
    planner = Planner(groups)
    index = StoreIndex(1 << 30, 1, False, recurrent=True)
    kcc = types.SimpleNamespace(
        hash_block_size=bs,
        kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=specs[k]) for k in kinds],
    )
    events = KVEvents(Layout("m", groups), planner, kcc, index, disk=False)
    index.listener = events
    C = planner.chunk_tokens
    hasher = get_request_block_hasher(bs, sha256)
    for p in range(200):
        tokens = [p * 1000 + i for i in range(4 * C + 1)]
        keys = extend_chain([], b"s" * 16, tokens, C, None, len(tokens))
        windows = [
            group_key(keys[c], g) for c in range(4) for g, k in enumerate(kinds) if k != "state"
        ]
        for e in windows:
            assert index.admit(e, 100)
        states = [(group_key(keys[3], g), 100) for g, k in enumerate(kinds) if k == "state"]
        assert index.admit_boundary(states, windows, 4 * C, 100)
        req = Request(f"r{p}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        events.observe(req, keys, [4 * C])
        events.take()
    assert events.tracker.sizes()["shown"] > 0  # the boundaries were announced
    index.evict_all()
    events.take()
    sizes = events.tracker.sizes()
    assert sizes["nodes"] == 0 and sizes["boundaries"] <= 8, sizes
