"""Chunk keys: stable across processes, prefix-closed, salted and layout-separated."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import struct
import subprocess
import sys

import blake3
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridkv.core.keys import (
    FINGERPRINT_COST,
    KEY_BYTES,
    TAG_BYTES,
    TAIL_BYTES,
    ChainMemo,
    chain_seed,
    chunk_keys,
    extend_chain,
    group_key,
)
from hybridkv.core.layout import GroupKind, GroupSpec, Layout

TOKEN = st.integers(0, 2**32 - 1)  # token ids fill the whole uint32 range
CHUNK = st.sampled_from([1, 2, 3, 4, 8, 16])
SEED = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)


def _layout(model: str = "m", window: int = 64) -> Layout:
    return Layout(
        model=model,
        groups=(
            GroupSpec(GroupKind.FULL, 16, 4096, ("model.layers.0.attn", "model.layers.2.attn")),
            GroupSpec(GroupKind.SLIDING, 16, 2048, ("model.layers.1.attn",), window=window),
            GroupSpec(GroupKind.STATE, 64, 9000, ("model.layers.3.linear_attn",), dtype="bf16"),
        ),
        tp_size=2,
    )


_CHILD = r"""
import json, sys
from hybridkv.core.keys import chain_seed, chunk_keys
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
a = json.loads(sys.argv[1])
layout = Layout(
    model=a["model"],
    groups=(
        GroupSpec(GroupKind.FULL, 16, 4096, ("model.layers.0.attn", "model.layers.2.attn")),
        GroupSpec(GroupKind.SLIDING, 16, 2048, ("model.layers.1.attn",), window=a["window"]),
        GroupSpec(GroupKind.STATE, 64, 9000, ("model.layers.3.linear_attn",), dtype="bf16"),
    ),
    tp_size=2,
)
seed = chain_seed(layout.fingerprint, a["salt"])
keys = chunk_keys(seed, a["tokens"], a["chunk"])
print(json.dumps({"hash": hash("hybridkv"), "fp": layout.fingerprint.hex(),
                  "keys": [k.hex() for k in keys]}))
"""


def _child_keys(hashseed: str, args: dict) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_keys_identical_across_processes_with_different_hash_seeds():
    tokens = [(i * 2654435761) % (2**32) for i in range(200)]  # includes ids above 2**16
    args = {"model": "org/model", "window": 64, "salt": "tenant-a", "tokens": tokens, "chunk": 16}
    a = _child_keys("1", args)
    b = _child_keys("987654", args)
    # The two interpreters really hash differently, so equal keys are not luck.
    assert a["hash"] != b["hash"]

    layout = _layout("org/model", 64)
    here = chunk_keys(chain_seed(layout.fingerprint, "tenant-a"), tokens, 16)
    assert len(here) == 200 // 16
    assert a["fp"] == b["fp"] == layout.fingerprint.hex()
    assert a["keys"] == b["keys"] == [k.hex() for k in here]


@settings(max_examples=150, deadline=None)
@given(seed=SEED, tokens=st.lists(TOKEN, max_size=70), chunk=CHUNK, data=st.data())
def test_prefix_property_and_full_chunks_only(seed, tokens, chunk, data):
    keys = chunk_keys(seed, tokens, chunk)
    assert len(keys) == len(tokens) // chunk
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)
    n = data.draw(st.integers(0, len(tokens)), label="n")
    assert keys[: n // chunk] == chunk_keys(seed, tokens[:n], chunk)


@settings(max_examples=150, deadline=None)
@given(seed=SEED, tokens=st.lists(TOKEN, min_size=1, max_size=70), chunk=CHUNK, data=st.data())
def test_changing_a_token_changes_exactly_the_keys_from_its_chunk_on(seed, tokens, chunk, data):
    p = data.draw(st.integers(0, len(tokens) - 1), label="p")
    new = data.draw(TOKEN.filter(lambda t: t != tokens[p]), label="new")
    changed = list(tokens)
    changed[p] = new
    a = chunk_keys(seed, tokens, chunk)
    b = chunk_keys(seed, changed, chunk)
    assert len(a) == len(b)
    for i, (ka, kb) in enumerate(zip(a, b, strict=True)):
        assert (ka != kb) == (i >= p // chunk), i


@settings(max_examples=150, deadline=None)
@given(
    seed=SEED,
    tokens=st.lists(TOKEN, max_size=70),
    chunk=CHUNK,
    cuts=st.lists(st.integers(0, 70), max_size=6),
)
@example(seed=bytes(KEY_BYTES), tokens=list(range(10)), chunk=2, cuts=[3, 7, 5])
def test_extend_chain_incrementally_equals_all_at_once(seed, tokens, chunk, cuts):
    chain: list[bytes] = []
    limited: list[bytes] = []  # the same prefixes by `limit`, the tokens not sliced
    for cut in [*cuts, len(tokens)]:  # growing, shrinking and repeated prefixes
        prefix = tokens[:cut]
        before = list(chain)
        returned = extend_chain(chain, seed, prefix, chunk)
        assert returned is chain  # extended in place
        assert chain[: len(before)] == before  # never rewrites existing keys
        assert chain == chunk_keys(seed, tokens, chunk)[: max(len(before), cut // chunk)]
        assert extend_chain(limited, seed, tokens, chunk, limit=cut) == chain
    assert chain == chunk_keys(seed, tokens, chunk)


def test_token_bytes_are_little_endian_uint32():
    """The documented wire format, written out independently: key i = blake3(key i-1 ||
    chunk i's tokens as little-endian uint32), 16 bytes. A stored key must keep meaning
    the same tokens across versions and machines."""
    seed = bytes(range(KEY_BYTES))
    tokens = [0, 1, 0xFFFF, 0x10000, 0x12345678, 2**32 - 1, 7, 65536 * 3]
    prev, expect = seed, []
    for i in range(0, len(tokens), 4):
        prev = blake3.blake3(prev + struct.pack("<4I", *tokens[i : i + 4])).digest(KEY_BYTES)
        expect.append(prev)
    assert chunk_keys(seed, tokens, 4) == expect
    # Token ids beyond 16 bits are not truncated.
    assert chunk_keys(seed, [5], 1) != chunk_keys(seed, [5 + 2**16], 1)
    assert chunk_keys(seed, [5], 1) != chunk_keys(seed, [5 + 2**31], 1)


def test_no_salt_and_empty_salt_are_the_same_seed():
    fp = _layout().fingerprint
    assert chain_seed(fp, None) == chain_seed(fp, "")


@settings(max_examples=100, deadline=None)
@given(
    salts=st.lists(st.one_of(st.none(), st.text(max_size=12)), min_size=2, max_size=2),
    tokens=st.lists(TOKEN, min_size=4, max_size=40),
)
def test_different_salts_give_disjoint_keys(salts, tokens):
    a, b = ((s or "") for s in salts)  # None and "" are the same salt by design
    fp = _layout().fingerprint
    ka = chunk_keys(chain_seed(fp, salts[0]), tokens, 4)
    kb = chunk_keys(chain_seed(fp, salts[1]), tokens, 4)
    if a == b:
        assert ka == kb
    else:
        assert chain_seed(fp, salts[0]) != chain_seed(fp, salts[1])
        assert not set(ka) & set(kb)


def test_different_layouts_give_disjoint_keys():
    layouts = [
        _layout("m"),
        _layout("m2"),
        _layout("m", window=128),
        Layout("m", _layout().groups, tp_size=1),
        Layout("m", _layout().groups[:2], tp_size=2),
    ]
    fps = [lay.fingerprint for lay in layouts]
    assert len(set(fps)) == len(fps)
    tokens = list(range(1000, 1064))
    all_keys = [set(chunk_keys(chain_seed(fp, None), tokens, 8)) for fp in fps]
    for i in range(len(all_keys)):
        for j in range(i + 1, len(all_keys)):
            assert not all_keys[i] & all_keys[j], (i, j)
    # The same layout built twice (fresh objects) has the same fingerprint.
    assert _layout("m").fingerprint == fps[0]


@settings(max_examples=50, deadline=None)
@given(seed=SEED, tokens=st.lists(TOKEN, min_size=8, max_size=32))
def test_group_key_separates_groups_and_chunks(seed, tokens):
    keys = chunk_keys(seed, tokens, 4)
    gkeys = [group_key(k, g) for k in keys for g in (0, 1, 2, 255, 256, 65535)]
    assert len(set(gkeys)) == len(gkeys)


# ---- extras: inputs beyond the token ids (LoRA, multimodal items, prompt embeddings) ----
EXTRA = st.binary(min_size=1, max_size=24)


def _extras_at(extras: dict[int, bytes]):
    """chunk_extras giving `extras[chunk]` (b"" elsewhere), by absolute chunk index."""
    return lambda first, end, _chunk: [extras.get(c, b"") for c in range(first, end)]


def test_chain_seed_wire_format():
    """Written out independently: a seed without extra is the seed of before extras existed
    (stored entries keep their keys); an extra is length-framed after the salt."""
    fp, salt, extra = bytes(range(16)), b"tenant", b"lora-A"
    plain = blake3.blake3(b"hybridkv/chunk/v1" + fp + struct.pack("<I", 6) + salt)
    assert chain_seed(fp, "tenant") == chain_seed(fp, "tenant", b"") == plain.digest(KEY_BYTES)
    framed = plain.copy()
    framed.update(struct.pack("<Q", len(extra)) + extra)
    assert chain_seed(fp, "tenant", extra) == framed.digest(KEY_BYTES)


@settings(max_examples=100, deadline=None)
@given(seed=SEED, tokens=st.lists(TOKEN, max_size=40), chunk=CHUNK)
def test_empty_extras_change_no_key(seed, tokens, chunk):
    assert chunk_keys(seed, tokens, chunk, _extras_at({})) == chunk_keys(seed, tokens, chunk)


@settings(max_examples=150, deadline=None)
@given(seed=SEED, tokens=st.lists(TOKEN, min_size=16, max_size=40), chunk=CHUNK, data=st.data())
def test_a_chunk_extra_changes_exactly_the_keys_from_its_chunk_on(seed, tokens, chunk, data):
    n = len(tokens) // chunk
    p = data.draw(st.integers(0, n - 1), label="p")
    a_extra, b_extra = data.draw(st.lists(EXTRA, min_size=2, max_size=2, unique=True), "x")
    plain = chunk_keys(seed, tokens, chunk)
    a = chunk_keys(seed, tokens, chunk, _extras_at({p: a_extra}))
    b = chunk_keys(seed, tokens, chunk, _extras_at({p: b_extra}))
    assert a[:p] == b[:p] == plain[:p]
    assert len(set(a[p:]) | set(b[p:]) | set(plain[p:])) == 3 * (n - p)


def test_extras_do_not_alias_each_other_or_tokens():
    """The same bytes as a seed extra, as a chunk extra, or moved to another chunk, are
    different inputs; so is an extra whose bytes equal the next chunk's token bytes."""
    fp, tokens = bytes(16), list(range(8))
    x = struct.pack("<4I", *tokens[4:])
    variants = [
        chunk_keys(chain_seed(fp, None), tokens, 4),
        chunk_keys(chain_seed(fp, None, x), tokens, 4),
        chunk_keys(chain_seed(fp, None), tokens, 4, _extras_at({0: x})),
        chunk_keys(chain_seed(fp, None), tokens, 4, _extras_at({1: x})),
        chunk_keys(chain_seed(fp, None), tokens[:4], 4, _extras_at({0: x})),
        chunk_keys(chain_seed(fp, None), tokens, 8),
    ]
    last = [v[-1] for v in variants]
    assert len(set(last)) == len(last)


@settings(max_examples=100, deadline=None)
@given(
    seed=SEED,
    tokens=st.lists(TOKEN, max_size=60),
    chunk=CHUNK,
    extras=st.dictionaries(st.integers(0, 60), EXTRA, max_size=6),
    cuts=st.lists(st.integers(0, 60), max_size=5),
)
def test_extend_chain_with_extras_incrementally_equals_all_at_once(
    seed, tokens, chunk, extras, cuts
):
    fn = _extras_at(extras)
    chain: list[bytes] = []
    for cut in [*cuts, len(tokens)]:
        extend_chain(chain, seed, tokens[:cut], chunk, fn)
    assert chain == chunk_keys(seed, tokens, chunk, fn)


def test_chunk_extras_must_cover_every_new_chunk():
    with pytest.raises(ValueError, match="2 chunk extras for 3 chunks"):
        chunk_keys(bytes(KEY_BYTES), list(range(12)), 4, lambda f, e, c: [b""] * 2)


def _prefix_fingerprints(tokens: list[int], chunk: int) -> list[bytes]:
    """A fingerprint per chunk boundary that names the whole prefix, a sha256 digest as
    vLLM's block hashes are."""
    return [
        hashlib.sha256(struct.pack(f"<{(c + 1) * chunk}I", *tokens[: (c + 1) * chunk])).digest()
        for c in range(len(tokens) // chunk)
    ]


@settings(max_examples=60, deadline=None)
@given(
    seed=SEED,
    other_seed=SEED,
    chunk=CHUNK,
    stride=st.integers(1, 5),
    max_bytes=st.integers(0, 6000),
    turns=st.lists(
        st.tuples(st.integers(0, 8), st.lists(TOKEN, max_size=24), st.booleans()), max_size=12
    ),
)
def test_chain_memo_recalls_only_exact_prefixes(seed, other_seed, chunk, stride, max_bytes, turns):
    """Prompts that extend or fork from earlier ones, under two seeds: every recall is a
    prefix of the prompt's true chain under the seed asked (never another prompt's or
    seed's keys), what it holds is counted exactly and kept within its bound, and a
    prompt just remembered is recalled whole if it fits."""
    memo = ChainMemo(max_bytes=max_bytes, stride=stride)
    prompts: list[list[int]] = [[]]
    for parent, tail, salted in turns:
        base = prompts[parent % len(prompts)]
        tokens = base + tail
        s = other_seed if salted else seed
        want = chunk_keys(s, tokens, chunk)
        fps = _prefix_fingerprints(tokens, chunk)
        got = memo.recall(s, fps)
        assert got == want[: len(got)]
        chain = list(got)
        extend_chain(chain, s, tokens, chunk)
        assert chain == want
        memo.remember(s, fps, chain, len(got))
        # Counted exactly (each joined chain once), and within the bound.
        held = sum(map(len, memo.chains()))
        assert memo.nbytes == held + FINGERPRINT_COST * len(memo) <= max_bytes
        if want and FINGERPRINT_COST + KEY_BYTES * (len(want) + 1) <= max_bytes:
            assert memo.recall(s, fps + [b"unknown"]) == want  # remembered last: whole
        for x in (seed, other_seed):  # under either seed: that seed's keys, or none
            r = memo.recall(x, fps)
            assert r == chunk_keys(x, tokens, chunk)[: len(r)]
        prompts.append(tokens)


@pytest.mark.parametrize("stride", [1, 3, 16])
def test_chain_memo_holds_one_chain_per_conversation(stride):
    """Each turn of a conversation extends the last (recalled whole, its tail hashed): the
    last turn's end is dropped and its stride points name the new chain, so the memo
    holds the newest chain only, and its stride points and end, not a growing chain per
    turn (quadratic in the turns)."""
    seed, chunk = bytes(KEY_BYTES), 4
    rng = random.Random(stride)
    print(f"seed {stride}")
    memo = ChainMemo(stride=stride)
    tokens: list[int] = []
    for _ in range(12):
        tokens = tokens + [rng.randrange(1, 2000) for _ in range(rng.randint(1, 3 * chunk))]
        fps = _prefix_fingerprints(tokens, chunk)
        chain = memo.recall(seed, fps)
        recalled = len(chain)
        extend_chain(chain, seed, tokens, chunk)
        memo.remember(seed, fps, chain, recalled)
        held = [len(v) for v in memo.chains()]
        assert held == ([KEY_BYTES * (len(chain) + 1)] if chain else [])
        assert len(memo) == (len(chain) - 1) // stride + 1 if chain else not memo
        assert memo.recall(seed, fps) == chunk_keys(seed, tokens, chunk)


def test_chain_memo_fork_rehashes_less_than_a_stride():
    """A prompt forking from the middle of a remembered one recalls up to the last
    remembered boundary at or before the fork: at most stride - 1 chunks short."""
    seed, chunk, stride = bytes(KEY_BYTES), 4, 8
    memo = ChainMemo(stride=stride)
    first = list(range(1000, 1000 + 30 * chunk))  # 30 chunks
    memo.remember(seed, _prefix_fingerprints(first, chunk), chunk_keys(seed, first, chunk))
    for fork in range(0, 30):
        tokens = first[: fork * chunk] + [7] * (5 * chunk)
        got = memo.recall(seed, _prefix_fingerprints(tokens, chunk))
        assert got == chunk_keys(seed, tokens, chunk)[: len(got)]
        assert fork - len(got) < stride and len(got) % stride == 0 and len(got) <= fork
    assert memo.recall(bytes([1]) * KEY_BYTES, _prefix_fingerprints(first, chunk)) == []
    # A shorter seed the remembered one begins with is another seed too.
    assert memo.recall(seed[:8], _prefix_fingerprints(first, chunk)) == []
    # Values the garbage collector never walks (a tuple stays tracked until a collection
    # examines it): the class docstring.
    assert not any(gc.is_tracked(v) for v in memo.chains())


def test_chain_memo_matches_a_fingerprint_whole_not_by_its_tag():
    """Two fingerprints that share the tag the memo finds them by (their first
    TAG_BYTES) are told apart by the rest: the later replaces the earlier, which is then
    a miss, never the other's chain. One too long to keep is never remembered."""
    seed, chunk = bytes(KEY_BYTES), 4
    a, b = list(range(1, 9)), list(range(101, 109))
    memo = ChainMemo()
    fa = [bytes(TAG_BYTES) + b"a" * 16] * 2
    fb = [bytes(TAG_BYTES) + b"b" * 16] * 2
    memo.remember(seed, fa, chunk_keys(seed, a, chunk))
    assert memo.recall(seed, fa) == chunk_keys(seed, a, chunk)
    assert memo.recall(seed, fb) == []
    memo.remember(seed, fb, chunk_keys(seed, b, chunk))
    assert memo.recall(seed, fb) == chunk_keys(seed, b, chunk)
    assert memo.recall(seed, fa) == []
    assert len(memo) == 1 and memo.nbytes == FINGERPRINT_COST + KEY_BYTES * 3
    long = [b"x" * (TAG_BYTES + TAIL_BYTES + 1), b"y" * (TAG_BYTES + TAIL_BYTES + 1)]
    memo.remember(seed, long, chunk_keys(seed, a, chunk))
    assert memo.recall(seed, long) == [] and len(memo) == 1
    assert memo.nbytes == FINGERPRINT_COST + KEY_BYTES * 3


@pytest.mark.parametrize("same_tail", [True, False])
def test_chain_memo_remembers_a_chain_whose_fingerprints_repeat_or_share_a_tag(same_tail):
    """Fingerprints of one chain that are equal, or share a tag only, each replace the
    one before within the same `remember`: the chain stays held and counted once."""
    seed, chunk = bytes(KEY_BYTES), 4
    tokens = list(range(1, 13))  # 3 chunks
    fp = bytes(TAG_BYTES) + b"t" * 16
    fps = [fp if same_tail else fp[:-1] + bytes([c]) for c in range(3)]
    memo = ChainMemo(stride=1)
    memo.remember(seed, fps, chunk_keys(seed, tokens, chunk))
    assert len(memo) == 1
    assert memo.chains() == [seed + b"".join(chunk_keys(seed, tokens, chunk))]
    assert memo.nbytes == FINGERPRINT_COST + KEY_BYTES * 4
    assert memo.recall(seed, fps[2:]) == chunk_keys(seed, tokens, chunk)[:1]
