"""Which blocks a schedule hands to a request, for the workers' stores still reading them
(scheduler side).

On a GPU a store copies its blocks out on a side stream after the step's forward and
lands later (core/copy_engine.py); the compute stream does not wait for it. A finished
request's blocks stay its own until the workers report its stores landed (vLLM's delayed
free: `request_finished` returns True, vllm/scheduler_side.py). vLLM frees other blocks
while their request runs, and no connector hook delays those frees:
- `SingleTypeKVCacheManager.remove_skipped_blocks` (v1/core/single_type_kv_cache_manager.py),
  called from `KVCacheManager.allocate_slots` at every schedule and from
  `Scheduler._connector_finished` just before `request_finished`, frees sliding-window
  blocks that left the window and, in Mamba align mode, the superseded state blocks
  (`MambaManager.remove_skipped_blocks`), counting only the tokens whose step has been
  processed (`num_computed_tokens - num_in_flight_tokens`): a block the step N forward
  wrote can go at schedule N+1 (N+2 under async scheduling);
- `Scheduler._preempt_request` frees all of a preempted request's blocks, in the very
  schedule that needs them.
Such a block may go to another request in the same schedule, and the step's zeroing,
state pre-copy, forward or load then rewrites it. So each step's metadata lists the
blocks its schedule handed to a request; each worker compares them with the blocks its
stores in flight read (`WorkerSide.guard`).

A block counts as handed over when it is new to its request: a scheduled new or resumed
request's blocks past the tokens it has computed (those before are vLLM's prefix hits,
read, never rewritten), a running request's new blocks, the blocks the step zeroes or
copies into before its forward (in no table, for a Mamba copy-on-write), and the blocks
vLLM allocates for
an asynchronous load (`update_state_after_alloc`; those without a block hash, i.e. not
prefix hits), whose request is scheduled only once the load is done. A load of another
connector (MultiConnector) writes them outside any stream of this engine, as does any
synchronous load (its request is scheduled in the same step, its blocks counted from
the admission, not past its computed tokens, which include the loaded ones): those are
listed apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridkv.core.planner import NULL_BLOCK

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput


class Handover:
    def __init__(self, block_tokens: Sequence[int]):
        """`block_tokens`: each KV cache group's block size."""
        self.block_tokens = tuple(block_tokens)
        # Admissions since the last step: request -> (its new blocks, hybridkv loads them).
        self._admitted: dict[str, tuple[list[int], bool]] = {}

    def admitted(self, req_id: str, blocks: KVCacheBlocks, ours: bool) -> None:
        """vLLM gave a waiting request its blocks (`update_state_after_alloc`); `ours`:
        hybridkv loads into them."""
        self._admitted[req_id] = (
            [
                b.block_id
                for group in blocks.blocks
                for b in group
                if not b.is_null and b.block_hash is None
            ],
            ours,
        )

    def take(self, out: SchedulerOutput) -> tuple[list[int], list[int]]:
        """The blocks this schedule handed to a request: those written in the order of
        the engine's compute stream (its zeroing, state copies and forwards, and
        hybridkv's loads, which wait for it), and those another connector loads into."""
        handed: list[int] = []
        for new in out.scheduled_new_reqs:
            handed += self._past(new.block_ids, new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                # A resumed request's list is its whole table; a running one's, its new blocks.
                resumed = req_id in cached.resumed_req_ids
                handed += self._past(ids, cached.num_computed_tokens[i] if resumed else 0)
        # Blocks the runner zeroes, or copies a block into, before the forward, whether or
        # not a request's table lists them: vLLM's Mamba manager moves a running request's
        # checkpoint to a block of no table (a copy-on-write `cow_block`).
        handed += out.new_block_ids_to_zero or []
        handed += [copy.dst_block_id for copy in out.kv_cache_block_copies or ()]
        foreign: list[int] = []
        for req_id, (blocks, ours) in self._admitted.items():
            if req_id not in out.num_scheduled_tokens:  # waits for a load
                (handed if ours else foreign).extend(blocks)
            elif not ours and out.has_sync_kv_loads:
                # Scheduled at once after another connector's synchronous load: its
                # computed tokens count the loaded ones, so `_past` left out the blocks
                # that load writes (those after them are counted above).
                foreign.extend(blocks)
        self._admitted = {}
        if out.has_sync_kv_loads:  # another connector writes some of them before the forward
            return [], handed + foreign
        return handed, foreign

    def _past(self, block_ids: Sequence[Sequence[int]], computed: int) -> list[int]:
        """Each group's blocks past its first `computed` tokens."""
        return [
            b
            for g, ids in enumerate(block_ids)
            for b in ids[computed // self.block_tokens[g] :]
            if b != NULL_BLOCK
        ]
