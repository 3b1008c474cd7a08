"""The finished requests whose blocks vLLM keeps for this rank's stores (worker side).

vLLM's contract for a connector still reading a finished request's blocks is a delayed
free: `request_finished(_all_groups)` returns True, vLLM keeps the blocks, and frees them
once every rank has reported the request in `finished_sending`
(`KVOutputAggregator.aggregate` counts one report per rank, then
`Scheduler._update_from_kv_xfer_finished` frees the blocks, asserting the request is
still held). So each rank reports exactly the requests the scheduler side delayed, each
once: the scheduler side names them in the metadata of the next step it schedules
(`HybridKVMetadata.delayed`). By then the rank has queued every store that reads their
blocks (a store is gathered in the step whose metadata plans it, steps run in schedule
order, and no store is planned for a finished request), so a delayed request is reported
once the newest of its stores has landed, at once if none is left in flight. On a CPU
cache every store lands before `wait_for_save` returns: the request is reported in the
step that names it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from hybridkv.core.copy_engine import LANDED, Landing

log = logging.getLogger(__name__)


class DelayedFree:
    def __init__(self) -> None:
        self._newest: dict[str, Landing] = {}  # a request's newest store
        self._held: dict[str, Landing] = {}  # delayed requests not reported yet

    def stored(self, req_ids: Iterable[str], landing: Landing) -> None:
        """A store reading these requests' blocks lands with `landing`."""
        for req_id in req_ids:
            self._newest[req_id] = landing

    def delayed(self, req_ids: Iterable[str]) -> None:
        """vLLM keeps these finished requests' blocks until they are reported."""
        for req_id in req_ids:
            self._held[req_id] = self._newest.pop(req_id, LANDED)

    def finished(self, req_ids: Iterable[str]) -> set[str]:
        """Forget requests that ended (vLLM's `finished_req_ids`; the delayed ones among
        them were handed over by `delayed` first); the delayed requests to report now."""
        for req_id in req_ids:
            self._newest.pop(req_id, None)
        landed = {req_id for req_id, landing in self._held.items() if _landed(landing)}
        for req_id in landed:
            del self._held[req_id]
        return landed

    @property
    def held(self) -> int:
        """Delayed requests not reported yet."""
        return len(self._held)


def _landed(landing: Landing) -> bool:
    """A copy that cannot say (a device error) reads no block any more: its stores are
    dropped (`WorkerSide._land`), and the blocks must not be held forever."""
    try:
        return landing.done()
    except Exception:
        log.exception("hybridkv: a store's copy failed; its request's blocks are released")
        return True
