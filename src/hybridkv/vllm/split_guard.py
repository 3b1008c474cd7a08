"""Keep vLLM's prefill split on the recurrent blocks where states are cached.

In align mode vLLM's scheduler ends every prefill chunk on a multiple of
`cache_config.block_size` (`Scheduler._mamba_block_aligned_split`): the prompt's last
block boundary is where `MambaManager` caches a state and hands it off, so it is the only
state hybridkv can store for a prompt. The engine core sizes that block when it builds
the KV cache (`_initialize_kv_caches`: the smallest prefix-cacheable group block, 256
tokens for a small Qwen3-Next on CPU). But an engine core in its own process (every
server, and `LLM` unless `VLLM_ENABLE_V1_MULTIPROCESSING=0`) re-runs
`VllmConfig.__post_init__()` after its start-up handshake, and vLLM 0.32's CPU platform
(`CpuPlatform.check_and_update_config`) then resets a block size the user did not set to
its default, 128. The scheduler shares that `CacheConfig`, so its chunks end on odd
multiples of 128 whenever (L - 1) mod 256 >= 128: no state is cached at the prompt's
last 256-token boundary and nothing there can be restored, by vLLM's own prefix cache or
by any connector. In-process engines run no such handshake and keep 256.

The scheduler-role connector shares the scheduler's `VllmConfig`, and the split reads
`cache_config.block_size` at no other place once the engine runs, so the guard puts back
the value the engine core itself computed, before any prefill is split (at every lookup:
a new or resumed request is always looked up before its first chunk is scheduled).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


def engine_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The block size vLLM's engine core sets once its KV cache is sized: the smallest
    block of the groups that take part in prefix caching (of all groups if none does)."""
    groups = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    cacheable = [s.block_size for s in groups if getattr(s, "prefix_cacheable", True)]
    return min(cacheable or [s.block_size for s in groups])


class SplitGuard:
    """Restores `cache_config.block_size` whenever it has left the engine's block size;
    counts how often (`restores`) and says so once in the log."""

    def __init__(self, cache_config: CacheConfig, block_size: int) -> None:
        self.cache_config = cache_config
        self.block_size = block_size
        self.restores = 0

    def check(self) -> None:
        found = self.cache_config.block_size
        if found == self.block_size:
            return
        if self.restores == 0:
            log.warning(
                "hybridkv: the engine's cache_config.block_size is %s, but its KV cache "
                "was built with %d-token blocks (vLLM's CPU platform resets it when an "
                "engine core in its own process re-reads its config); restored to %d so "
                "that prefill chunks end where recurrent states are cached",
                found,
                self.block_size,
                self.block_size,
            )
        self.cache_config.block_size = self.block_size
        self.restores += 1
