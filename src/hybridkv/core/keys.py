"""Chunk keys: a hash chain over token ids, seeded by the layout and the request's salt.

Key i names "the first (i + 1) * chunk_tokens tokens of this prompt, under this layout and
salt". The chain makes every key fingerprint its whole prefix, and blake3 over the
little-endian uint32 token bytes makes keys identical in every process and after a
restart (no dependence on PYTHONHASHSEED or on vLLM's hash seed).

Token ids do not always say what the model saw: a LoRA adapter changes every position,
an image's placeholder tokens are the same for every image, prompt embeddings come with
token ids of 0. Such inputs enter as opaque *extras*, encoded by the engine adapter: a
request-wide one in the seed, a per-chunk one mixed into the link before the chunk's
tokens. An empty extra changes nothing, so keys of plain requests (and the entries
stored under them) are the same as without extras.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import blake3

KEY_BYTES = 16
_DOMAIN = b"hybridkv/chunk/v1"
# blake3's key-derivation mode is a separate hash function from its default mode, so a
# link mixed with a chunk extra can only equal a plain chain key by a 128-bit collision.
_CHUNK_EXTRA_CONTEXT = "hybridkv chunk extra v1"

# (first chunk, end chunk, chunk tokens) -> one extra per chunk in [first, end); b"" = none.
ChunkExtras = Callable[[int, int, int], Sequence[bytes]]


def chain_seed(layout_fingerprint: bytes, cache_salt: str | None, extra: bytes = b"") -> bytes:
    """Root of a request's chain. `extra`: request-wide inputs beyond the tokens (e.g. a
    LoRA adapter), length-framed after the salt so no two (salt, extra) pairs share a seed."""
    h = blake3.blake3(_DOMAIN)
    h.update(layout_fingerprint)
    salt = (cache_salt or "").encode()
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    if extra:
        h.update(len(extra).to_bytes(8, "little"))
        h.update(extra)
    return h.digest(KEY_BYTES)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    # `fromlist` converts a list faster than `array("I", tokens)` (with the memoryview
    # below, a 24k-token prompt's keys in 0.30 ms against 0.34-0.37: bench/lookup.py).
    arr = array("I")
    arr.fromlist(tokens if isinstance(tokens, list) else list(tokens))
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _mix(link: bytes, extra: bytes) -> bytes:
    """The link to hash a chunk's tokens after, for a chunk with a non-empty extra. `link`
    has a fixed length, so (link, extra) pairs never share an input."""
    return blake3.blake3(link + extra, derive_key_context=_CHUNK_EXTRA_CONTEXT).digest(KEY_BYTES)


def extend_chain(
    chain: list[bytes],
    seed: bytes,
    tokens: Sequence[int],
    chunk_tokens: int,
    chunk_extras: ChunkExtras | None = None,
    limit: int | None = None,
) -> list[bytes]:
    """Append keys for every full chunk of `tokens` (of its first `limit` tokens: a
    request's token list is not copied to key its prompt) not yet in `chain` (in place).

    With `chunk_extras`, a chunk with a non-empty extra is keyed blake3(_mix(key i-1,
    extra) || tokens); every other chunk exactly as without extras.
    """
    n_full = (len(tokens) if limit is None else min(limit, len(tokens))) // chunk_tokens
    if len(chain) >= n_full:
        return chain
    start = len(chain)
    data = _token_bytes(tokens[start * chunk_tokens : n_full * chunk_tokens])
    step = chunk_tokens * 4
    extras: Sequence[bytes] = ()
    if chunk_extras is not None:
        extras = chunk_extras(start, n_full, chunk_tokens)
        if len(extras) != n_full - start:
            raise ValueError(f"{len(extras)} chunk extras for {n_full - start} chunks")
    prev = chain[-1] if chain else seed
    view = memoryview(data)  # a chunk's slice of it copies nothing
    for i in range(n_full - start):
        h = blake3.blake3(_mix(prev, extras[i]) if extras and extras[i] else prev)
        h.update(view[i * step : (i + 1) * step])
        prev = h.digest(KEY_BYTES)
        chain.append(prev)
    return chain


def chunk_keys(
    seed: bytes,
    tokens: Sequence[int],
    chunk_tokens: int,
    chunk_extras: ChunkExtras | None = None,
) -> list[bytes]:
    """Keys of every full chunk of `tokens`."""
    return extend_chain([], seed, tokens, chunk_tokens, chunk_extras)


# What a remembered fingerprint costs beyond its chain's keys: its place in the map, the
# fingerprint (vLLM's: a 32-byte bytes object) and a share of its value's header (the
# seed is counted in the value's length).
FINGERPRINT_COST = 200


class ChainMemo:
    """Chains keyed lately, found again by the engine's own fingerprint of a prefix.

    Why: most prompts extend one seen lately (a conversation's next turn, an agent's
    next call, another question on a document), and keying a prompt from its first token
    costs vLLM's scheduler thread about 0.3 ms per 24k tokens (a blake3 call per chunk and
    the tokens' conversion to bytes). vLLM fingerprints every full block of every request
    anyway (its block hashes, computed on the engine core's input thread before the
    scheduler sees the request). A chain remembered under the fingerprint of a chunk
    boundary gives the keys of the prefix up to it without hashing that prefix again;
    only the tail is hashed.

    Sound only where a fingerprint determines the chain's keys up to it: equal
    fingerprints must mean equal tokens (a collision-resistant hash: the caller's choice,
    vLLM's sha256), the seed is checked here, and the caller uses the memo only for
    requests without chunk extras. A wrong recall would serve another prompt's KV, so
    anything less certain is a miss, and a miss costs what keying cost before.

    Remembered: a chain's last chunk and every `stride`-th one (a prompt that forks from
    the middle of an earlier one rehashes at most `stride` - 1 chunks). The other
    fingerprints remembered within the prefix a chain was recalled from (the ends of
    earlier turns, naming shorter chains that only they keep alive) are dropped: a
    conversation's next turn frees its last turn's chain and fingerprint, so the memo
    holds a chain per conversation, not a growing one per turn, and a prompt that goes
    back to an earlier turn's end rehashes at most `stride` - 1 chunks, as a fork does.
    A value is the seed and the chain's keys joined into one bytes object, shared by that
    chain's fingerprints: nothing the garbage collector walks, 16 bytes a key (a tuple of
    the two was tracked until a collection examined it, and at a million entries the
    first full collection after a fill walked 17,500 of them: docs/benchmarks.md). What it
    holds is counted (`nbytes`: each joined chain once, FINGERPRINT_COST per fingerprint)
    and kept under `max_bytes`, least recently recalled or remembered out first, whatever
    the prompts' lengths.
    """

    # 24 MiB: in bench/lookup.py's stream at 100,000 entries with the bound scaled down
    # tenfold, it recalls 0.67 of the chunks keyed (0.71 unbounded, which held 41 bytes an
    # entry) for 25.5 bytes an entry by its own count: docs/benchmarks.md.
    def __init__(self, max_bytes: int = 24 << 20, stride: int = 16):
        self.max_bytes = max_bytes
        self.stride = stride
        self.nbytes = 0
        self._chains: OrderedDict[bytes, bytes] = OrderedDict()  # fingerprint -> seed + keys
        self._refs: dict[int, int] = {}  # id of a joined chain -> fingerprints holding it

    def __len__(self) -> int:
        return len(self._chains)

    def recall(self, seed: bytes, fingerprints: Sequence[bytes]) -> list[bytes]:
        """Keys of chunks [0, c] for the largest c whose `fingerprints[c]` (that of the
        prefix ending with chunk c) was remembered under `seed` (`chain_seed`'s, KEY_BYTES
        long); [] if none was."""
        if len(seed) != KEY_BYTES:
            return []
        chains = self._chains
        for c in range(len(fingerprints) - 1, -1, -1):
            fp = fingerprints[c]
            joined = chains.get(fp)
            if joined is not None and joined.startswith(seed):
                chains.move_to_end(fp)
                end = (c + 2) * KEY_BYTES
                return [joined[i : i + KEY_BYTES] for i in range(KEY_BYTES, end, KEY_BYTES)]
        return []

    def remember(
        self,
        seed: bytes,
        fingerprints: Sequence[bytes],
        chain: Sequence[bytes],
        recalled: int = 0,
    ) -> None:
        """`chain[c]` is the key of chunk c under `seed`, `fingerprints[c]` the engine's
        fingerprint of the prefix ending with it; `recalled`: how many of its keys `recall`
        gave (within those, what is not a stride point is dropped: the class docstring)."""
        n = min(len(fingerprints), len(chain))
        if not n or len(seed) != KEY_BYTES:
            return
        chains, value, stride = self._chains, b"".join((seed, *chain[:n])), self.stride
        for c in range(min(recalled, n - 1)):
            if (c + 1) % stride and (old := chains.pop(fingerprints[c], None)) is not None:
                self._drop(old)
        for c in (*range(stride - 1, n - 1, stride), n - 1):
            fp = fingerprints[c]
            old = chains.get(fp)
            if old is None:
                self.nbytes += FINGERPRINT_COST
            else:
                self._release(old)
            chains[fp] = value
            chains.move_to_end(fp)
            self._hold(value)
        while self.nbytes > self.max_bytes:
            self._drop(chains.popitem(last=False)[1])

    def _drop(self, value: bytes) -> None:
        """A fingerprint left the map; `value` was its chain."""
        self.nbytes -= FINGERPRINT_COST
        self._release(value)

    def _hold(self, joined: bytes) -> None:
        n = self._refs.get(id(joined), 0)  # (held by the map while counted here)
        if not n:
            self.nbytes += len(joined)
        self._refs[id(joined)] = n + 1

    def _release(self, joined: bytes) -> None:
        n = self._refs[id(joined)] - 1
        if n:
            self._refs[id(joined)] = n
        else:
            del self._refs[id(joined)]
            self.nbytes -= len(joined)


_GROUP_SUFFIX = tuple(g.to_bytes(2, "big") for g in range(256))


def group_key(chunk_key: bytes, group_id: int) -> bytes:
    """Key of one group's data for one chunk: groups are stored and evicted separately."""
    if 0 <= group_id < 256:  # the suffixes of the groups any layout has, made once
        return chunk_key + _GROUP_SUFFIX[group_id]
    return chunk_key + group_id.to_bytes(2, "big")


def group_keys(chunk_keys: Iterable[bytes], groups: int) -> list[bytes]:
    """`group_key` of every chunk for groups 0 to `groups` - 1, chunk by chunk: what a
    lookup asks about, hundreds at a time, so without a call per key."""
    suffixes = [group_key(b"", g) for g in range(groups)]
    return [key + suffix for key in chunk_keys for suffix in suffixes]


def split_group_key(key: bytes) -> tuple[bytes, int]:
    """(chunk key, group id) of a key made by `group_key`."""
    if len(key) != KEY_BYTES + 2:
        raise ValueError(f"a group key has {KEY_BYTES + 2} bytes, got {len(key)}")
    return key[:KEY_BYTES], int.from_bytes(key[KEY_BYTES:], "big")
