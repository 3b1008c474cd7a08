"""An upper bound on the token hit rate any admission and eviction policy could reach on a
trace with the same bytes and the same hit rule, computed offline (knowing the future) on
token ids and entry sizes only: no engine.

The model (M). Requests are served one at a time in trace order. The hit granularity is
g tokens (the finest boundary any measured system resumes at: vLLM's block; hybridkv's
chunk is a multiple of it). Chunk c of a prompt is its tokens [c g, (c+1) g), named by
the hash chain of the prefix it ends (`traces.block_chain`), so equal names mean equal
KV. The caches hold *items*:
  - a full chunk: every full-attention group's entry for one chunk;
  - a window chunk: one sliding group's entry for one chunk;
  - a boundary: every recurrent group's state after k g tokens (a policy holding only
    some of a boundary's states gains nothing from them).
A request with L prompt tokens hits B = k g <= L - 1 tokens, the largest boundary where
`core.planner.Planner.find_hit` finds every item it needs held (full chunks [0, k), the
window chunks covering [B - window, B), the boundary at B), else 0. Items are held in two
places: the CPU store (the budget, in the unpadded bytes hybridkv stores) and vLLM's own
block pool (`gpu_blocks` blocks; an item takes one block per group it spans, a chunk of
g tokens g / block_tokens of a group's block). At every moment each held item is in one
of them (or both), and each must fit: between requests the pool holds at most
`gpu_blocks` blocks; while a request runs it also holds that request's own blocks, at
least its full-attention blocks for every prompt token and one state block per recurrent
group (`running_blocks`), so the items kept through it get the rest. After a request the
policy keeps any subset of what it held and of the request's own items: its full and
window chunks c < floor(L / g) and its boundaries at every k g <= L (the state after
the whole prompt included: vLLM caches it when L is a multiple of g), and may move
any held item between the two places at any moment. The oracle is the best total of hit
tokens over all such policies.

Why M bounds every system the bench measures (hybridkv, vLLM's OffloadingConnector, no
connector), and under which assumptions:
1. Same hit rule: each system's hit at a request (vLLM's own prefix cache and the
   connector together) resumes at a multiple of vLLM's block where every group can be
   restored, and the tokens counted are that boundary (`num_cached_tokens`).
2. More admissions than any policy has: a real store can only keep what the request
   computed or loaded. Recurrent states exist only where vLLM hands one off (the prompt's
   last block boundary, a branch point set through `shared_prefix_boundary`, decode
   steps); M lets a request leave a state at every boundary of its prompt, and lets it
   keep a state it skipped over by loading a longer hit. Window chunks vLLM already freed
   are likewise allowed, and items move between the CPU and vLLM's pool for free (a real
   copy is only made by a store or a hit). Decode-time KV is left out: the bench's next
   prompts carry a synthetic answer, not what the model generated, and the bench replays
   `max_tokens` 1.
3. vLLM's prefix cache is bounded, not simulated: its pool (the engine's KV cache, less
   the null block) holds what any cache policy could keep there, so vLLM's LRU is at most
   as good. Reserving the running request's blocks uses that vLLM allocates them all at
   once (the bench prefills a prompt in one step). The vLLM connector's CPU pages are
   padded, so its budget holds no more items than M's.
4. Order: each lookup sees the stores of exactly the requests before it. That is the
   sequential replay. In the concurrent replay it holds whenever requests are first
   scheduled in arrival order (the replay records it: `in_order`); a request scheduled
   ahead of an earlier one could see stores M does not give it, and then M is a
   reference, not a proven bound.

The reduction. Holding item i for request r means holding it from prev_i(r), the last
request before r whose own items include i, until r: at every gap between requests in
[prev_i(r), r) and while every request strictly between them runs. A policy holding i
at r admitted it at some request containing i, no later than prev_i(r), and kept it
since; and any policy may admit it again at prev_i(r). Two requests' needs for the same
item never overlap in time (the later one's prev is at or after the earlier one). So the
optimum of M equals a packing problem: choose per request one boundary (or none),
maximising the tokens hit, such that at every moment the held items of the chosen hits
can be split between the CPU (bytes) and vLLM's pool (blocks) within both capacities
(tests/test_oracle.py checks this equality against an exhaustive search of M). It is
NP-hard in general (knapsack is its one-moment case), so the oracle reports its
Lagrangian dual bound. With prices per moment for a CPU byte (lam) and a pool block (mu),
an item of b bytes and k blocks costs min(b lam, k mu) at each moment it is held, and

    U(lam, mu) = sum over moments of (CPU bytes * lam + free blocks * mu)
                 + sum_r max(0, max_B [B - the cost of the items (r, B) holds])

is at least M's optimum for every lam, mu >= 0 (weak duality), and its minimum is the LP
relaxation's optimum. Projected subgradient steps (Polyak's rule toward the best schedule
found) lower it; every iterate is a valid bound and the lowest is `upper`. Hits whose own
items cannot fit at their last moment are dropped first (no policy can take them). A
schedule feasible in M, found by repairing the priced choices, is reported beside it
(`schedule`): M's optimum lies between the two, so `upper - schedule` says how much
looser than M the bound may be. At unlimited capacity the bound is every request's
longest boundary seen before (`unlimited`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv.benchmarks.traces import Trace, block_chain
from hybridkv.core.layout import GroupKind, GroupSpec
from hybridkv.core.planner import Planner


@dataclass(frozen=True)
class Geometry:
    """What the oracle needs of a model's KV cache at hit granularity `chunk_tokens`: per
    item kind its unpadded bytes (hybridkv's entry sizes) and its blocks in vLLM's pool."""

    chunk_tokens: int
    full_bytes: int  # every full-attention group's entry for one chunk
    state_bytes: int  # every recurrent group's state at one boundary; 0: none
    windows: tuple[tuple[int, int], ...] = ()  # (window tokens, bytes of a chunk) per group
    full_blocks: float = 0.0  # blocks of one full chunk in vLLM's pool (over its groups)
    state_blocks: int = 0  # one block per recurrent group
    window_blocks: tuple[float, ...] = ()  # blocks of one window chunk, per sliding group

    @classmethod
    def from_groups(cls, groups: Sequence[Mapping[str, Any]], hit_tokens: int) -> Geometry:
        """From a layout's groups (`Layout.describe()["groups"]`: kind, block_tokens,
        block_bytes, window) at the engine's hit granularity `hit_tokens`. A chunk smaller
        than a group's block is charged its share of it (less than any cache pays: the
        bound stays valid)."""
        full = state = state_blocks = 0
        full_blocks = 0.0
        windows, window_blocks = [], []
        for group in groups:
            kind = GroupKind(group["kind"])
            if kind is GroupKind.STATE:
                state += group["block_bytes"]
                state_blocks += 1
                continue
            share = hit_tokens / group["block_tokens"]
            if kind is GroupKind.FULL:
                full += int(group["block_bytes"] * share)
                full_blocks += share
            else:
                windows.append((int(group["window"]), int(group["block_bytes"] * share)))
                window_blocks.append(share)
        return cls(
            hit_tokens, full, state, tuple(windows), full_blocks, state_blocks, tuple(window_blocks)
        )

    def planner(self) -> Planner:
        """The hit rule on merged groups: group 0 full attention, then one per sliding
        group, then the recurrent states (if any), each with one item per chunk."""
        g = self.chunk_tokens
        groups = [GroupSpec(GroupKind.FULL, g, self.full_bytes, ("full",))]
        groups += [
            GroupSpec(GroupKind.SLIDING, g, size, (f"window{i}",), window=window)
            for i, (window, size) in enumerate(self.windows)
        ]
        if self.state_bytes:
            groups.append(GroupSpec(GroupKind.STATE, g, self.state_bytes, ("state",)))
        return Planner(groups, g)

    def kinds(self) -> list[tuple[int, float]]:
        """(bytes, blocks) per item kind, in `planner()`'s group order."""
        kinds = [(self.full_bytes, self.full_blocks)]
        kinds += [
            (size, blocks)
            for (_, size), blocks in zip(self.windows, self.window_blocks, strict=True)
        ]
        if self.state_bytes:
            kinds.append((self.state_bytes, float(self.state_blocks)))
        return kinds

    def running_blocks(self, prompt_tokens: int) -> float:
        """The fewest blocks of vLLM's pool a request of this many prompt tokens holds
        while it runs: full attention for every token, one state per recurrent group."""
        return math.ceil(prompt_tokens / self.chunk_tokens) * self.full_blocks + self.state_blocks


@dataclass(frozen=True)
class Capacity:
    cpu_bytes: int
    gpu_blocks: float = 0  # vLLM's pool, less its null block


@dataclass
class Packing:
    """The packing problem M reduces to (module docstring), as flat arrays.

    Segments: one row per (request, chunk c) a hit of that request may read: the chunk
    must be held from the last earlier request that had it (`seg_start`) up to the
    request. A request's rows are contiguous from `seg_offset[r]`, in chunk order.
    Options: one row per boundary k (in chunks) a request may hit, with the request its
    boundary's states are held from (`opt_state`, unused without recurrent groups), per
    sliding group the first chunk of its window (`opt_window[w]`), and the earliest
    request any of its items is held from (`opt_first`).

    Moments: gap t is between requests t and t + 1; request r's run is the moment it
    holds its own blocks. An item held from p for request r is held at gaps p .. r - 1
    and during the runs of p + 1 .. r - 1."""

    geometry: Geometry
    requests: int
    prompt_tokens: int
    running: np.ndarray  # per request, `Geometry.running_blocks`
    seg_req: np.ndarray
    seg_pos: np.ndarray
    seg_start: np.ndarray
    seg_offset: np.ndarray
    opt_req: np.ndarray
    opt_k: np.ndarray
    opt_state: np.ndarray
    opt_window: np.ndarray  # (sliding groups, options)
    opt_first: np.ndarray

    def counts(self, option: np.ndarray) -> np.ndarray:
        """(kinds, options): how many items of each kind each option needs."""
        k = self.opt_k[option]
        rows = [k] + [k - self.opt_window[w][option] for w in range(len(self.geometry.windows))]
        if self.geometry.state_bytes:
            rows.append(np.ones_like(k))
        return np.array(rows, dtype=float)

    def cover(self, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """When request r hits option `chosen[r]` (-1: none): per item kind, how many
        items are held at each gap and during each request's run ((kinds, n) twice)."""
        g, n = self.geometry, self.requests
        hits = chosen >= 0
        k_of = np.zeros(n, dtype=np.int64)
        k_of[hits] = self.opt_k[chosen[hits]]
        need = self.seg_pos < k_of[self.seg_req]
        spans = [(self.seg_start[need], self.seg_req[need])]
        for w in range(len(g.windows)):
            lo = np.zeros(n, dtype=np.int64)
            lo[hits] = self.opt_window[w][chosen[hits]]
            inside = need & (self.seg_pos >= lo[self.seg_req])
            spans.append((self.seg_start[inside], self.seg_req[inside]))
        if g.state_bytes:
            spans.append((self.opt_state[chosen[hits]], self.opt_req[chosen[hits]]))

        def held(start: np.ndarray, end: np.ndarray) -> np.ndarray:
            diff = np.bincount(start, minlength=n + 1) - np.bincount(end, minlength=n + 1)
            return np.cumsum(diff)[:n]

        gaps = np.array([held(start, end) for start, end in spans], dtype=float)
        runs = np.array([held(start + 1, end) for start, end in spans], dtype=float)
        return gaps, runs


def packing(trace: Trace, geometry: Geometry) -> Packing:
    """The packing problem of `trace` (module docstring): every request's hit options and
    what each must hold since when."""
    planner = geometry.planner()
    g = geometry.chunk_tokens
    windows = range(1, 1 + len(geometry.windows))  # their groups in `planner`
    last_chunk: dict[bytes, int] = {}
    last_state: dict[bytes, int] = {}
    seg: list[tuple[int, int, int]] = []
    offsets: list[int] = []
    opts: list[tuple[int, ...]] = []
    for r, request in enumerate(trace):
        keys = block_chain(request.prompt, g)
        top = planner.max_hit_chunks(len(request.prompt))
        offsets.append(len(seg))
        reach, first = 0, r
        while reach < top and keys[reach] in last_chunk:
            first = min(first, last_chunk[keys[reach]])
            seg.append((r, reach, last_chunk[keys[reach]]))
            reach += 1
            state = last_state.get(keys[reach - 1], -1)
            if geometry.state_bytes and state < 0:
                continue
            lows = [planner.needed_chunks(w, 0, reach * g).start for w in windows]
            held_from = min(first, state) if geometry.state_bytes else first
            opts.append((r, reach, max(state, 0), held_from, *lows))
        for key in keys:
            last_chunk[key] = r
            last_state[key] = r
    seg_arr = np.array(seg, dtype=np.int64).reshape(-1, 3)
    opt_arr = np.array(opts, dtype=np.int64).reshape(-1, 4 + len(geometry.windows))
    return Packing(
        geometry=geometry,
        requests=len(trace),
        prompt_tokens=trace.prompt_tokens(),
        running=np.array([geometry.running_blocks(len(r.prompt)) for r in trace]),
        seg_req=seg_arr[:, 0],
        seg_pos=seg_arr[:, 1],
        seg_start=seg_arr[:, 2],
        seg_offset=np.array(offsets, dtype=np.int64),
        opt_req=opt_arr[:, 0],
        opt_k=opt_arr[:, 1],
        opt_state=opt_arr[:, 2],
        opt_first=opt_arr[:, 3],
        opt_window=opt_arr[:, 4:].T,
    )


def fits(held: np.ndarray, kinds: list[tuple[int, float]], cpu: float, gpu: np.ndarray):
    """Per column of `held` ((kinds, m) counts), whether the items fit: the kinds with the
    most bytes per block go to vLLM's pool first, as many whole items as its `gpu` blocks
    take, the rest to the CPU. (`fractional`: whether they fit when items may be split,
    which no placement can beat: a necessary condition; `whole`: a placement exists.)"""
    left = np.maximum(np.asarray(gpu, dtype=float), 0.0) * np.ones(held.shape[1])
    cpu_whole = np.zeros(held.shape[1])
    cpu_split = np.zeros(held.shape[1])
    left_split = left.copy()
    order = sorted(range(len(kinds)), key=lambda i: -kinds[i][0] / (kinds[i][1] or 1e-300))
    for i in order:
        size, blocks = kinds[i]
        if blocks == 0:
            continue
        whole = np.minimum(held[i], np.floor(left / blocks + 1e-9))
        left -= whole * blocks
        cpu_whole += (held[i] - whole) * size
        split = np.minimum(held[i], left_split / blocks)
        left_split -= split * blocks
        cpu_split += (held[i] - split) * size
    return cpu_split <= cpu + 1e-6, cpu_whole <= cpu + 1e-6


@dataclass(frozen=True)
class Bound:
    """The oracle at one capacity, in tokens hit over the whole trace."""

    capacity: Capacity
    upper: float  # no policy in M hits more (the dual bound)
    schedule: int  # a schedule M allows hits this much (so M's optimum is at least this)
    unlimited: int  # the bound with unlimited capacity
    prompt_tokens: int
    iterations: int

    def rates(self) -> dict[str, Any]:
        total = self.prompt_tokens or 1
        return {
            "cpu_bytes": self.capacity.cpu_bytes,
            "gpu_blocks": self.capacity.gpu_blocks,
            "upper_hit_rate": self.upper / total,
            "schedule_hit_rate": self.schedule / total,
            "unlimited_hit_rate": self.unlimited / total,
            "iterations": self.iterations,
        }


class _Priced:
    """Each request's best option under prices, over the options that can fit."""

    def __init__(self, p: Packing, cap: Capacity):
        self.p, self.cap = p, cap
        # CPU sizes in units of the largest item, so that both capacities are counts of
        # items of similar size and one step size suits the prices of both.
        unit = max(size for size, _ in p.geometry.kinds()) or 1
        self.kinds = [(size / unit, blocks) for size, blocks in p.geometry.kinds()]
        self.cpu = cap.cpu_bytes / unit
        options = np.arange(p.opt_req.size)
        split, _ = fits(p.counts(options), self.kinds, self.cpu, cap.gpu_blocks)
        self.ok = options[split]
        self.req = p.opt_req[self.ok]
        self.tokens = p.opt_k[self.ok] * p.geometry.chunk_tokens
        self.free_runs = np.maximum(cap.gpu_blocks - p.running, 0.0)

    def dual(self, prices: np.ndarray) -> tuple[float, np.ndarray]:
        """(U at `prices` ((4, n): CPU and pool at gaps, CPU and pool during runs), per
        request the chosen option, -1 for none)."""
        p, ok, n = self.p, self.ok, self.p.requests
        cpu_gap, gpu_gap, cpu_run, gpu_run = prices
        costs = []
        for size, blocks in self.kinds:
            gap = np.concatenate(([0.0], np.cumsum(np.minimum(size * cpu_gap, blocks * gpu_gap))))
            run = np.concatenate(([0.0], np.cumsum(np.minimum(size * cpu_run, blocks * gpu_run))))
            costs.append((gap, run))

        def held(kind: int, start: np.ndarray, end: np.ndarray) -> np.ndarray:
            gap, run = costs[kind]
            return gap[end] - gap[start] + run[end] - run[start + 1]

        base = p.seg_offset[self.req]
        k = p.opt_k[ok]
        per_chunk = [
            np.concatenate(([0.0], np.cumsum(held(i, p.seg_start, p.seg_req))))
            for i in range(1 + len(p.geometry.windows))
        ]
        cost = per_chunk[0][base + k] - per_chunk[0][base]
        for w in range(len(p.geometry.windows)):
            prefix = per_chunk[1 + w]
            cost = cost + prefix[base + k] - prefix[base + p.opt_window[w][ok]]
        if p.geometry.state_bytes:
            cost = cost + held(len(self.kinds) - 1, p.opt_state[ok], self.req)
        value = self.tokens - cost
        chosen = np.full(n, -1, dtype=np.int64)
        fixed = float(
            self.cpu * (cpu_gap.sum() + cpu_run.sum())
            + self.cap.gpu_blocks * gpu_gap.sum()
            + self.free_runs @ gpu_run
        )
        if not ok.size:
            return fixed, chosen
        order = np.lexsort((-value, self.req))
        first = np.ones(order.size, dtype=bool)
        first[1:] = self.req[order[1:]] != self.req[order[:-1]]
        top = order[first]
        good = value[top] > 0
        chosen[self.req[top[good]]] = ok[top[good]]
        return fixed + float(value[top[good]].sum()), chosen

    def gradient(self, prices: np.ndarray, chosen: np.ndarray) -> np.ndarray:
        """A subgradient of U at `prices`: capacity less what the chosen hits hold, each
        item where it costs least."""
        gaps, runs = self.p.cover(chosen)
        grad = np.empty_like(prices)
        for moment, held, gpu in ((0, gaps, self.cap.gpu_blocks), (2, runs, self.free_runs)):
            cpu_price, gpu_price = prices[moment], prices[moment + 1]
            cpu_used = np.zeros(self.p.requests)
            gpu_used = np.zeros(self.p.requests)
            for i, (size, blocks) in enumerate(self.kinds):
                on_cpu = size * cpu_price <= blocks * gpu_price
                cpu_used += np.where(on_cpu, held[i] * size, 0.0)
                gpu_used += np.where(on_cpu, 0.0, held[i] * blocks)
            grad[moment] = self.cpu - cpu_used
            grad[moment + 1] = gpu - gpu_used
        return grad

    def feasible(self, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per gap and per run, whether a placement of the chosen hits' items exists."""
        gaps, runs = self.p.cover(chosen)
        return (
            fits(gaps, self.kinds, self.cpu, self.cap.gpu_blocks)[1],
            fits(runs, self.kinds, self.cpu, self.free_runs)[1],
        )


def _schedule(priced: _Priced, chosen: np.ndarray) -> tuple[int, np.ndarray]:
    """A schedule M allows, from per-request choices that may not fit: at the first
    moment without a placement, of the chosen hits holding items then the one with the
    most bytes per token it hits is dropped, until every moment has one; then requests,
    longest options first, take the longest option that still fits. (tokens, choices)"""
    p = priced.p
    chosen = chosen.copy()
    sizes = np.array([size for size, _ in priced.kinds])
    density = (p.counts(np.arange(p.opt_req.size)).T @ sizes) / np.maximum(p.opt_k, 1)
    while True:
        gap_ok, run_ok = priced.feasible(chosen)
        gap = np.flatnonzero(~gap_ok)
        run = np.flatnonzero(~run_ok)
        if not gap.size and not run.size:
            break
        hits = np.flatnonzero(chosen >= 0)
        first = p.opt_first[chosen[hits]]
        if gap.size and (not run.size or gap[0] < run[0]):
            holding = hits[(first <= gap[0]) & (hits > gap[0])]  # over gap t
        else:
            holding = hits[(first < run[0]) & (hits > run[0])]  # through run r
        chosen[holding[np.argmax(density[chosen[holding]])]] = -1
    for option in np.argsort(-p.opt_k, kind="stable"):
        r = int(p.opt_req[option])
        if chosen[r] >= 0 and p.opt_k[chosen[r]] >= p.opt_k[option]:
            continue
        before = chosen[r]
        chosen[r] = option
        gap_ok, run_ok = priced.feasible(chosen)
        if not (gap_ok.all() and run_ok.all()):
            chosen[r] = before
    hits = chosen >= 0
    return int((p.opt_k[chosen[hits]] * p.geometry.chunk_tokens).sum()), chosen


def bound(p: Packing, cap: Capacity, iterations: int = 300, tolerance: float = 1e-3) -> Bound:
    """The oracle at capacity `cap` (module docstring): the lowest dual bound over at most
    `iterations` subgradient steps, stopping early once it is within `tolerance` (a share
    of the prompt tokens) of the best schedule found."""
    priced = _Priced(p, cap)
    unlimited = np.zeros(p.requests, dtype=np.int64)
    np.maximum.at(unlimited, p.opt_req, p.opt_k * p.geometry.chunk_tokens)
    prices = np.zeros((4, p.requests))
    upper, chosen = priced.dual(prices)
    lower = _schedule(priced, chosen)[0]
    theta, stall, steps = 1.0, 0, 0
    while steps < iterations and upper - lower > tolerance * p.prompt_tokens and theta > 1e-4:
        steps += 1
        dual, chosen = priced.dual(prices)
        if dual < upper:
            upper, stall = dual, 0
        else:
            stall += 1
            if stall >= 8:
                theta, stall = theta / 2, 0
        if steps % 100 == 0:
            lower = max(lower, _schedule(priced, chosen)[0])
        grad = priced.gradient(prices, chosen)
        norm = float((grad * grad).sum())
        if norm == 0:
            break
        prices = np.maximum(0.0, prices - theta * (dual - lower) / norm * grad)
    lower = max(lower, _schedule(priced, priced.dual(prices)[1])[0])
    return Bound(cap, upper, lower, int(unlimited.sum()), p.prompt_tokens, steps)
