"""What a vLLM request's KV depends on beyond its token ids, as key extras.

vLLM's own prefix cache adds *extra keys* to its block hashes
(`generate_block_hash_extra_keys` in vllm/v1/core/kv_cache_utils.py); hybridkv's chunk
keys must cover the same inputs or a stored prefix would be served to a request that
computes different KV:

- LoRA: the adapter's name and path (as vLLM) in the seed, plus a fingerprint of the
  adapter's files, since stored entries outlive the engine and an adapter can be
  rewritten in place.
- Multimodal inputs: every chunk overlapping a placeholder range gets the item's
  `identifier` (vLLM's key: the content hash, LoRA-prefixed where it applies), its offset
  relative to the chunk start and its length. Placeholder token ids are the same for
  every image.
- Prompt embeddings: every chunk with prompt rows gets a digest of those rows (dtype and
  shape included) and of its rows of the token/embedding mask of mixed prompts; token ids
  there are 0.
- cache_salt stays the seed's salt argument.

`key_context` returns None for a request it cannot key safely; the connector then reports
no hit and stores nothing for it:

- a multimodal item without an identifier (vLLM cannot key it either);
- a resumable (streaming-input) session: vLLM rewrites its tokens after
  `num_computed_tokens` in place when the next input arrives, so keys cached for the
  request would name tokens it no longer has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
from vllm.v1.utils import tensor_data

from hybridkv.core.keys import chain_seed
from hybridkv.vllm.checkpoint import checkpoint_fingerprint

if TYPE_CHECKING:
    from vllm.v1.request import Request


def _encode(records: list[list[Any]]) -> bytes:
    """One extra from tagged records; b"" (no extra) when there are none."""
    return json.dumps(records, separators=(",", ":")).encode() if records else b""


@dataclass(frozen=True)
class KeyContext:
    """A request's chain seed and its per-chunk extras (`hybridkv.core.keys.ChunkExtras`)."""

    seed: bytes
    request: Request

    def chunk_extras(self, first: int, end: int, chunk_tokens: int) -> list[bytes]:
        """Extras of chunks [first, end); read from the request each call."""
        records: list[list[list[Any]]] = [[] for _ in range(end - first)]
        for f in self.request.mm_features:
            offset, length = f.mm_position.offset, f.mm_position.length
            for c in range(max(first, offset // chunk_tokens), end):
                start = c * chunk_tokens
                if start >= offset + length:
                    break
                records[c - first].append(["mm", f.identifier, offset - start, length])
        embeds = self.request.prompt_embeds
        if embeds is not None:
            mask = self.request.prompt_is_token_ids
            for c in range(first, min(end, -(-len(embeds) // chunk_tokens))):
                rows = slice(c * chunk_tokens, (c + 1) * chunk_tokens)
                block = embeds[rows]
                h = blake3.blake3(_encode([[str(block.dtype), list(block.shape)]]))
                h.update(tensor_data(block))
                if mask is not None:
                    h.update(bytes(mask[rows]))
                records[c - first].append(["embeds", h.hexdigest()])
        return [_encode(r) for r in records]


def key_context(request: Request, layout_fingerprint: bytes) -> KeyContext | None:
    """How to key `request`'s chunks, or None: it must not hit and must not be stored."""
    if request.resumable or any(not f.identifier for f in request.mm_features):
        return None
    lora = request.lora_request
    seed_extra = _encode(
        [["lora", lora.lora_name, lora.lora_path, checkpoint_fingerprint(lora.lora_path)]]
        if lora
        else []
    )
    return KeyContext(chain_seed(layout_fingerprint, request.cache_salt, seed_extra), request)
