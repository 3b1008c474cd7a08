"""Which blocks a schedule hands to a request (vllm/handover.py), on vLLM's own scheduler
output and block objects: every block a step's zeroing, state copy, forward or load may
write, and none of the prefix hits it only reads; those another connector loads apart."""

from __future__ import annotations

from dataclasses import replace

from hybridkv.vllm.handover import Handover


def blocks(*groups: list[tuple[int, bool]]):
    """vLLM's KVCacheBlocks: per group, (block id, a prefix-cache hit: it has a hash);
    block 0 is vLLM's null block."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

    out = []
    for group in groups:
        row = []
        for block_id, hit in group:
            b = KVCacheBlock(block_id, is_null=block_id == 0)
            if hit:
                b.set_block_hash(make_block_hash_with_group_id(b"h%d" % block_id, 0))
            row.append(b)
        out.append(row)
    return KVCacheBlocks(tuple(out))


def output(new=(), cached=(), scheduled=(), sync_loads: bool = False):
    """`new`: (request, block ids by group, computed tokens); `cached`: the same with
    whether it resumes."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [
        NewRequestData(r, [], [], None, None, ids, computed, None) for r, ids, computed in new
    ]
    out.scheduled_cached_reqs = replace(
        CachedRequestData.make_empty(),
        req_ids=[r for r, *_ in cached],
        resumed_req_ids={r for r, _, _, resumed in cached if resumed},
        new_block_ids=[ids for _, ids, _, _ in cached],
        num_computed_tokens=[computed for _, _, computed, _ in cached],
    )
    out.num_scheduled_tokens = dict.fromkeys([*scheduled, *(r for r, *_ in new)], 1)
    out.has_sync_kv_loads = sync_loads
    return out


def test_new_and_resumed_requests_hand_over_their_blocks_past_what_they_computed():
    h = Handover([16, 32])  # an attention group of 16-token blocks, one of 32
    out = output(
        new=[("n", ([1, 2, 3], [0, 4]), 32)],  # 32 tokens hit: attention blocks 1, 2 read
        cached=[
            ("run", ([5], [6]), 48, False),  # a running request's new blocks
            ("back", ([7, 8], [0, 9]), 16, True),  # resumed: its whole table again
            ("idle", None, 64, False),
        ],
    )
    handed, foreign = h.take(out)
    assert sorted(handed) == [3, 4, 5, 6, 8, 9] and foreign == []


def test_blocks_allocated_for_a_load_are_handed_over_and_another_connectors_apart():
    h = Handover([16])
    h.admitted("ours", blocks([(1, True), (2, False), (3, False)]), ours=True)
    h.admitted("theirs", blocks([(4, True), (5, False), (0, False)]), ours=False)
    h.admitted("now", blocks([(6, False)]), ours=False)  # scheduled: counted as new
    handed, foreign = h.take(output(scheduled=["now"]))
    assert sorted(handed) == [2, 3] and foreign == [5]
    assert h.take(output()) == ([], [])  # each admission counts in its own step


def test_a_step_with_synchronous_loads_counts_every_block_handed_over_as_another_connectors():
    h = Handover([16])
    handed, foreign = h.take(output(new=[("n", ([1, 2],), 0)], sync_loads=True))
    assert handed == [] and sorted(foreign) == [1, 2]


def test_blocks_another_connector_loads_synchronously_are_handed_over():
    """MultiConnector: another connector's synchronous hit of 32 tokens is scheduled in
    the step it is admitted, its computed tokens counting the loaded ones, so the blocks
    the load writes (1 and 2) are not past them; they count from the admission."""
    h = Handover([16])
    h.admitted("n", blocks([(1, False), (2, False), (3, False)]), ours=False)
    handed, foreign = h.take(output(new=[("n", ([1, 2, 3],), 32)], sync_loads=True))
    assert handed == [] and sorted(set(foreign)) == [1, 2, 3]


def test_blocks_the_step_zeroes_or_copies_into_are_handed_over():
    """vLLM's Mamba manager may move a running request's checkpoint into a fresh block
    that no table lists (`cow_block`), written by the step's copies before its forward;
    a store in flight may still be reading that block."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    h = Handover([16])
    out = output()
    out.new_block_ids_to_zero = [11]
    out.kv_cache_block_copies = [KVCacheBlockCopy(3, 12)]  # block 3's state into 12
    handed, foreign = h.take(out)
    assert sorted(handed) == [11, 12] and foreign == []
