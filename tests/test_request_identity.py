"""Request identity: chunk keys cover what vLLM's own block hashes cover (LoRA, multimodal
items, prompt embeddings, salt), plain requests keep their keys, unkeyable ones are refused.

Requests are real `vllm.v1.request.Request` objects. Where a pair of requests is compared,
vLLM's own block hasher (hash block = one chunk) runs on the same pair: a chunk's keys
must differ exactly where vLLM's block hashes differ.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from hybridkv.core.index import StoreIndex
from hybridkv.core.keys import chain_seed, chunk_keys, extend_chain
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.policy import CheckpointPolicy
from hybridkv.vllm.request_identity import key_context
from hybridkv.vllm.scheduler_side import SchedulerSide

C = 4  # chunk tokens
FP = bytes(range(16))  # a layout fingerprint
TOKENS = list(range(100, 124))  # 6 chunks
IMAGE = 7  # placeholder token id

init_none_hash(sha256)


def _request(tokens: list[int] | None = TOKENS, **kw) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=None if tokens is None else list(tokens),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(C, sha256),
        **kw,
    )


def _keys(request: Request) -> list[bytes]:
    ctx = key_context(request, FP)
    assert ctx is not None
    return chunk_keys(ctx.seed, request.all_token_ids, C, ctx.chunk_extras)


def _lora(name: str, path: str = "/adapters/x") -> LoRARequest:
    return LoRARequest(name, 1, path)


def _image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset, length),
        mm_hash=identifier,
    )


def _image_tokens(*ranges: tuple[int, int]) -> list[int]:
    tokens = list(TOKENS)
    for offset, length in ranges:
        tokens[offset : offset + length] = [IMAGE] * length
    return tokens


def _embeds(seed: int, changed_row: int | None = None) -> torch.Tensor:
    t = torch.randn(len(TOKENS), 8, generator=torch.Generator().manual_seed(seed))
    if changed_row is not None:
        t[changed_row, 3] += 1.0
    return t.to(torch.bfloat16)


def _with_images(*images: tuple[str, int, int]) -> Request:
    return _request(
        _image_tokens(*((o, n) for _, o, n in images)),
        mm_features=[_image(i, o, n) for i, o, n in images],
    )


EMBEDS = _embeds(0)
ZEROS = [0] * len(TOKENS)
MASK = [i % 3 == 0 for i in range(len(TOKENS))]  # token positions of a mixed prompt

# (request a, request b, first chunk whose keys differ, or None when all are equal)
PAIRS: dict[str, tuple[Callable[[], Request], Callable[[], Request], int | None]] = {
    "same_plain": (_request, _request, None),
    "salt": (lambda: _request(cache_salt="a"), lambda: _request(cache_salt="b"), 0),
    "lora_vs_none": (_request, lambda: _request(lora_request=_lora("A")), 0),
    "lora_a_vs_b": (
        lambda: _request(lora_request=_lora("A")),
        lambda: _request(lora_request=_lora("B")),
        0,
    ),
    "lora_same_name_other_path": (
        lambda: _request(lora_request=_lora("A")),
        lambda: _request(lora_request=_lora("A", "/adapters/y")),
        0,
    ),
    "same_lora": (
        lambda: _request(lora_request=_lora("A")),
        lambda: _request(lora_request=_lora("A")),
        None,
    ),
    "embeds_vs_zero_tokens": (
        lambda: _request(None, prompt_embeds=EMBEDS),
        lambda: _request(ZEROS),
        0,
    ),
    "different_embeds": (
        lambda: _request(None, prompt_embeds=EMBEDS),
        lambda: _request(None, prompt_embeds=_embeds(1)),
        0,
    ),
    "embeds_differ_from_row_9": (
        lambda: _request(None, prompt_embeds=EMBEDS),
        lambda: _request(None, prompt_embeds=_embeds(0, changed_row=9)),
        9 // C,
    ),
    "same_embeds": (
        lambda: _request(None, prompt_embeds=EMBEDS),
        lambda: _request(None, prompt_embeds=EMBEDS.clone()),
        None,
    ),
    "different_image_same_placeholders": (
        lambda: _with_images(("img-a", 5, 8)),
        lambda: _with_images(("img-b", 5, 8)),
        5 // C,
    ),
    "same_image": (
        lambda: _with_images(("img-a", 5, 8)),
        lambda: _with_images(("img-a", 5, 8)),
        None,
    ),
    "second_image_differs": (
        lambda: _with_images(("img-a", 2, 4), ("img-b", 13, 6)),
        lambda: _with_images(("img-a", 2, 4), ("img-c", 13, 6)),
        13 // C,
    ),
    "images_swapped": (
        lambda: _with_images(("img-a", 2, 4), ("img-b", 13, 4)),
        lambda: _with_images(("img-b", 2, 4), ("img-a", 13, 4)),
        0,
    ),
    "same_image_shifted_in_placeholders": (
        lambda: _request(_image_tokens((4, 12)), mm_features=[_image("img-a", 4, 8)]),
        lambda: _request(_image_tokens((4, 12)), mm_features=[_image("img-a", 5, 8)]),
        1,
    ),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_keys_differ_exactly_where_vllm_block_hashes_differ(name):
    make_a, make_b, first_diff = PAIRS[name]
    a, b = make_a(), make_b()
    ka, kb = _keys(a), _keys(b)
    assert len(ka) == len(kb) == len(a.block_hashes) == len(TOKENS) // C
    ours = [x != y for x, y in zip(ka, kb, strict=True)]
    theirs = [x != y for x, y in zip(a.block_hashes, b.block_hashes, strict=True)]
    assert ours == theirs
    # The chain carries a difference to every later chunk.
    n = len(ka)
    assert ours == [first_diff is not None and i >= first_diff for i in range(n)]


@pytest.mark.parametrize("salt", [None, "", "tenant-a"])
def test_plain_request_keys_are_the_keys_of_today(salt):
    request = _request(cache_salt=salt)
    request.append_output_token_ids([9, 8, 7, 6, 5])  # decode tokens are keyed as ever
    ctx = key_context(request, FP)
    assert ctx is not None
    assert ctx.seed == chain_seed(FP, salt)
    n = request.num_tokens // C
    assert ctx.chunk_extras(0, n, C) == [b""] * n
    assert _keys(request) == chunk_keys(chain_seed(FP, salt), request.all_token_ids, C)


def test_mixed_prompt_mask_is_keyed():
    """Same embeddings and token ids, different token/embedding positions: a position
    holding token 0 and one holding an embedding row are different inputs (vLLM's hash
    does not include the mask; ours does)."""
    tokens = [0 if not m else t for t, m in zip(TOKENS, MASK, strict=True)]
    other = list(MASK)
    other[10] = not other[10]
    ka = _keys(_request(tokens, prompt_embeds=EMBEDS, prompt_is_token_ids=MASK))
    kb = _keys(_request(tokens, prompt_embeds=EMBEDS, prompt_is_token_ids=other))
    assert [x != y for x, y in zip(ka, kb, strict=True)] == [i >= 10 // C for i in range(6)]


def test_lora_adapter_rewritten_in_place_changes_keys(tmp_path: Path):
    """Stored entries outlive the engine: new adapter files under the same name and path
    must not be served the old adapter's KV."""
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(b"v1")
    os.utime(weights, ns=(1, 1))
    before = _keys(_request(lora_request=_lora("A", str(tmp_path))))
    assert before == _keys(_request(lora_request=_lora("A", str(tmp_path))))
    weights.write_bytes(b"v2")
    os.utime(weights, ns=(1, 1))  # same size and time: only misses could hide, not help
    weights.write_bytes(b"v2 longer")
    os.utime(weights, ns=(2, 2))
    after = _keys(_request(lora_request=_lora("A", str(tmp_path))))
    assert not set(before) & set(after)


def test_embeds_of_the_same_bytes_read_as_other_numbers_key_apart():
    """The same bytes as bf16 [N, 8], fp16 [N, 8] and fp32 [N, 4] are other inputs: the
    digest covers dtype and shape (vLLM's own block hashes take the bytes alone)."""
    keys = [
        _keys(_request(None, prompt_embeds=e))
        for e in (EMBEDS, EMBEDS.view(torch.float16), EMBEDS.view(torch.float32))
    ]
    for chunk in range(len(keys[0])):
        assert len({k[chunk] for k in keys}) == 3


def test_embeds_keys_extend_incrementally_through_decode():
    """Chunks past the prompt have no embedding rows; the chain still carries the prompt's
    embeddings, and extending in steps gives the keys computed at once."""
    a = _request(None, prompt_embeds=EMBEDS)
    b = _request(None, prompt_embeds=_embeds(0, changed_row=0))
    for r in (a, b):
        r.append_output_token_ids(list(range(1, 10)))
    ctx = key_context(a, FP)
    assert ctx is not None
    chain: list[bytes] = []
    for cut in (3, 9, 9, 17, a.num_tokens):
        extend_chain(chain, ctx.seed, a.all_token_ids[:cut], C, ctx.chunk_extras)
    assert chain == _keys(a)
    assert len(chain) == a.num_tokens // C
    assert not set(chain) & set(_keys(b))


def test_unkeyable_requests_are_refused():
    assert key_context(_request(resumable=True), FP) is None
    unnamed = _request(_image_tokens((5, 8)), mm_features=[_image("", 5, 8)])
    assert key_context(unnamed, FP) is None


def _side(hash_block_size: int | None) -> SchedulerSide:
    layout = Layout(
        "memo",
        (GroupSpec(GroupKind.FULL, C, 64, ("attn",)), GroupSpec(GroupKind.STATE, C, 32, ("gdn",))),
    )
    planner = Planner(layout.groups)
    policy = CheckpointPolicy("prompt_and_end", C)
    index = StoreIndex(1 << 20, recurrent=True)
    return SchedulerSide(
        layout, planner, policy, index, True, False, hash_block_size=hash_block_size
    )


@pytest.mark.parametrize("hash_block", [C, C // 2])
def test_keys_found_by_vllm_block_hashes_are_the_keys_hashed(hash_block):
    """The scheduler side keys a prompt extending one seen lately from vLLM's block hashes
    (core/keys.py's `ChainMemo`): across seeded conversations that continue, fork,
    change salt or LoRA adapter, and carry images or embeddings, every request's keys
    equal those hashed from its tokens, and the memo did serve some of them."""
    seed = 20261127
    print("seed", seed)
    rng = random.Random(seed)
    side = _side(hash_block)
    hasher = get_request_block_hasher(hash_block, sha256)
    fp = side.layout.fingerprint
    prompts: list[list[int]] = [list(range(1, 1 + 3 * C))]
    memo, recalled = side._memo, []  # (kind, chunks recalled) of every recall
    assert memo is not None
    recall = memo.recall
    memo.recall = lambda *a: recalled.append((kind, len(got := recall(*a)))) or got
    for i in range(300):
        base = rng.choice(prompts)
        base = base[: rng.randrange(len(base) + 1)] if rng.random() < 0.3 else base
        tokens = base + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 3 * C))]
        prompts.append(tokens)
        kind = rng.choice(["plain", "plain", "plain", "salt", "lora", "image", "embeds"])
        kw: dict = {
            "salt": {"cache_salt": "tenant"},
            "lora": {"lora_request": _lora("A")},
            "image": {"mm_features": [_image("img-a", 0, min(3, len(tokens)))]},
            "embeds": {"prompt_embeds": torch.ones(len(tokens), 4)},
        }.get(kind, {})
        request = Request(
            request_id=f"r{i}",
            prompt_token_ids=None if kind == "embeds" else tokens,
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            block_hasher=hasher,
            **kw,
        )
        keys = side._keys(side._state(request), request.num_tokens)
        ctx = key_context(request, fp)
        assert ctx is not None
        assert keys == chunk_keys(ctx.seed, request.all_token_ids, C, ctx.chunk_extras), (i, kind)
    assert {k for k, _ in recalled} == {"plain", "salt", "lora"}  # extras: hashed whole
    assert sum(n for _, n in recalled) > 0


def test_no_memo_without_whole_hash_blocks_per_chunk():
    assert _side(None)._memo is None
    assert _side(3)._memo is None  # a chunk of 4 tokens is no whole number of 3-token blocks
    assert _side(C)._memo is not None
