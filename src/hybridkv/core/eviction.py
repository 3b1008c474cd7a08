"""What a recurrent-state boundary is worth keeping in CPU memory.

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

Utility alone is recency first, and recency fails a workload that loops over more than
fits: documents asked about in turn, each evicted just before it comes back (on the
docqa trace hybridkv then served less than vLLM's LRU). So leaves, and likewise branch
points, are split (`eviction_order`) and evicted in this order:
1. *fresh* leaves, by utility;
2. *returning* leaves, most recently used first: stored again after CPU memory evicted
   chunks they need (the index remembers evicted chunks). A return says the working
   set is larger than the budget; evicting the newest keeps a fixed set that hits
   every time round, which is what Belady's choice does in a loop;
3. *protected* leaves, by utility: reused since admission (a hit, or vLLM's own), the
   most recently used of them up to a share of the budget (segmented LRU's protected
   segment; older ones count as fresh).
Both marks lapse once a leaf has been idle for more than a few times the typical return
gap (logical ticks between a chunk's last use and its return), so a loop that has ended
gives its memory back to the next one instead of holding it for ever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


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
    returning: bool = False  # stored again after CPU memory evicted its chunks
    junction: bool = False  # stored below a longer boundary of another chain: a fork


def eviction_order(
    leaves: Sequence[Boundary], alpha: float, room: float, now: int, stale_after: float
) -> list[Boundary]:
    """Leaf boundaries from the first to evict to the last. A boundary used within the
    last `stale_after` ticks is *live*. Protected, evicted last: the most recently used
    live boundaries reused since admission, up to `room` bytes. Before them, live
    returning ones, most recently used first. First of all the rest (fresh, stale, or
    reused beyond `room`), by utility."""
    live = [b for b in leaves if now - b.used <= stale_after]
    reused = sorted((b for b in live if b.reused), key=lambda b: b.used, reverse=True)
    protected: list[Boundary] = []
    held = 0
    for b in reused:
        if held + b.own_bytes > room:
            break
        held += b.own_bytes
        protected.append(b)
    later = {id(b) for b in protected}
    looping = [b for b in live if b.returning and id(b) not in later]
    later.update(id(b) for b in looping)
    first = [b for b in leaves if id(b) not in later]
    return [
        *sorted(first, key=utility(first, alpha)),
        *sorted(looping, key=lambda b: b.used, reverse=True),
        *sorted(protected, key=utility(protected, alpha)),
    ]


def utility(candidates: Sequence[Boundary], alpha: float) -> Callable[[Boundary], float]:
    """The sort key that orders `candidates` from the first to evict to the last."""
    if not candidates:
        return lambda b: 0.0
    oldest = min(b.used for b in candidates)
    span = max(max(b.used for b in candidates) - oldest, 1)
    best = max(b.tokens / max(b.own_bytes, 1) for b in candidates) or 1.0

    def key(b: Boundary) -> float:
        return (b.used - oldest) / span + alpha * (b.tokens / max(b.own_bytes, 1)) / best

    return key
