"""hybridkv's worker side inside vLLM's per-step order, on a GPU (tests/step_replay.py):
every byte stored and restored is checked while blocks are freed and handed on as fast
as vLLM may, in the order of Model Runner V1 and of V2, with and without loads running
beside the stores.

- Blocks of finished requests are handed out again first: the delayed free alone keeps
  them intact, so the compute stream is never held and no store is dropped. Without it
  the same run holds the compute stream (V1) or drops stores (V2); without it and without
  the list of blocks each step hands over, stores capture the new owners' bytes. Both
  must fail the checks.
- Preemptions and retired recurrent states hand blocks on while stores still read them:
  V1 holds the compute stream behind those stores, V2 drops them; what is stored is
  right either way.

On a CPU the copies are held in flight by tests/slow_copies.py; on a GPU they run on
hybridkv's side streams, the store stream held back. On a lent GPU run this file, and
once under compute-sanitizer:
`compute-sanitizer --tool racecheck python -m pytest -q tests/test_step_replay.py -k cuda`.
"""

from __future__ import annotations

import pytest
import torch
from step_replay import Replay

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cuda", marks=CUDA), "cpu"]
RUNNERS = ["v1", "v2"]
LOADS = [pytest.param(False, id="stores"), pytest.param(True, id="stores+loads")]


def replayed(replay: Replay) -> Replay:
    """Eleven requests of 5 to 8 chunks arriving over the first steps; the last four
    repeat earlier prompts (restored by hybridkv when the replay has loads)."""
    for i in range(11):
        prompt = i if i < 7 else i - 7
        replay.add(f"r{i}", prompt, chunks=5 + i % 4, arrives=i if i < 7 else 2 * i)
    replay.run()
    return replay


def check_kept_by_the_delayed_free(replay: Replay) -> None:
    replay.check(dropped=False)
    assert replay.worker.stats.held_compute == 0, "the compute stream waited for a store"


@pytest.mark.parametrize("loads", LOADS)
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("device", DEVICES)
def test_finished_requests_blocks_go_to_others_only_once_their_stores_landed(device, runner, loads):
    replay = replayed(Replay(device, runner, loads=loads))
    check_kept_by_the_delayed_free(replay)
    assert replay.restored_blocks > 0 if loads else replay.restored_blocks == 0


@pytest.mark.parametrize("list_handed_over", [True, False], ids=["guarded", "unguarded"])
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("device", DEVICES)
def test_the_replay_fails_without_the_delayed_free(device, runner, list_handed_over):
    with pytest.raises(AssertionError):
        replay = Replay(device, runner, delayed_free=False, list_handed_over=list_handed_over)
        check_kept_by_the_delayed_free(replayed(replay))


@pytest.mark.parametrize("loads", LOADS)
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("device", DEVICES)
def test_blocks_handed_on_in_flight_hold_the_compute_stream_or_drop_the_store(
    device, runner, loads
):
    replay = replayed(Replay(device, runner, loads=loads, preempt=True))
    replay.check(dropped=runner == "v2")
    stats = replay.worker.stats
    assert stats.held_compute > 0 if runner == "v1" else stats.overtaken_entries > 0
