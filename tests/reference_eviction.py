"""The slow reference's eviction order (tests/reference_index.py): core/eviction.py as it
was at 2cd1352; only this docstring differs.

What a recurrent-state boundary is worth keeping in CPU memory.

A hit on a hybrid model with recurrent layers resumes at a *boundary*: every recurrent
group's state at one chunk boundary, plus the attention chunks before it. A boundary at
B tokens saves the prefill of B tokens (every layer's work for each of them) and costs
its states plus the attention chunks since the previous boundary kept for the same
chain (the ones before are paid for by that one). LRU over entries ignores both: it
evicts the shared head of a chain as readily as a useless suffix, and one state of a
boundary while keeping the others.

Following Marconi (Pan et al., 2024), the utility of a boundary is

    utility = recency + alpha * efficiency

with both terms scaled to [0, 1] over the boundaries that could be evicted now:
recency is the boundary's last use (admission or hit) on the index's logical clock,
min-max scaled; efficiency is tokens saved per byte kept, B / own_bytes, divided by the
largest among them. The boundary with the lowest utility is evicted first, within each
segment below. Superseded boundaries (exactly one longer one) go first, by recency,
then the leaf boundaries (no longer boundary of their chain in CPU memory), then the
branch points (core/index.py). Prefill cost is taken as linear in B: the recurrent and
MLP layers of a hybrid model dominate, and the quadratic attention term would only
favour long boundaries more.

`alpha` (config `eviction_alpha`, default 0.25) was chosen by replaying the traces of
bench/hit_rate.py at each one's tightest interesting budget (docs/benchmarks.md): 0 and
0.25 served the most on chat and document QA, 1 and 4 a little more on the agent trace
(0.24 against 0.22 of prompt tokens) and far less on chat (alpha 4: 0.08 against 0.24).
Efficiency favours the longest chains, and in a chat those are the conversations about
to end. `alpha = 0` is LRU over whole boundaries.

Recency fails a working set larger than the budget that comes back in turn (documents
asked about in rounds, conversations taking turns): LRU evicts each entry just before
its next use (on the docqa trace hybridkv then served less than vLLM's LRU). The index
detects that from *returns*: it remembers recently evicted chunks, and one stored again
is a return, whose gap (logical ticks from its last use to its return) estimates how
long the workload takes to come back. While returns are a minority of what is stored,
`eviction_order` is utility (recency first): a budget a little short of a
recency-friendly working set (a chat) keeps its newest entries. While they are most of
it, the workload loops, and among leaves and likewise among branch points:
1. *dead* boundaries, idle for more than a few typical gaps, go first, by utility;
2. then live ones, most recently used first: the one used last is the one whose next
   use is furthest away, which is Belady's choice in a loop; a fixed set then stays
   and hits every time round;
3. *protected* ones last: reused since admission (a hit, or vLLM's own), the most
   recently used of them up to a share of the budget (segmented LRU's protected
   segment; the older ones are ordered with the rest).
Switching to that order at the first return instead cost chat 13-16 % of its connector
hits at 6-8 MiB against utility alone; switching by the share of returns gained there
(docs/benchmarks.md, "Hit rate at equal CPU bytes").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter


@dataclass
class Boundary:
    """A boundary whose states are all in CPU memory."""

    tokens: int  # a hit here saves the prefill of this many tokens
    states: tuple[bytes, ...]  # one entry per recurrent group; the first names it
    needs: tuple[bytes, ...]  # attention entries a hit here also reads
    own_bytes: int  # its states plus the chunks after the chain's previous boundary
    used: int  # logical time of its last use
    parent: bytes | None = None  # the chain's previous boundary in CPU memory
    reused: bool = False  # used again since its admission (a hit, or vLLM's own)


_USED = attrgetter("used")


def eviction_order(
    boundaries: Sequence[Boundary], alpha: float, room: float, now: int, live_for: float | None
) -> list[Boundary]:
    """`boundaries` from the first to evict to the last (see the module docstring).
    `room`: bytes the protected ones may take; `live_for`: ticks an idle boundary stays
    live, None unless the workload loops.

    It runs on the scheduler's thread over every evictable boundary (10,000 in a large
    budget), so it sorts on precomputed keys and skips the passes that cannot matter."""
    live = boundaries if live_for is None else [b for b in boundaries if now - b.used <= live_for]
    reused = sorted((b for b in live if b.reused), key=_USED, reverse=True)
    protected: list[Boundary] = []
    held = 0
    for b in reused:
        if held + b.own_bytes > room:
            break
        held += b.own_bytes
        protected.append(b)
    if live_for is None and not protected:
        return by_utility(boundaries, alpha)
    later = {id(b) for b in protected}
    looping = [] if live_for is None else [b for b in live if id(b) not in later]
    later.update(id(b) for b in looping)
    first = [b for b in boundaries if id(b) not in later]
    return [
        *by_utility(first, alpha),
        *sorted(looping, key=_USED, reverse=True),
        *by_utility(protected, alpha),
    ]


def by_utility(candidates: Sequence[Boundary], alpha: float) -> list[Boundary]:
    """`candidates` from the lowest utility to the highest (ties keep their order)."""
    if not candidates:
        return []
    used = [b.used for b in candidates]
    saved = [b.tokens / (b.own_bytes or 1) for b in candidates]  # tokens per byte
    oldest = min(used)
    span = max(max(used) - oldest, 1)
    best = max(saved) or 1.0
    keys = [(u - oldest) / span + alpha * e / best for u, e in zip(used, saved, strict=True)]
    return [candidates[i] for i in sorted(range(len(keys)), key=keys.__getitem__)]
