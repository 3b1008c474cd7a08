"""Which recurrent-state checkpoints to keep.

A recurrent state is large (a GDN layer's state can outweigh hundreds of tokens of
attention KV) and serves hits at exactly one boundary, so keeping every boundary is
wasteful. Following Marconi, the default keeps the states most likely to be reused:

* the prompt's last chunk boundary (a resend of the same prompt, or of a longer one); and
* the last boundary reached when the request ends (the next turn of a conversation, whose
  prompt extends this one's prompt and output); and
* the prompt's *branch point* (junction): the boundary where it stops sharing an earlier
  prompt's prefix. Siblings that fork there (another question on the same document,
  another branch of an agent's history, another chat on the same system prompt) resume
  at it, and no earlier request left a state there: it sat inside that request's chunk.
  The engine checkpoints it only when asked (vLLM: `Request.shared_prefix_boundary`,
  which ends a prefill chunk there); the connector asks when its index holds the shared
  prefix's attention chunks but no state at their end.

`every_chunk` keeps every boundary offered.

The policy only chooses among states the engine says it wrote (for vLLM: its per-step
boundary-state hand-off, with the exact block of each). No boundary is ever derived
here: a block vLLM did not report may hold no valid state, and storing it would store
garbage.
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

    def prompt_checkpoint(self, num_prompt_tokens: int) -> int:
        """The prompt's last chunk boundary that leaves at least one token to compute."""
        return max(num_prompt_tokens - 1, 0) // self.chunk_tokens * self.chunk_tokens

    def decide(
        self, boundary: int, num_prompt_tokens: int, junction: int = 0
    ) -> StateAction | None:
        """What to do with the state the engine wrote at `boundary`; `junction`: the
        prompt's branch point, if one is known (0: none). The engine keys its prefix by
        hash blocks, which may be finer than a state's block: its branch point may fall
        inside a chunk, and the state it then checkpoints is at the chunk boundary
        before it."""
        if self.name == "every_chunk":
            return StateAction.STORE
        ckpt = self.prompt_checkpoint(num_prompt_tokens)
        fork = junction // self.chunk_tokens * self.chunk_tokens
        if boundary == ckpt or (fork and boundary == fork and boundary < ckpt):
            return StateAction.STORE
        if boundary > ckpt:
            return StateAction.STAGE
        return None
