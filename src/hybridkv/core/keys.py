"""Chunk keys: a hash chain over token ids, seeded by the layout and the request's salt.

Key i names "the first (i + 1) * chunk_tokens tokens of this prompt, under this layout and
salt". The chain makes every key fingerprint its whole prefix, and blake3 over the
little-endian uint32 token bytes makes keys identical in every process and after a
restart (no dependence on PYTHONHASHSEED or on vLLM's hash seed).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import blake3

KEY_BYTES = 16
_DOMAIN = b"hybridkv/chunk/v1"


def chain_seed(layout_fingerprint: bytes, cache_salt: str | None) -> bytes:
    h = blake3.blake3(_DOMAIN)
    h.update(layout_fingerprint)
    salt = (cache_salt or "").encode()
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    return h.digest(KEY_BYTES)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def extend_chain(
    chain: list[bytes], seed: bytes, tokens: Sequence[int], chunk_tokens: int
) -> list[bytes]:
    """Append keys for every full chunk of `tokens` not yet in `chain` (in place)."""
    n_full = len(tokens) // chunk_tokens
    if len(chain) >= n_full:
        return chain
    start = len(chain)
    data = _token_bytes(tokens[start * chunk_tokens : n_full * chunk_tokens])
    step = chunk_tokens * 4
    prev = chain[-1] if chain else seed
    for i in range(n_full - start):
        h = blake3.blake3(prev)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest(KEY_BYTES)
        chain.append(prev)
    return chain


def chunk_keys(seed: bytes, tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    """Keys of every full chunk of `tokens`."""
    return extend_chain([], seed, tokens, chunk_tokens)


def group_key(chunk_key: bytes, group_id: int) -> bytes:
    """Key of one group's data for one chunk: groups are stored and evicted separately."""
    return chunk_key + group_id.to_bytes(2, "big")


def split_group_key(key: bytes) -> tuple[bytes, int]:
    """(chunk key, group id) of a key made by `group_key`."""
    if len(key) != KEY_BYTES + 2:
        raise ValueError(f"a group key has {KEY_BYTES + 2} bytes, got {len(key)}")
    return key[:KEY_BYTES], int.from_bytes(key[KEY_BYTES:], "big")
