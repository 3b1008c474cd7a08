"""The index keeps nothing per boundary or per entry that CPython's garbage collector
walks (core/tracked.py): at a million entries a full collection, on vLLM's scheduler
thread, followed 2.9 million of its references and took 190-300 ms (docs/benchmarks.md).
Here the references a collection follows from the index must not grow with what it
holds: ten times the boundaries, chains and evictions, about the same count."""

from __future__ import annotations

import random

from hybridkv.core.index import StoreIndex
from hybridkv.core.keys import group_key
from hybridkv.core.tracked import references_followed

ATTN, STATES = 0, (1, 2, 3)


def fill(boundaries: int, seed: int) -> StoreIndex:
    """Conversations on shared heads, each turn a boundary extending the last, in CPU
    memory a third of the size they need (so evictions run), some chunks pinned."""
    rng = random.Random(seed)
    index = StoreIndex(boundaries * 150, recurrent=True)
    chains: list[list[bytes]] = []
    for n in range(boundaries):
        if chains and rng.random() < 0.7:
            chain = rng.choice(chains)  # the conversation's next turn
        else:
            chain = [group_key(rng.randbytes(16), ATTN) for _ in range(rng.randint(1, 3))]
            chains.append(chain)
        parent = index.boundary_id(group_key(chain[-1], STATES[0]))
        chain += [group_key(rng.randbytes(16), ATTN) for _ in range(rng.randint(1, 3))]
        for key in chain:
            index.admit(key, 100)
        states = [(group_key(chain[-1], g), 100) for g in STATES]
        index.admit_boundary(states, list(chain), 256 * len(chain), 300 + 100 * 3, parent)
        if n % 7 == 0:
            index.pin(chain[:1])
        index.take_orders()
    return index


def test_what_a_collection_follows_from_the_index_does_not_grow_with_it():
    seed = 2712
    print("seed", seed)
    small, large = fill(300, seed), fill(3000, seed)
    assert large.gauges()["cpu_boundaries"] > 5 * small.gauges()["cpu_boundaries"]
    assert large.stats.cpu_evictions > 1000
    follows_small, follows_large = references_followed(small), references_followed(large)
    print("references followed", follows_small, follows_large)
    assert follows_large < follows_small + 300
