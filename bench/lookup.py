"""Scheduler-side cost of a lookup and of the eviction policy for a long prompt (issue 4:
"well under a millisecond per chunk" at 32k tokens; issue 12: "policy overhead well
under 1 ms per lookup of a 32k-token prompt").

The lookup is hybridkv's own `SchedulerSide.num_new_matched_tokens` on a real vLLM
`Request` (no engine): chain keys over the prompt, the hit rule against the scheduler
side's index, the pins and recency updates of the hit, the branch-point measure. It
never touches an entry's bytes, so no tier takes part. The layout is Qwen3-Next's shape
(one full-attention group, three recurrent groups, 256-token chunks).

Cases: nothing stored; the whole prompt stored (a hit to its checkpoint; a request's
chain keys are computed at its first lookup and reused by the next); the whole prompt on
disk only, asked again while its promotions are under way (what the scheduler asks of
every waiting request in every step of a restore); and admitting one
boundary into a CPU budget full of others (`StoreIndex.admit_boundary`, which picks what
to evict by the policy), at several numbers of boundaries held.

Production scale (issue 27: "a scheduler side that stays under a millisecond with a
million entries"): a serving stream through the real `SchedulerSide` at 10k, 100k and 1M
entries (`--serve-entries`; about a tenth of them boundaries): conversations on shared
system prompts, each turn a longer prompt, looked up (chain keys, hit rule, pins,
touches; entries CPU memory lost are found again in a shared tier by the real `Probe`,
whose answers become hints, and promoted), stored the next step (`_admit`: chunks pinned
while the request runs, the boundary at the prompt's checkpoint and at its branch point,
evictions by the policy) and finished a few steps later (pins released); each step also
takes the index's orders and applies the workers' reports of the promotions, as
`build_meta` and `update_connector_output` do. The stream fills CPU memory first (its
longest step reported: the index's tables grow then), then every scheduler-side call of
each of `--serve-steps` steps is timed: p50, p99 and max of a step, with and without the
chain keys of new prompts (timed on their own: blake3 over the
prompt, about 0.3 ms for 24k tokens whatever the index holds, or over its tail where it
extends a prompt keyed lately, found by vLLM's block hashes: core/keys.py's `ChainMemo`);
for scale, the requests built with those block hashes, as vLLM's engine core builds them
before its scheduler sees them (`vllm_request_hashes`, timed apart); and one full
collection of the garbage collector at the end (`serving`). Memory: a second run of the
same fill under tracemalloc; what code of hybridkv and of
sortedcontainers allocated and still holds, per entry in CPU memory (the chain memo
keeps none of vLLM's block hashes alive since it keys them by a tag in a native table; a
source older than that kept them, 4 bytes an entry, not counted here). Run it against
another source with `PYTHONPATH=<its src>` (the "before" of docs/benchmarks.md).

`--events`: the stream with vLLM's KV cache events on, as `--kv-events-config` turns them
on for routers: every boundary stored is told to the events (vllm/kv_events.py), which
keep each entry's payload (its blocks' hashes and tokens) while it can be announced, and
the step's events are taken every step, as vLLM's scheduler takes them. The memory
figure then misses what the tracker's dataclasses allocate in their generated `__init__`
(tracemalloc files it under `<string>`, outside the filter).

`--step-tokens N`: the stream's prefills capped at N tokens a step, as vLLM's token budget
spreads a long prompt's prefill, and so its stores, over several steps (by default each
prefill stores everything in the step after its lookup). It counts the prefills split so,
and the most waiting at once: a budget below what the stream asks a step on average
(about 2,000 tokens) leaves a backlog that grows without end, which measures an
overloaded server, not the scheduler side.
`--row-growth N`: the boundary table grown to N rows, its longest addition (`row_growth`).
`--phases N`: where a step's time goes at N entries, over all steps and the slowest 2 %
(`phases`).
`--gc N`: full collections of the garbage collector at N entries, every 1,000 steps
(`collections`).
`--slowest N`: what the slowest of --serve-steps steps did at N entries: the collector's
pauses, evictions and stores in them (`slowest`).
`--memo-bytes N`: the chain memo's bound in the stream (the engine's by default); the
stream reports the chunks the memo recalled per chunk keyed, and the bytes it holds.
The stream keeps an open conversation per 50 entries, so a bound scaled with the entries
(2.4 MiB at 100,000 for the engine's 24 MiB at a million) models the larger stream.

    .venv/bin/python bench/lookup.py --prompt-tokens 32768
    .venv/bin/python bench/lookup.py --serve-entries 10000 100000 1000000
    .venv/bin/python bench/lookup.py --row-growth 100000 1000000
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from common import RESULTS

from hybridkv.core.boundary_graph import KEY_WIDTH, Boundaries
from hybridkv.core.index import StoreIndex, WorkerReport
from hybridkv.core.keys import ChainMemo, chunk_keys, group_key
from hybridkv.core.keytable import KeyTable
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import EntryCopy, Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.core.probe import Probe
from hybridkv.core.tracked import references_followed
from hybridkv.vllm.metadata import KeyedCopy
from hybridkv.vllm.scheduler_side import SchedulerSide

BLOCK = 256
ATTN_BYTES, STATE_BYTES = 1024, 512  # per entry: the bookkeeping is measured, not bytes


def layout() -> Layout:
    full = GroupSpec(GroupKind.FULL, BLOCK, ATTN_BYTES, ("attn.3",))
    states = [GroupSpec(GroupKind.STATE, BLOCK, STATE_BYTES, (f"gdn.{i}",)) for i in range(3)]
    return Layout("bench/lookup", (full, *states))


def request(req_id: str, prompt: list[int], block_hasher: Callable | None = None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=block_hasher)


def vllm_hasher(block: int) -> Callable:
    """vLLM's block hasher (default `sha256`) for blocks of `block` tokens: vLLM hashes a
    hybrid model's prompt at the GCD of its groups' block sizes (this layout's chunk), a
    model with attention alone at its block size (16)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    sha256 = get_hash_fn_by_name("sha256")
    init_none_hash(sha256)
    return get_request_block_hasher(block, sha256)


def kv_events(side: SchedulerSide) -> object:
    """vLLM's KV cache events on the scheduler side, as `--kv-events-config` turns them
    on: for a KV cache config shaped like this layout (one attention group, three GDN
    state groups, blocks of a chunk)."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from hybridkv.vllm.kv_events import KVEvents

    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    gdn = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 64), (4, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=attn.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    groups = [KVCacheGroupSpec(["attn.3"], attn)]
    groups += [KVCacheGroupSpec([f"gdn.{i}"], gdn) for i in range(3)]
    config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="NHD"
    )
    config.hash_block_size = BLOCK
    events = KVEvents(side.layout, side.planner, config, side.index, disk=False)
    side.events = side.index.listener = events
    return events


def vllm_request_hashes(prompt: list[int], block: int) -> object:
    """What vLLM's engine core does for every new request before the scheduler sees it:
    a `Request` with its block hashes, blocks of `block` tokens."""
    return request("vllm", prompt, vllm_hasher(block))


def side_with(capacity: int, disk: bool = False) -> SchedulerSide:
    lay = layout()
    planner = Planner(lay.groups)
    index = StoreIndex(capacity, disk=disk, recurrent=True)
    policy = CheckpointPolicy("prompt_and_end", planner.chunk_tokens)
    tiers = [("disk", 1.0)] if disk else []
    return SchedulerSide(lay, planner, policy, index, enabled=True, below=disk, tiers=tiers)


def store_prompt(side: SchedulerSide, req, keys: list[bytes]) -> None:
    """Every full-attention chunk of the prompt and the states at its checkpoint, as a
    cold run admits them."""
    planner, index = side.planner, side.index
    ckpt = planner.max_hit_chunks(req.num_prompt_tokens)
    for c in range(ckpt):
        assert index.admit(group_key(keys[c], 0), ATTN_BYTES)
    states = [(group_key(keys[ckpt - 1], g), STATE_BYTES) for g in (1, 2, 3)]
    needs = [group_key(keys[c], 0) for c in range(ckpt)]
    assert index.admit_boundary(states, needs, ckpt * BLOCK, 3 * STATE_BYTES)


def samples(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of each of `n` calls."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of a call, after a warm-up call."""
    fn()
    return statistics.median(samples(fn, repeats))


def admission_cost(held: int, count: int) -> tuple[float, float, float]:
    """Seconds to admit one boundary (two chunks, three states) into a CPU budget
    holding `held` such boundaries on chains of two (one of each pair superseded): the
    first admission that needs room, then the mean and longest of `count` more, each of
    which chooses its victims (an eviction frees what the admission needs, no more)."""
    per = 2 * ATTN_BYTES + 3 * STATE_BYTES
    index = StoreIndex(held * per, recurrent=True)
    n = 0

    def add() -> None:
        nonlocal n
        chain = (n // 2).to_bytes(8, "little")
        c = n % 2
        key = lambda ch, g: group_key(chain + ch.to_bytes(8, "little"), g)  # noqa: E731
        for ch in (2 * c, 2 * c + 1):
            index.admit(key(ch, 0), ATTN_BYTES)
        parent = index.boundary_id(key(1, 1)) if c else None
        states = [(key(2 * c + 1, g), STATE_BYTES) for g in (1, 2, 3)]
        needs = [key(ch, 0) for ch in range(2 * c + 2)]
        index.admit_boundary(states, needs, (2 * c + 2) * BLOCK, per, parent)
        index.take_orders()  # as each engine step does
        n += 1

    for _ in range(held):
        add()
    first = samples(add, 1)[0]
    times = samples(add, count)
    assert index.stats.evicted_superseded > 0
    return first, statistics.mean(times), max(times)


# The serving stream: shared system prompts, conversations whose turns each add a few
# chunks, up to a longest prompt; about one new request a step.
SYSTEM_PROMPTS, HEAD_CHUNKS = 64, 8
TURN_CHUNKS = (3, 11)
LONGEST_CHUNKS = 96  # 24k tokens
NEW_CONVERSATION = 0.25  # of the requests; the others continue an open one
STATE_GROUPS = (1, 2, 3)
# A boundary's states plus the chunks of a turn, per entry: the budget for `entries`.
MEAN_ENTRY = (7 * ATTN_BYTES + 3 * STATE_BYTES) / 10


def time_calls(methods: list[tuple[object, str, str]], add: Callable[[str, float], None]) -> None:
    """Replace each (object, method name, label) with a wrapper that calls `add(label,
    seconds)` after each call, counting only the outermost of calls made within one
    another (a call's time holds those it made)."""
    depth = 0

    def timed(method: Callable, label: str) -> Callable:
        def call(*args, **kwargs):
            nonlocal depth
            depth += 1
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                depth -= 1
                if not depth:
                    add(label, time.perf_counter() - t)

        return call

    for obj, name, label in methods:
        setattr(obj, name, timed(getattr(obj, name), label))


class Serving:
    """A serving stream through the real scheduler side (the module docstring), drawn
    from a seeded generator. `step` returns the seconds its scheduler-side calls took,
    and of those the chain keys of its new prompts'; `index_seconds` adds up what the
    calls into the index took (once `time_index` has wrapped them: that costs time)."""

    def __init__(
        self,
        entries: int,
        seed: int = 27,
        step_tokens: int | None = None,
        memo_bytes: int | None = None,
        events: bool = False,
    ):
        lay = layout()
        planner = Planner(lay.groups)
        self.rng = random.Random(seed)
        self.tokens = np.random.default_rng(seed)
        # The shared tier (Redis, in another process): every store goes down to it. A dict
        # of bytes to None, which the garbage collector does not track, unlike a set: the
        # full collection timed at the end is the index's, not this stand-in's.
        self.shared: dict[bytes, None] = {}
        self.probe = Probe("redis", lambda keys: [k in self.shared for k in keys], ttl_s=1.0)
        index = StoreIndex(int(entries * MEAN_ENTRY), recurrent=True)
        policy = CheckpointPolicy("prompt_and_end", planner.chunk_tokens)
        # Requests come with vLLM's block hashes, as its engine core builds them on its
        # input thread, and the chain keys of a prompt extending one seen lately are
        # found from those (core/keys.py's `ChainMemo`), as in the engine.
        self.hasher = vllm_hasher(BLOCK)
        self.side = SchedulerSide(
            lay,
            planner,
            policy,
            index,
            True,
            True,
            tiers=[("redis", 1.0)],
            probe=self.probe,
            hash_block_size=BLOCK,
        )
        if memo_bytes is not None:  # the memo's bound, if not the engine's
            self.side._memo = ChainMemo(max_bytes=memo_bytes)
        # vLLM's KV cache events (`--events`): told of every boundary stored, taken
        # every step, as vLLM's scheduler takes them.
        self.events = kv_events(self.side) if events else None
        self.recalled = self.keyed = 0  # chunks the memo recalled, of chunks keyed
        recall = self.side._memo.recall

        def counted(seed: bytes, fingerprints) -> list[bytes]:
            got = recall(seed, fingerprints)
            self.recalled += len(got)
            self.keyed += len(fingerprints)
            return got

        self.side._memo.recall = counted
        self.heads = [self._draw(HEAD_CHUNKS * BLOCK) for _ in range(SYSTEM_PROMPTS)]
        # Open conversations' last prompts (arrays: a list of ints per token would make
        # every collection of the garbage collector walk millions of them).
        self.open: list[np.ndarray | None] = [None] * max(entries // 50, 8)
        self.waiting: list = []  # requests looked up that answered "ask again"
        self.prefilled: list = []  # requests looked up last step: their stores come now
        # With `step_tokens`, vLLM's token budget: a step's prefills compute (and store) at
        # most that many tokens, the first ones looked up first; the rest wait in
        # `prefilling` as [request, next chunk to store, hit]. None: a whole prefill a step.
        self.step_tokens = step_tokens
        self.prefilling: list[list] = []
        self.prefills = self.split = 0  # prefills begun; of those, carried past a step
        self.backlog = 0  # the most prefills waiting for the budget at once
        self.running: list[tuple[int, object]] = []  # (finishing step, request)
        self.promoted: list[bytes] = []  # promotions ordered last step
        self.n = 0
        self.hit_tokens = 0
        self.index_seconds = 0.0
        # For scale, not part of the step's time: the last step's new requests built with
        # their block hashes, vLLM's own work on another thread (`vllm_request_hashes`).
        self.vllm_seconds = 0.0

    def _draw(self, n: int) -> np.ndarray:
        return self.tokens.integers(1, 150000, n, dtype=np.int32)

    def _prompt(self) -> list[int]:
        """A new conversation's first prompt, or an open one's next turn (the earlier
        prompt, its answer and the new message: a few chunks longer)."""
        rng = self.rng
        slot = rng.randrange(len(self.open))
        prompt = self.open[slot]
        turn = rng.randint(*TURN_CHUNKS) * BLOCK + rng.randrange(BLOCK)
        if (
            prompt is None
            or rng.random() < NEW_CONVERSATION
            or len(prompt) + turn > LONGEST_CHUNKS * BLOCK
        ):
            prompt = rng.choice(self.heads)
        self.open[slot] = prompt = np.concatenate([prompt, self._draw(turn)])
        return prompt.tolist()

    def fill(self) -> list[float]:
        """Steps until CPU memory is full; each one's seconds (see `step`)."""
        index = self.side.index
        steps = []
        while index.gauges()["cpu_bytes"] < 0.99 * index.capacity:
            steps.append(self.step()[0])
        return steps

    def time_index(self) -> None:
        """Add up the seconds of every call the scheduler side makes into the index."""
        index = self.side.index

        def add(_: str, seconds: float) -> None:
            self.index_seconds += seconds

        names = [n for n in dir(index) if not n.startswith("_") and callable(getattr(index, n))]
        time_calls([(index, name, name) for name in names], add)

    def step(self) -> tuple[float, float]:
        side, index = self.side, self.side.index
        clock = time.perf_counter
        t0 = clock()
        # The workers' reports of last step's promotions (all read and verified).
        if self.promoted:
            epoch = index.epoch
            report = WorkerReport(epoch, promoted=[(epoch, k, True) for k in self.promoted])
            side.worker_reports({0: report})
        # Requests that finish now release their pins.
        done = [r for at, r in self.running if at <= self.n]
        self.running = [(at, r) for at, r in self.running if at > self.n]
        for req in done:
            side.request_finished(req)
        # Last step's prefills store their chunks and states.
        stored: list[bytes] = []
        prefills = self.prefilling + [[req, hit // BLOCK, hit] for req, hit in self.prefilled]
        budget = self.step_tokens // BLOCK if self.step_tokens else None
        done, self.prefilling = [], []
        for prefill in prefills:
            req, first, hit = prefill
            ckpt = side.policy.prompt_checkpoint(req.num_prompt_tokens) // BLOCK
            last = ckpt if budget is None else min(ckpt, first + budget)
            if last > first or last == ckpt:
                stored += self._store(req, hit, first, last)
            if budget is not None:
                budget -= last - first
            if last == ckpt:
                done.append(req)
            else:
                self.prefilling.append([req, last, hit])
        elapsed = clock() - t0
        fresh = {id(req) for req, _ in self.prefilled}
        self.split += sum(id(p[0]) in fresh for p in self.prefilling)
        self.prefills += len(fresh)
        self.backlog = max(self.backlog, len(self.prefilling))
        for req in done:
            self.running.append((self.n + self.rng.randint(2, 6), req))
        self.prefilled = []
        # Lookups: the waiting ones again, then this step's new requests.
        prompts = [self._prompt() for _ in range(self.rng.choice((0, 1, 1, 2)))]
        t0 = clock()
        new = [request(f"r{self.n}-{i}", p, self.hasher) for i, p in enumerate(prompts)]
        self.vllm_seconds = clock() - t0
        t0 = clock()
        for req in new:  # a request's chain keys, computed at its first lookup
            side._keys(side._state(req), req.num_prompt_tokens)
        hashing = clock() - t0
        t0 = clock()
        waiting, self.waiting = self.waiting + new, []
        for req in waiting:
            hit = side.num_new_matched_tokens(req, 0)
            if hit is None:
                self.waiting.append(req)
            else:
                self.prefilled.append((req, hit))
        # The index's part of the step's metadata.
        orders = index.take_orders()
        self.probe.send()
        if self.events is not None:
            self.events.take()
        elapsed += clock() - t0
        # The shared tier answers within the step (a round trip to Redis is well under
        # an engine step), so the next step's lookups find the answers in, as they would.
        while self.probe._sending:
            time.sleep(0)
        self.hit_tokens += sum(hit for _, hit in self.prefilled)
        self.promoted = [k for k, _ in orders.promote]
        self.shared.update(dict.fromkeys(stored))
        self.n += 1
        return elapsed + hashing, hashing

    def _store(self, req, hit: int, first: int, last: int) -> list[bytes]:
        """What the part of a prefill from `hit` that computes chunks `first` to `last`
        (the prompt's checkpoint at most) stores: those chunks, and the states among the
        checkpoint and the branch point vLLM checkpointed that it reaches, through the
        scheduler side's admission."""
        side = self.side
        st = side._state(req)
        ckpt = side.policy.prompt_checkpoint(req.num_prompt_tokens) // BLOCK
        keys = side._keys(st, ckpt * BLOCK)
        plan = [EntryCopy(0, c, (0,), (0,)) for c in range(first, last)]
        junction = req.shared_prefix_boundary // BLOCK
        for end in sorted({ckpt} | ({junction} if hit // BLOCK < junction < ckpt else set())):
            if end and (first < end <= last or end == first == last):  # (a hit to it)
                plan += [EntryCopy(g, end - 1, (0,), (0,)) for g in STATE_GROUPS]
        copies = [KeyedCopy(group_key(keys[c.chunk], c.group), c) for c in plan]
        stored = [kc.key for kc in side._admit(st, keys, copies)]
        if self.events is not None:  # as the scheduler side's own stores do (`_name`)
            side._observe(st, keys, {(c.chunk + 1) * BLOCK for c in plan if c.group})
        return stored


def serving(
    entries: int,
    steps: int,
    freeze: bool,
    step_tokens: int | None = None,
    memo_bytes: int | None = None,
    events: bool = False,
) -> dict[str, float]:
    """Per-step seconds of the stream once CPU memory is full (the module docstring),
    and the longest step while it filled (where the index's tables grow); then a quarter
    as many steps again with the calls into the index timed; last, one full collection
    of the garbage collector, timed. vLLM's engine freezes what start-up
    allocated (`freeze_gc_heap`), the scheduler side's empty tables among it, so that
    collection walks the objects allocated since: the index's, which a collection of
    the oldest generation walks every time the objects surviving younger collections
    have grown by a quarter (CPython 3.11), on the scheduler's thread, whatever step it
    falls in."""
    # Built before the freeze, as vLLM builds its scheduler.
    stream = Serving(entries, step_tokens=step_tokens, memo_bytes=memo_bytes, events=events)
    gc.collect()
    gc.freeze()
    index = stream.side.index
    t = time.perf_counter()
    filling = stream.fill()  # the steps while it fills: what grows grows then
    filled = time.perf_counter() - t
    if freeze:
        gc.collect()
        gc.freeze()
    total, without, vllm, hits = [], [], [], stream.hit_tokens
    prefills, split, stream.backlog = stream.prefills, stream.split, 0
    recalled, keyed = stream.recalled, stream.keyed
    for _ in range(steps):
        secs, hashing = stream.step()
        total.append(secs)
        without.append(secs - hashing)
        vllm.append(stream.vllm_seconds)
    gauges = index.gauges()
    out = {
        "fill_seconds": filled,
        "filling: steps": len(filling),
        "filling: steps over 5 ms": sum(secs > 5e-3 for secs in filling),
        "filling: longest step, ms": max(filling) * 1e3,
        "cpu_entries": gauges["cpu_entries"],
        "boundaries": gauges["cpu_boundaries"],
        "evictions": index.stats.cpu_evictions,
        "promotions": index.stats.promotions,
        "hit tokens per step": (stream.hit_tokens - hits) / steps,
        "prefills": stream.prefills - prefills,
        "prefills split over steps": stream.split - split,
        "most prefills waiting for the budget": stream.backlog,
        "chain memo: chunks recalled per chunk keyed": (stream.recalled - recalled)
        / max(stream.keyed - keyed, 1),
        "chain memo: bytes held (its own count)": stream.side._memo.nbytes,
    }
    stream.time_index()
    in_index = []
    for _ in range(steps // 4):
        before = stream.index_seconds
        stream.step()
        in_index.append(stream.index_seconds - before)
    t = time.perf_counter()
    gc.collect()
    out["full GC collection ms"] = (time.perf_counter() - t) * 1e3
    tracked = gc.get_objects()
    out["objects the collector tracks"] = len(tracked)
    # What a collection's time goes with: each tracked object's references, which it
    # follows (twice) whether or not they lead to tracked objects.
    follows: dict[str, int] = {}
    for obj in tracked:
        name = type(obj).__name__
        follows[name] = follows.get(name, 0) + len(gc.get_referents(obj))
    del tracked
    out["references the collector follows"] = sum(follows.values())
    for name, n in sorted(follows.items(), key=lambda kv: -kv[1])[:4]:
        out[f"references the collector follows: from {name}"] = n
    out["references the collector follows: from the index"] = references_followed(index)
    gc.unfreeze()
    for name, times in (
        ("step", total),
        ("step without chain keys", without),
        ("step, in the index", in_index),
        ("step, for scale: vLLM's own hashes", vllm),
    ):
        times.sort()
        out[f"{name}: p50"] = times[len(times) // 2]
        out[f"{name}: p99"] = times[int(len(times) * 0.99)]
        out[f"{name}: max"] = times[-1]
    return out


def memory(entries: int, memo_bytes: int | None = None, events: bool = False) -> dict[str, float]:
    """Bytes that hybridkv's and sortedcontainers' code allocated and still holds once
    the stream has filled CPU memory, per entry there (tracemalloc), and the chain
    memo's own count of what it holds."""
    ours = (
        tracemalloc.Filter(True, "*/hybridkv/*"),
        tracemalloc.Filter(True, "*/sortedcontainers/*"),
    )
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(ours)
    stream = Serving(entries, memo_bytes=memo_bytes, events=events)
    index = stream.side.index
    stream.fill()
    # What is left of requests, of the probe's answers and of the simulated shared tier
    # is not the index's.
    stream.waiting, stream.prefilled, stream.running, stream.promoted = [], [], [], []
    stream.side._reqs.clear()
    stream.probe.clear()
    stream.shared.clear()
    gc.collect()
    after = tracemalloc.take_snapshot().filter_traces(ours)
    tracemalloc.stop()
    held = sum(s.size for s in after.statistics("filename")) - sum(
        s.size for s in before.statistics("filename")
    )
    n = index.gauges()["cpu_entries"]
    memo = stream.side._memo
    return {
        "cpu_entries": n,
        "bytes": held,
        "bytes per entry": held / n,
        "chain memo, its own count: bytes per entry": memo.nbytes / n,
    }


def lru_churn(entries: int, seed: int = 27) -> dict[str, float]:
    """A layout without recurrent groups (`LruPolicy`): CPU memory filled with `entries`
    chunks, then twice as many new ones admitted, each evicting the least recently used
    (every tenth admission touching a random held entry, as a hit does; every hundredth
    ending a step, which takes the index's orders). What matters at a million entries is
    the longest admission: a dict of a million keys rebuilds its table every few hundred
    thousand insertions, on the scheduler's thread."""
    rng = random.Random(seed)
    index = StoreIndex(entries * ATTN_BYTES)
    held = [rng.randbytes(18) for _ in range(entries)]
    for key in held:
        index.admit(key, ATTN_BYTES)
    gc.collect()
    gc.freeze()  # the bench's own list of a million keys is not the index's to walk
    times = array("d")
    for i in range(2 * entries):
        key = rng.randbytes(18)
        t = time.perf_counter()
        index.admit(key, ATTN_BYTES)
        if i % 10 == 0:
            index.touch([held[rng.randrange(entries)]])
        if i % 100 == 99:
            index.take_orders()  # a step's end
        times.append(time.perf_counter() - t)
        held[i % entries] = key
    gc.unfreeze()
    times = sorted(times)
    return {
        "admissions": len(times),
        "p50 us": times[len(times) // 2] * 1e6,
        "p99 us": times[int(len(times) * 0.99)] * 1e6,
        "max ms": times[-1] * 1e3,
        "over 1 ms": sum(t > 1e-3 for t in times),
    }


def _dict_missing(table: dict[bytes, int], keys: list[bytes]) -> list[bytes]:
    return [key for key in keys if key not in table]


def row_growth(rows: int) -> dict[str, float]:
    """The boundary table (core/boundary_graph.py's `Boundaries`, 17 columns) grown to
    `rows` rows one at a time, as admissions grow it while CPU memory fills: the longest
    addition. Columns that grow by copying themselves whole all do it on the same row."""
    table = Boundaries()
    states = [bytes(KEY_WIDTH)] * 3
    times = array("d")
    for i in range(rows):
        t = time.perf_counter()
        table.new(states, 0, i, i, i, i)
        times.append(time.perf_counter() - t)
    times = sorted(times)
    return {
        "rows": rows,
        "p50 us": times[len(times) // 2] * 1e6,
        "max ms": times[-1] * 1e3,
        "over 1 ms": sum(t > 1e-3 for t in times),
    }


def cold_lookups(keys_held: int, asked: int = 300, trials: int = 31) -> dict[str, float]:
    """Nanoseconds per key to ask a table holding `keys_held` random 18-byte keys about
    `asked` of them (new key objects, as a lookup's concatenated keys are): "cold" after
    64 MiB were written over the caches (as a step's keys, no recent step touched),
    "warm" the same keys again at once; in one bulk call and one key at a time. A plain
    dict against the index's `KeyTable` (core/keytable.py); medians of `trials`."""
    rng = random.Random(keys_held)
    keys = [rng.randbytes(18) for _ in range(keys_held)]
    junk, zeros = bytearray(64 << 20), bytes(64 << 20)
    out: dict[str, float] = {}
    for name in ("dict", "KeyTable"):
        table = {} if name == "dict" else KeyTable()
        for key in keys:
            table[key] = 1
        bulk = partial(_dict_missing, table) if name == "dict" else table.missing
        times: dict[str, list[float]] = {"cold bulk": [], "warm bulk": [], "cold one by one": []}
        for _ in range(trials):
            for case in times:
                sample = [k[:9] + k[9:] for k in rng.sample(keys, asked)]
                if case.startswith("cold"):
                    junk[:] = zeros
                else:
                    bulk(sample)
                t = time.perf_counter()
                if case.endswith("bulk"):
                    bulk(sample)
                else:
                    for key in sample:
                        _ = key in table
                times[case].append(time.perf_counter() - t)
        for case, ts in times.items():
            out[f"{name}, {case}"] = statistics.median(ts) / asked * 1e9
    return out


def phases(entries: int, steps: int = 3000) -> dict[str, float]:
    """Where a step's time goes, once CPU memory is full: the scheduler side's calls
    timed apart (a call made within another counts in the outer one), in ms, their mean
    over all steps and over the slowest 2 % (by the step's own time, which also holds
    the stream's modelling of stores around `_admit`). Timing each call costs time, so
    the step times here are not the stream's figures."""
    stream = Serving(entries)
    side, index = stream.side, stream.side.index
    gc.collect()
    gc.freeze()  # as `serving` does
    stream.fill()
    spent: dict[str, float] = {}

    def add(label: str, seconds: float) -> None:
        spent[label] = spent.get(label, 0.0) + seconds

    calls = [
        (side, "worker_reports", "workers' reports"),
        (side, "request_finished", "finished requests"),
        (side, "_admit", "admissions (and their evictions)"),
        (side, "_keys", "chain keys"),
        (side, "num_new_matched_tokens", "lookups"),
        (index, "take_orders", "orders"),
        (stream.probe, "send", "probe sends"),
    ]
    time_calls(calls, add)
    rows = []
    for _ in range(steps):
        spent.clear()
        rows.append((stream.step()[0], dict(spent)))
    rows.sort(key=lambda row: row[0])
    top = rows[int(len(rows) * 0.98) :]
    out = {"step: mean": 1e3 * sum(t for t, _ in rows) / len(rows)}
    out["slowest 2 %: step mean"] = 1e3 * sum(t for t, _ in top) / len(top)
    for label in sorted({k for _, p in rows for k in p}):
        out[label] = 1e3 * sum(p.get(label, 0.0) for _, p in rows) / len(rows)
        out[f"slowest 2 %: {label}"] = 1e3 * sum(p.get(label, 0.0) for _, p in top) / len(top)
    gc.unfreeze()
    return out


def collections(entries: int, rounds: int = 4, steps: int = 1000) -> dict[str, float]:
    """What a full collection of the garbage collector costs once CPU memory is full:
    after every `steps` more steps of the stream, one timed, then one more at once, in
    ms, with the objects tracked (tuples apart: a tuple stays tracked until a collection
    examines it) and the references they hold (what a collection visits; counted before
    it, untimed) and the unreachable objects each found (garbage in cycles, which
    it frees). Frozen first, as vLLM's engine freezes what start-up allocated, so either
    walks only what the stream allocated since. Last, one with everything frozen: what
    the collection costs without what it walks."""
    stream = Serving(entries)
    gc.collect()
    gc.freeze()
    stream.fill()
    out = {}
    for r in range(rounds):
        for _ in range(steps):
            stream.step()
        tracked = gc.get_objects()
        out[f"{(r + 1) * steps} steps: objects tracked"] = len(tracked)
        out[f"{(r + 1) * steps} steps: of them tuples"] = sum(type(o) is tuple for o in tracked)
        out[f"{(r + 1) * steps} steps: references held"] = sum(
            len(gc.get_referents(o)) for o in tracked
        )
        del tracked
        for name in ("after the steps", "again at once"):
            t = time.perf_counter()
            unreachable = gc.collect()
            out[f"{(r + 1) * steps} steps: {name}"] = 1e3 * (time.perf_counter() - t)
            out[f"{(r + 1) * steps} steps: {name}, unreachable objects"] = unreachable
    out["objects the collector tracks"] = len(gc.get_objects())
    gc.freeze()
    t = time.perf_counter()
    gc.collect()
    out["everything frozen"] = 1e3 * (time.perf_counter() - t)
    gc.unfreeze()
    return out


def slowest(entries: int, steps: int = 3000, shown: int = 10) -> dict[str, float]:
    """What the slowest steps did, once CPU memory is full (frozen as in `serving`): the
    `shown` slowest one by one (ms, the collector's pauses within the step call and the
    oldest generation they collected, the entries it evicted, the prefills it stored and
    their prompts' tokens); p99 and max of the steps no collection fell in; then the
    slowest 1 % against all steps in the mean. A pause is counted if it falls anywhere
    in the step call, the stream's untimed modelling included, so it may exceed the
    step's own time. The figures go into arrays, which the collector does not track: a
    dict a step would itself bring on the collections it counts."""
    stream = Serving(entries)
    index = stream.side.index
    gc.collect()
    gc.freeze()
    stream.fill()
    names = ("ms", "gc ms", "gc generation", "evicted", "stores", "stored prompts' tokens")
    columns = {name: array("d", bytes(8 * steps)) for name in names}
    paused, started, oldest = [0.0], [0.0], [-1]  # oldest generation collected, -1: none

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            oldest[0] = max(oldest[0], info["generation"])
        else:
            paused[0] += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)
    try:
        for i in range(steps):
            paused[0], oldest[0] = 0.0, -1
            evicted, n = index.stats.cpu_evictions, len(stream.prefilled)
            tokens = sum(r.num_prompt_tokens for r, _ in stream.prefilled)
            secs, _ = stream.step()
            columns["ms"][i] = secs * 1e3
            columns["gc ms"][i] = paused[0] * 1e3
            columns["gc generation"][i] = oldest[0]
            columns["evicted"][i] = index.stats.cpu_evictions - evicted
            columns["stores"][i] = n
            columns["stored prompts' tokens"][i] = tokens
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
    order = sorted(range(steps), key=columns["ms"].__getitem__)
    out = {}
    for rank, i in enumerate(reversed(order[-shown:])):
        for name in names:
            out[f"#{rank + 1} {name}"] = columns[name][i]
    # The collector's pauses walk whatever the process holds (vLLM's requests among it);
    # the steps none fell in show the scheduler side's own cost.
    quiet = [columns["ms"][i] for i in order if columns["gc generation"][i] < 0]
    out["steps a collection fell in"] = steps - len(quiet)
    out["steps without a collection: p99 ms"] = quiet[int(len(quiet) * 0.99)]
    out["steps without a collection: max ms"] = quiet[-1]
    top = order[int(steps * 0.99) :]
    for label, group in (("slowest 1 %", top), ("all steps", order)):
        for name in names:
            if name != "gc generation":
                out[f"{label}, mean {name}"] = sum(columns[name][i] for i in group) / len(group)
    return out


def print_figures(title: str, figures: dict[str, float], digits: int) -> None:
    print(f"{title}: " + ", ".join(f"{k} {v:.{digits}f}" for k, v in figures.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--held", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--serve-entries", type=int, nargs="*", default=[])
    p.add_argument("--serve-steps", type=int, default=20000)
    p.add_argument("--freeze", action="store_true", help="gc.freeze() once CPU memory is full")
    p.add_argument(
        "--events",
        action="store_true",
        help="the serving stream with vLLM's KV cache events on (`--kv-events-config`)",
    )
    p.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="the serving stream's prefill tokens a step, as vLLM's token budget (default: "
        "a whole prefill in the step after its lookup)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs")
    p.add_argument(
        "--memo-bytes",
        type=int,
        default=None,
        help="the serving stream's chain memo bound (default: the engine's, ChainMemo's)",
    )
    p.add_argument(
        "--lru-entries", type=int, nargs="*", default=[], help="LruPolicy churn (`lru_churn`)"
    )
    p.add_argument(
        "--cold-lookups", type=int, nargs="*", default=[], help="ns per key asked (`cold_lookups`)"
    )
    p.add_argument(
        "--row-growth", type=int, nargs="*", default=[], help="rows added (`row_growth`)"
    )
    p.add_argument(
        "--phases",
        type=int,
        nargs="*",
        default=[],
        help="where a step's time goes at these entries (`phases`; --serve-steps steps)",
    )
    p.add_argument(
        "--gc",
        type=int,
        nargs="*",
        default=[],
        help="full collections once full, at these entries (`collections`)",
    )
    p.add_argument(
        "--slowest",
        type=int,
        nargs="*",
        default=[],
        help="what the slowest steps did at these entries (`slowest`; --serve-steps steps)",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "lookup.json")
    args = p.parse_args()
    if (
        args.cold_lookups
        or args.lru_entries
        or args.row_growth
        or args.phases
        or args.gc
        or args.slowest
    ):
        for entries in args.slowest:
            print_figures(
                f"{entries} entries, the slowest steps", slowest(entries, args.serve_steps), 2
            )
        for entries in args.gc:
            print_figures(f"{entries} entries, full collections, ms", collections(entries), 2)
        for entries in args.phases:
            print_figures(f"{entries} entries, ms a step", phases(entries, args.serve_steps), 3)
        for held in args.cold_lookups:
            print_figures(f"{held} keys held, ns per key asked", cold_lookups(held), 0)
        for entries in args.lru_entries:
            print_figures(f"LruPolicy, {entries} entries", lru_churn(entries), 1)
        for rows in args.row_growth:
            print_figures(f"boundary table grown to {rows} rows", row_growth(rows), 2)
        return
    if args.serve_entries:
        serve(args)
        return

    rng = random.Random(3)
    prompt = [rng.randrange(1, 150000) for _ in range(args.prompt_tokens)]
    chunks = args.prompt_tokens // BLOCK
    results: dict[str, float] = {}

    side = side_with(1 << 40)
    miss = request("miss", prompt)
    results["lookup, miss (nothing stored)"] = timed(
        lambda: side.num_new_matched_tokens(miss, 0), args.repeats
    )
    hit = request("hit", prompt)
    keys = side._keys(side._state(hit), len(prompt))
    results["of which: chain keys (blake3)"] = timed(
        lambda: chunk_keys(side._state(hit).ctx.seed, prompt, BLOCK), args.repeats
    )
    for block in (BLOCK, 16):
        results[f"for scale: vLLM's own hashes, {block}-token blocks"] = timed(
            lambda block=block: vllm_request_hashes(prompt, block), args.repeats
        )
    store_prompt(side, hit, keys)
    assert side.num_new_matched_tokens(hit, 0) == side.policy.prompt_checkpoint(len(prompt))
    results["lookup, hit to the prompt's checkpoint"] = timed(
        lambda: side.num_new_matched_tokens(hit, 0), args.repeats
    )
    waiting = side_with(1 << 40, disk=True)
    req = request("waiting", prompt)
    ckpt = waiting.planner.max_hit_chunks(len(prompt))
    on_disk = [group_key(k, 0) for k in keys[:ckpt]]
    on_disk += [group_key(keys[ckpt - 1], g) for g in (1, 2, 3)]
    listing = WorkerReport(listed=True, disk=[(k, True) for k in on_disk])
    waiting.index.apply(0, listing)
    assert waiting.num_new_matched_tokens(req, 0) is None  # its promotions start
    results["lookup, waiting for its promotions"] = timed(
        lambda: waiting.num_new_matched_tokens(req, 0), args.repeats
    )
    for held in args.held:
        first, mean, longest = admission_cost(held, max(held, 200))
        results[f"admit a boundary, {held} held: first"] = first
        results[f"admit a boundary, {held} held: mean"] = mean
        results[f"admit a boundary, {held} held: longest"] = longest

    print(f"scheduler side, {args.prompt_tokens}-token prompt ({chunks} chunks, 4 groups)")
    print(f"{'':46}{'total ms':>10}{'us/chunk':>10}")
    for name, secs in results.items():
        per_chunk = ""
        if name.startswith(("lookup", "of", "for")):
            per_chunk = f"{secs * 1e6 / chunks:10.1f}"
        print(f"{name:46}{secs * 1e3:10.3f}{per_chunk}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"prompt_tokens": args.prompt_tokens, "seconds": results}, indent=2)
    )
    print(f"wrote {args.json}")


def serve(args: argparse.Namespace) -> None:
    results: dict[str, dict[str, float]] = {}
    budget = f", prefills of {args.step_tokens} tokens a step" if args.step_tokens else ""
    budget += ", with vLLM's KV cache events" if args.events else ""
    print(f"serving stream, {args.serve_steps} steps timed once CPU memory is full{budget}")
    for entries in args.serve_entries:
        fig = serving(
            entries, args.serve_steps, args.freeze, args.step_tokens, args.memo_bytes, args.events
        )
        if not args.no_memory:
            held = memory(entries, args.memo_bytes, args.events)
            fig.update({f"memory: {k}": v for k, v in held.items()})
        results[str(entries)] = fig
        print(f"{entries:>9} entries")
        for name, value in fig.items():
            shown = f"{value * 1e3:10.3f} ms" if name.startswith("step") else f"{value:13.1f}"
            print(f"  {name:42}{shown}")
    out = args.json.with_name(args.json.stem + "-serving.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "steps": args.serve_steps,
                "freeze": args.freeze,
                "step_tokens": args.step_tokens,
                "memo_bytes": args.memo_bytes,
                "events": args.events,
                "entries": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
