"""Which recurrent-state checkpoints to keep.

A recurrent state is large (a GDN layer's state can outweigh hundreds of tokens of
attention KV) and serves hits at exactly one boundary, so keeping every boundary is
wasteful. Following Marconi, the default keeps the states most likely to be reused:

* the prompt's last chunk boundary (a resend of the same prompt, or of a longer one); and
* the last boundary reached when the request ends (the next turn of a conversation, whose
  prompt extends this one's prompt and output).

`every_chunk` keeps every boundary the engine materializes (for prefix trees).

Only boundaries where the engine really wrote the state may be stored: the end of a step
that stops on a boundary, and the prompt checkpoint the engine takes inside the last
prefill step. Any other boundary's state was never materialized and storing its block
would store garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StateAction(Enum):
    STORE = "store"  # write to the tiers now
    # Store, replacing the state this request staged before: the newest survives it.
    STAGE = "stage"


@dataclass(frozen=True)
class CheckpointPolicy:
    name: str
    chunk_tokens: int
    # The engine's recurrent block size: where it can materialize states.
    state_block_tokens: int

    def prompt_checkpoint(self, num_prompt_tokens: int) -> int:
        """The prompt's last chunk boundary that leaves at least one token to compute."""
        return max(num_prompt_tokens - 1, 0) // self.chunk_tokens * self.chunk_tokens

    def materialized(self, start: int, end: int, num_prompt_tokens: int) -> list[int]:
        """Chunk boundaries in (start, end] whose state the engine wrote in this step."""
        sbs = self.state_block_tokens
        engine_ckpt = max(num_prompt_tokens - 1, 0) // sbs * sbs
        found = set()
        if start < engine_ckpt <= end:
            found.add(engine_ckpt)
        if end > start and end % sbs == 0:
            found.add(end)
        return sorted(b for b in found if b and b % self.chunk_tokens == 0)

    def decide(self, boundary: int, num_prompt_tokens: int) -> StateAction | None:
        if self.name == "every_chunk":
            return StateAction.STORE
        ckpt = self.prompt_checkpoint(num_prompt_tokens)
        if boundary == ckpt:
            return StateAction.STORE
        if boundary > ckpt:
            return StateAction.STAGE
        return None
