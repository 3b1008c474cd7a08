"""Which blocks of which group to store and load, and the hit rule.

Tokens are cut into chunks of `chunk_tokens`, a size every group's block tiles. A stored
entry is one group's blocks for one chunk (for a recurrent group: the one state at the
chunk's end boundary). The planner works in token positions and block indices only; it
never sees bytes, so it is the same on the scheduler side (deciding) and in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridkv.core.layout import GroupKind, GroupSpec

NULL_BLOCK = 0  # vLLM's placeholder for out-of-window / retired positions
_MAX_TILE_FACTOR = 16  # refuse chunk sizes this many times the largest block


class PlanError(ValueError):
    pass


def choose_chunk_tokens(block_tokens: Sequence[int], override: int | None = None) -> int:
    """The chunk size: the largest block size when every other one divides it.

    vLLM's page-size unification makes hybrid block sizes multiples of one another, so
    this is the common case and costs nothing. Otherwise the least common multiple is
    used, but only while it stays within a small factor of the largest block: a blown-up
    chunk would make hits coarse and entries huge, so we fail and ask for `chunk_tokens`.
    """
    sizes = sorted(set(block_tokens))
    if not sizes:
        raise PlanError("no KV cache groups to plan for")
    if override is not None:
        bad = [s for s in sizes if override % s]
        if bad:
            raise PlanError(
                f"chunk_tokens: {override} is not a multiple of group block size(s) {bad}"
            )
        return override
    lcm = math.lcm(*sizes)
    if lcm > _MAX_TILE_FACTOR * sizes[-1]:
        raise PlanError(
            f"chunk_tokens: group block sizes {sizes} only tile at {lcm} tokens; "
            "set chunk_tokens explicitly"
        )
    return lcm


@dataclass(frozen=True)
class EntryCopy:
    """Copy between one stored entry (group, chunk) and engine blocks.

    `slots[i]` is the block's position inside the entry, `block_ids[i]` the engine block.
    """

    group: int
    chunk: int
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]


class Planner:
    def __init__(self, groups: Sequence[GroupSpec], chunk_tokens: int | None = None):
        self.groups = tuple(groups)
        self.chunk_tokens = choose_chunk_tokens([g.block_tokens for g in groups], chunk_tokens)

    # ---- sizes -------------------------------------------------------------------------
    def blocks_per_entry(self, g: int) -> int:
        spec = self.groups[g]
        return 1 if spec.kind is GroupKind.STATE else self.chunk_tokens // spec.block_tokens

    def entry_bytes(self, g: int) -> int:
        return self.blocks_per_entry(g) * self.groups[g].block_bytes

    def max_hit_chunks(self, num_tokens: int) -> int:
        """vLLM must compute at least the last of a request's `num_tokens` (its prompt's,
        or a resumed one's output token), so a hit stops before it."""
        return max(num_tokens - 1, 0) // self.chunk_tokens

    # ---- what a hit at boundary B needs ------------------------------------------------
    def needed_blocks(self, g: int, local_tokens: int, boundary: int) -> range:
        """Block indices of group g that must be loaded to resume at `boundary`.

        Blocks below the local (engine) hit are already in place. Sliding groups need only
        the window behind the boundary; recurrent groups only the state at the boundary.
        """
        spec = self.groups[g]
        bs = spec.block_tokens
        if boundary <= local_tokens:
            return range(0)
        if spec.kind is GroupKind.STATE:
            return range(boundary // bs - 1, boundary // bs)
        first = local_tokens
        if spec.kind is GroupKind.SLIDING:
            first = max(first, boundary - spec.window)
        return range(first // bs, boundary // bs)

    def needed_chunks(self, g: int, local_tokens: int, boundary: int) -> range:
        blocks = self.needed_blocks(g, local_tokens, boundary)
        if not blocks:
            return range(0)
        if self.groups[g].kind is GroupKind.STATE:
            return range(boundary // self.chunk_tokens - 1, boundary // self.chunk_tokens)
        per = self.blocks_per_entry(g)
        return range(blocks.start // per, (blocks.stop - 1) // per + 1)

    def find_hit(
        self,
        num_tokens: int,
        local_tokens: int,
        present: Callable[[int, int], bool],
        run: Callable[[int, int, int], int] | None = None,
    ) -> int:
        """The largest chunk boundary (in tokens) every group can be restored to, else 0.

        `present(g, chunk)` says whether group g's entry for `chunk` is stored. `run(g,
        start, stop)`, if given, how many chunks from `start` on (before `stop`) group g
        has stored without a gap, as `present` would say chunk by chunk: a caller that
        answers for many keys at once (the scheduler side, a 24k-token prompt's 96
        chunks) finds a full-attention run in one call. Only boundaries beyond the local
        hit count: the result is 0 or > `local_tokens`.
        """
        C = self.chunk_tokens
        k_max = self.max_hit_chunks(num_tokens)
        k_min = local_tokens // C + 1  # smallest boundary beyond the local hit
        if k_max < k_min:
            return 0
        # Full-attention groups need a contiguous run from the local hit: find its end once.
        start = local_tokens // C
        for g, spec in enumerate(self.groups):
            if spec.kind is GroupKind.FULL:
                if run is not None:
                    k_max = start + run(g, start, k_max)
                    continue
                k = start
                while k < k_max and present(g, k):
                    k += 1
                k_max = k
        windowed = [g for g, s in enumerate(self.groups) if s.kind is not GroupKind.FULL]
        for k in range(k_max, k_min - 1, -1):
            B = k * C
            if all(present(g, c) for g in windowed for c in self.needed_chunks(g, local_tokens, B)):
                return B
        return 0

    # ---- copy plans ----------------------------------------------------------------------
    def _copies(self, g: int, indices: range, block_ids: Sequence[int]) -> list[EntryCopy]:
        """Group block indices by entry, skipping null blocks."""
        per = self.blocks_per_entry(g)
        by_chunk: dict[int, tuple[list[int], list[int]]] = {}
        for i in indices:
            bid = block_ids[i] if i < len(block_ids) else NULL_BLOCK
            if bid == NULL_BLOCK:
                continue
            slots, ids = by_chunk.setdefault(i // per, ([], []))
            slots.append(i % per)
            ids.append(bid)
        return [EntryCopy(g, c, tuple(s), tuple(b)) for c, (s, b) in sorted(by_chunk.items())]

    def load_plan(
        self, local_tokens: int, boundary: int, block_ids: Sequence[Sequence[int]]
    ) -> list[EntryCopy]:
        """Entry → block copies that restore every group to `boundary`."""
        C = self.chunk_tokens
        plan: list[EntryCopy] = []
        for g, spec in enumerate(self.groups):
            need = self.needed_blocks(g, local_tokens, boundary)
            if spec.kind is GroupKind.STATE:
                copies = self._copies(g, need, block_ids[g])
                if not copies:
                    raise PlanError(f"group {g}: no engine block to restore state at {boundary}")
                plan.append(EntryCopy(g, boundary // C - 1, (0,), copies[0].block_ids))
            else:
                plan.extend(self._copies(g, need, block_ids[g]))
        return plan

    def store_plan(self, chunks: range, block_ids: Sequence[Sequence[int]]) -> list[EntryCopy]:
        """Copies that store `chunks` (newly computed) of every attention group.

        A chunk is stored only whole: a sliding group whose old blocks were already
        released for that chunk simply has no entry for it. Recurrent states are not
        planned from block tables (see `state_copy`).
        """
        plan: list[EntryCopy] = []
        for g, spec in enumerate(self.groups):
            if spec.kind is GroupKind.STATE:
                continue
            per = self.blocks_per_entry(g)
            for c in chunks:
                copies = self._copies(g, range(c * per, (c + 1) * per), block_ids[g])
                if copies and len(copies[0].slots) == per:
                    plan.append(copies[0])
        return plan

    def state_copy(self, g: int, boundary: int, block_id: int) -> EntryCopy:
        """The copy that stores group g's state at `boundary` (a chunk boundary) from the
        block the engine reports holding it."""
        if self.groups[g].kind is not GroupKind.STATE or boundary <= 0:
            raise PlanError(f"group {g}: no recurrent state at boundary {boundary}")
        if boundary % self.chunk_tokens:
            raise PlanError(f"boundary {boundary} is not a multiple of {self.chunk_tokens}")
        return EntryCopy(g, boundary // self.chunk_tokens - 1, (0,), (block_id,))
