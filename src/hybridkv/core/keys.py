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
from collections.abc import Callable, Iterable, Sequence

import blake3

from hybridkv._columns import Column
from hybridkv.core.keytable import RowBytes
from hybridkv.core.linked_keys import END, LinkedKeys
from hybridkv.core.rows import Rows

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


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes: what a chunk's key hashes, and how the KV
    cache events keep a stored entry's tokens (4 bytes a token, not an int object)."""
    # `fromlist` converts a list faster than `array("I", tokens)` (with the memoryview
    # below, a 24k-token prompt's keys in 0.30 ms against 0.34-0.37: bench/lookup.py).
    arr = array("I")
    arr.fromlist(tokens if isinstance(tokens, list) else list(tokens))
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def tokens_from_bytes(data: bytes) -> list[int]:
    """`token_bytes`' token ids again."""
    arr = array("I")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


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
    data = token_bytes(tokens[start * chunk_tokens : n_full * chunk_tokens])
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


# What a remembered fingerprint costs beyond its chain's keys: its slot in the order's
# table and columns (about 130 bytes with the table's slack) and a share of its chain's
# row, rounded up.
FINGERPRINT_COST = 200
# A fingerprint is found by its first TAG_BYTES (vLLM's block hashes are sha256 digests,
# so those bytes are as good as any hash of them) and checked whole against the rest,
# which a column keeps: one of at most TAIL_BYTES.
TAG_BYTES = 16
TAIL_BYTES = 23


class _Fingerprints(LinkedKeys):
    """The memo's fingerprints, least recently recalled or remembered first: each one's
    slot found by its tag (its first TAG_BYTES), with the rest of it and its chain's row
    in columns."""

    def __init__(self) -> None:
        self.tails = Column("k")  # slot -> the fingerprint past its tag
        self.chains = Column("q")  # slot -> its chain's row
        super().__init__()

    def _new_slot(self) -> None:
        super()._new_slot()
        self.tails.append(b"")
        self.chains.append(-1)

    def tagged(self, fingerprint: bytes) -> int | None:
        """The slot of the fingerprint with its tag, if one is remembered."""
        return self._slots.get(fingerprint[:TAG_BYTES])

    def holds(self, slot: int, fingerprint: bytes) -> bool:
        return self.tails[slot] == fingerprint[TAG_BYTES:]

    def find(self, fingerprint: bytes) -> int | None:
        """The slot of exactly this fingerprint, if remembered."""
        slot = self.tagged(fingerprint)
        return slot if slot is not None and self.holds(slot, fingerprint) else None

    def tagged_all(self, fingerprints: Sequence[bytes]) -> list[int | None]:
        """`tagged` of each, in one call on the table."""
        return self._slots.get_many([fp[:TAG_BYTES] for fp in fingerprints], None)

    def use(self, slot: int) -> None:
        self._to_end(slot)

    def add(self, fingerprint: bytes, chain: int) -> int:
        """A slot for a fingerprint whose tag no other holds, linked in as the newest."""
        slot = self._link_new(fingerprint[:TAG_BYTES])
        self.tails[slot] = fingerprint[TAG_BYTES:]
        self.chains[slot] = chain
        return slot

    def remove(self, slot: int) -> None:
        del self._slots[self._keys[slot]]
        self._remove(slot)

    def oldest(self) -> int:
        return self._next[END]

    def clear(self) -> None:
        self.tails.clear()
        self.chains.clear()
        super().clear()


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
    anything less certain is a miss, and a miss costs what keying cost before: a
    fingerprint is matched whole, not by its tag alone (two sharing a tag replace each
    other), and one too long to keep (over TAG_BYTES + TAIL_BYTES) is never remembered.

    Remembered: a chain's last chunk and every `stride`-th one (a prompt that forks from
    the middle of an earlier one rehashes at most `stride` - 1 chunks). The other
    fingerprints remembered within the prefix a chain was recalled from (the ends of
    earlier turns, naming shorter chains that only they keep alive) are dropped: a
    conversation's next turn frees its last turn's chain and fingerprint, so the memo
    holds a chain per conversation, not a growing one per turn, and a prompt that goes
    back to an earlier turn's end rehashes at most `stride` - 1 chunks, as a fork does.
    What it holds is counted (`nbytes`: each chain once, FINGERPRINT_COST per
    fingerprint) and kept under `max_bytes`, least recently recalled or remembered out
    first, whatever the prompts' lengths.

    No dict that grows and shrinks with what it holds: fingerprints are slots of a
    `LinkedKeys` order (a native table and columns), chains rows of `RowBytes` (the seed
    and the chain's keys joined into one bytes object, which the garbage collector never
    walks) with a count of the fingerprints naming each in a column. An `OrderedDict` of
    fingerprints rebuilt its whole table every so often as they came and went: 4.0 ms and
    8.0 ms in one call each while bench/lookup.py's stream filled to a million entries
    (docs/benchmarks.md), on the scheduler's thread.
    """

    # 24 MiB: in bench/lookup.py's stream at 100,000 entries with the bound scaled down
    # tenfold, it recalls 0.67 of the chunks keyed (0.71 unbounded, which held 41 bytes an
    # entry) for 25.5 bytes an entry by its own count: docs/benchmarks.md.
    def __init__(self, max_bytes: int = 24 << 20, stride: int = 16):
        self.max_bytes = max_bytes
        self.stride = stride
        self.nbytes = 0
        self._order = _Fingerprints()
        self._chains = RowBytes()  # row -> seed + keys
        self._rows = Rows({"refs": "q"})  # row -> fingerprints naming it
        self._refs = self._rows.refs

    def __len__(self) -> int:
        return len(self._order)

    def chains(self) -> list[bytes]:
        """The chains held (each once), as seed + keys."""
        return [self._chains[row] for row in self._chains.rows()]

    def recall(self, seed: bytes, fingerprints: Sequence[bytes]) -> list[bytes]:
        """Keys of chunks [0, c] for the largest c whose `fingerprints[c]` (that of the
        prefix ending with chunk c) was remembered under `seed` (`chain_seed`'s, KEY_BYTES
        long); [] if none was."""
        if len(seed) != KEY_BYTES:
            return []
        order = self._order
        rows, slots = order.chains, order.tagged_all(fingerprints)
        for c in range(len(slots) - 1, -1, -1):
            slot = slots[c]
            if slot is None or not order.holds(slot, fingerprints[c]):
                continue
            joined = self._chains[rows[slot]]
            if joined.startswith(seed):
                order.use(slot)
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
        order, stride = self._order, self.stride
        for c in range(min(recalled, n - 1)):
            if (c + 1) % stride and (slot := order.find(fingerprints[c])) is not None:
                self._drop(slot)
        row = self._new_chain(b"".join((seed, *chain[:n])))
        self._hold(row)  # while its fingerprints are placed: replacing one never frees it
        for c in (*range(stride - 1, n - 1, stride), n - 1):
            fp = fingerprints[c]
            if len(fp) > TAG_BYTES + TAIL_BYTES:
                continue
            slot = order.tagged(fp)
            if slot is not None and order.holds(slot, fp):
                self._release(order.chains[slot])
                order.chains[slot] = row
                order.use(slot)
            else:
                if slot is not None:  # another fingerprint with its tag: replaced
                    self._drop(slot)
                order.add(fp, row)
                self.nbytes += FINGERPRINT_COST
            self._hold(row)
        self._release(row)  # freed if no fingerprint of it could be kept
        while self.nbytes > self.max_bytes:
            self._drop(order.oldest())

    def _new_chain(self, joined: bytes) -> int:
        """A row for a chain nothing holds yet (counted once something does)."""
        row = self._rows.add_row(0)
        self._chains[row] = joined
        return row

    def _free_chain(self, row: int) -> None:
        del self._chains[row]
        self._rows.free_row(row)

    def _drop(self, slot: int) -> None:
        """A fingerprint leaves the memo."""
        self.nbytes -= FINGERPRINT_COST
        self._release(self._order.chains[slot])
        self._order.remove(slot)

    def _hold(self, row: int) -> None:
        if not self._refs[row]:
            self.nbytes += len(self._chains[row])
        self._refs[row] += 1

    def _release(self, row: int) -> None:
        self._refs[row] -= 1
        if not self._refs[row]:
            self.nbytes -= len(self._chains[row])
            self._free_chain(row)


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
