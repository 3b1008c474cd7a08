"""Lookups vLLM asks for in cases a plain new prompt does not show. Through vLLM's real
`Scheduler` without a model (test_async_scheduling's `Engine`).

A request that reads no prefix cache: vLLM sets `skip_reading_prefix_cache` for prompt
logprobs (a restored prefix has no logprobs) and then discards whatever hit the connector
answers. hybridkv must not act on a lookup for it: no promotion from a lower tier (each
takes CPU room and a read), no lookup or hit counted. The prompt is stored on disk by a
first engine, so only the second engine's lookup could start promotions.

A resumed request: looked up again over its output too, whose chunks hybridkv may never
have keyed, or has stored with its decode-time state. A request vLLM cannot allocate for
yet: asked again every step.
"""

from __future__ import annotations

import pytest
from slow_copies import SlowCopies
from test_async_scheduling import MODES, C, Engine, _prompt, config_dir, stored_on_disk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return config_dir(tmp_path_factory)


def add_reading_no_cache(eng: Engine, req_id: str, prompt: list[int]):
    """As `Engine.add`, with prompt logprobs asked for (vLLM then skips its caches)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False, prompt_logprobs=1)
    req = Request(req_id, list(prompt), sp, None, block_hasher=eng.hasher)
    assert req.skip_reading_prefix_cache
    eng.sched.add_request(req)
    eng.requests[req_id] = req
    return req


def test_a_request_reading_no_cache_orders_no_promotion_and_counts_no_lookup(model_dir, tmp_path):
    disk = {"disk_path": str(tmp_path / "kv")}
    prompt = stored_on_disk(model_dir, disk)

    eng = Engine(model_dir, False, seed=13, extra=disk)
    side = eng.side
    eng.add("w", _prompt(40, 99), max_tokens=2)  # the workers' disks are listed after it
    eng.run(limit=100_000)
    assert side.index.ready() and side.stats.lookups == 1
    waits = side.stats.waits
    b = add_reading_no_cache(eng, "b", prompt)
    eng.run()
    assert b.is_finished() and eng.first_start["b"] == 0
    assert side.index.stats.promotions == 0 and side.index.stats.failed_promotions == 0
    assert side.stats.lookups == 1 and side.stats.waits == waits
    assert side.index.ledger.held_bytes == 0
    eng.worker.close()
    # The entries were there to be found: in another engine on the same disk, the same
    # prompt read as usual is promoted and hits.
    control = Engine(model_dir, False, seed=13, extra=disk)
    c = control.add("c", prompt, max_tokens=2)
    control.run(limit=100_000)
    assert c.is_finished() and control.first_start["c"] > 0
    assert control.side.index.stats.promotions > 0 and control.side.stats.lookups == 1


def test_a_resumed_requests_own_hit_past_its_keyed_chunks_is_a_plain_lookup(model_dir):
    """A preempted request is looked up again over its prompt and its output so far; vLLM's
    own cache may hold output blocks hybridkv never stored (their store was dropped at the
    preemption). Marking vLLM's hit as a use read keys past the request's chain (the
    lookup keyed the prompt alone): an IndexError, a logged traceback and a hook error on
    every such lookup. Now the output is keyed too, and nothing stored there is a miss."""
    from vllm.v1.request import RequestStatus

    eng = Engine(model_dir, False, seed=23)
    prompt = _prompt(40, 81)
    eng.add("a", prompt, max_tokens=2)
    eng.run()
    side = eng.side
    resumed = eng.add("r", prompt, max_tokens=60)
    # Only its `Request` is wanted: vLLM re-looks-up a preempted one, outputs and all.
    eng.sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    for t in _prompt(40, 82):  # its output before the preemption, never keyed here
        resumed.append_output_token_ids(t)
    answer = side.num_new_matched_tokens(resumed, 64)  # vLLM's own hit: 4 chunks
    assert answer == 0 and side.stats.hook_errors == 0
    side.request_finished(resumed)


def answers_to(side, req_id: str, resumed: bool = False) -> list[tuple[int, int, int | None]]:
    """Record the lookups of request `req_id` (once preempted, if `resumed`) as they are
    answered: (its tokens, vLLM's own hit, hybridkv's answer)."""
    answers: list[tuple[int, int, int | None]] = []
    lookup = side.num_new_matched_tokens

    def recorded(request, local_tokens):
        n = lookup(request, local_tokens)
        if request.request_id == req_id and (request.num_preemptions or not resumed):
            answers.append((request.num_tokens, local_tokens, n))
        return n

    side.num_new_matched_tokens = recorded
    return answers


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_request_preempted_mid_decode_resumes_from_its_decode_time_state(
    model_dir, async_scheduling
):
    """A long decode vLLM preempts (a pool too small for both requests: the later one
    goes) is recomputed over its prompt and its output so far. Once vLLM's own cache has
    lost its blocks to the other request, hybridkv restores it up to the last chunk
    boundary short of its last token: its decode-time chunks and staged state, not the
    prompt's checkpoint alone (32 tokens: the lookup used to stop at the prompt). The
    fake runner checks every restored byte against the tokens it stands for."""
    eng = Engine(model_dir, async_scheduling, seed=3, num_blocks=40)
    side = eng.side
    answers = answers_to(side, "a")
    eng.add("hog", _prompt(60, 1), max_tokens=200)
    a = eng.add("a", _prompt(40, 2), max_tokens=200)
    eng.run(limit=3000)
    assert a.num_preemptions == 1
    resumed = [(t, local, n) for t, local, n in answers if t > 40]
    tokens, local, n = resumed[-1]  # the answer vLLM allocated for
    assert local == 0, "vLLM's own cache still held it: nothing to restore"
    assert n == (tokens - 1) // C * C > 4 * C
    assert side.stats.hit_tokens == n
    eng.check_entries()
    eng.check_settled()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_request_resumed_with_its_stores_in_flight_waits_for_them(model_dir, async_scheduling):
    """The same preemption with copies in flight, as on a GPU (held until the test lands
    them), under Model Runner V2: vLLM hands the preempted request's blocks on before
    their stores land, and V2 drops such stores (`WorkerSide.guard`). A lookup then would
    plan a hit on entries already dropped but not yet reported lost: a failed load, and
    the request recomputed from its first token (it was, before the lookup waited). It
    waits until its stores have landed, when the index knows what was lost: no load
    fails."""
    eng = Engine(model_dir, async_scheduling, seed=3, num_blocks=40, runner="v2")
    slow = SlowCopies(eng.worker.copies, lambda: eng.steps)
    answers = answers_to(eng.side, "a", resumed=True)
    eng.add("hog", _prompt(60, 1), max_tokens=200)
    a = eng.add("a", _prompt(40, 2), max_tokens=200)
    eng.run(until=lambda: any(local == 0 for _, local, _ in answers), limit=3000)
    for _ in range(3):
        eng.step()
    assert slow.in_flight() > 0 and eng.worker.stats.overtaken_entries > 0
    # While vLLM's own cache still held it all there was nothing to add (answered 0).
    assert all(n is None for t, local, n in answers if local < (t - 1) // C * C), answers
    slow.land()
    eng.copies_land = lambda step: slow.land()
    eng.run(limit=3000)
    assert a.is_finished() and a.num_preemptions == 1
    assert eng.worker.stats.failed_loads == 0
    eng.check_entries()
    eng.check_settled(lossy=True)


def test_a_junction_is_counted_once_however_often_vllm_asks(model_dir):
    """A lookup that asks vLLM to checkpoint the state at a prompt's branch point counts
    a junction. vLLM asks again every step it cannot allocate the request's blocks (and
    resets the checkpoint before each ask): the count went up each time (80 for one
    request here), as the lookup counters would without `answer`."""
    from vllm.v1.request import RequestStatus

    eng = Engine(model_dir, False, seed=5, num_blocks=25)  # the hog leaves too few
    first = _prompt(4 * C + 40, 41)  # its prompt checkpoint is at 4 chunks
    eng.add("a", first, max_tokens=2)
    eng.run()
    assert eng.sched.reset_prefix_cache()
    side = eng.side
    before = side.stats.junctions
    eng.add("hog", _prompt(200, 7), max_tokens=80)
    for _ in range(3):
        eng.step()
    sibling = eng.add("sib", first[: 2 * C + 30] + _prompt(2 * C, 42), max_tokens=2)
    for _ in range(10):
        eng.step()
        assert sibling.status == RequestStatus.WAITING, "allocated: nothing asked twice"
    eng.run()
    assert sibling.is_finished() and eng.first_start["sib"] == 0
    assert side.stats.junctions == before + 1
