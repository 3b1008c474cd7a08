"""Canonical views of caches that vLLM's own allocator lays out (`allocate_kv_cache`), in
each physical layout it offers and with kernel blocks smaller than the manager's.

The CPU engines of the suite only ever use LBHNC without a split; GPU engines default to
LBNHC (a page `[N, H, C]` in memory under an `[H, N, C]` view, dense but not contiguous),
and a backend with fixed kernel block sizes splits a hybrid model's large blocks. An
entry must hold the same bytes for the same KV whatever the split (replicas with other
attention backends share its key), and restore to the same KV.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from hybridkv.core.canonical import build_canonical
from hybridkv.core.copy_engine import CopyEngine
from hybridkv.core.planner import EntryCopy
from hybridkv.vllm.layout import group_layer_pages

BLOCK = 32
BF16 = torch.bfloat16


def engine(layout: KVCacheLayout, full_kernel: int):
    """A hybrid model's caches (full attention, sliding window, a padded recurrent
    state), the full-attention group's kernel blocks `full_kernel` tokens."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=BF16)
    swa = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=BF16, sliding_window=64
    )
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 16), (2, 8, 8)),
        dtypes=(BF16, torch.float32),
        page_size_padded=full.page_size_bytes,
    )
    groups = [
        KVCacheGroupSpec(["a0", "a1"], full),
        KVCacheGroupSpec(["s0", "s1"], swa),
        KVCacheGroupSpec(["m0", "m1"], mamba),
    ]
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    kvc = get_kv_cache_config_from_groups(config, groups, full.page_size_bytes * 2 * 20)
    caches = allocate_kv_cache(kvc, torch.device("cpu"), layout, [full_kernel, BLOCK, BLOCK])
    return kvc, caches


def logical(view: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """An attention layer's cache as `[blocks, heads, tokens, content]`, whatever the
    kernel split (`[k * blocks, heads, tokens / k, content]`)."""
    k = view.shape[0] // num_blocks
    _, heads, tokens, content = view.shape
    return (
        view.reshape(num_blocks, k, heads, tokens, content)
        .permute(0, 2, 1, 3, 4)
        .reshape(num_blocks, heads, k * tokens, content)
    )


def fill(caches, kvc, seed: int) -> None:
    """The same KV, by (layer, block, head, token), in every engine built by `engine`."""
    gen = torch.Generator().manual_seed(seed)
    for name in ("a0", "a1"):
        view = caches[name]
        want = torch.randn(logical(view, kvc.num_blocks).shape, generator=gen).to(BF16)
        k = view.shape[0] // kvc.num_blocks
        _, heads, tokens, content = view.shape
        view.copy_(
            want.reshape(kvc.num_blocks, heads, k, tokens, content)
            .permute(0, 2, 1, 3, 4)
            .reshape(view.shape)
        )


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC])
def test_an_entry_is_the_same_bytes_whatever_the_kernel_split(layout):
    entries = {}
    for kernel in (BLOCK, BLOCK // 2, BLOCK // 4):
        kvc, caches = engine(layout, kernel)
        fill(caches, kvc, seed=5)
        kv = build_canonical(caches, group_layer_pages(kvc), kvc.num_blocks)
        [entries[kernel]] = CopyEngine(kv).gather([EntryCopy(0, 0, (0, 1), (3, 7))])
    assert torch.equal(entries[BLOCK], entries[BLOCK // 2])
    assert torch.equal(entries[BLOCK], entries[BLOCK // 4])


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC])
@pytest.mark.parametrize(("stored", "restored"), [(BLOCK, BLOCK // 2), (BLOCK // 4, BLOCK)])
def test_an_entry_restores_the_same_kv_into_another_split(layout, stored, restored):
    kvc, src = engine(layout, stored)
    fill(src, kvc, seed=9)
    kv = build_canonical(src, group_layer_pages(kvc), kvc.num_blocks)
    [entry] = CopyEngine(kv).gather([EntryCopy(0, 0, (0, 1), (2, 6))])

    kvc2, dst = engine(layout, restored)
    fill(dst, kvc2, seed=10)
    before = {name: logical(dst[name], kvc2.num_blocks).clone() for name in ("a0", "a1")}
    kv2 = build_canonical(dst, group_layer_pages(kvc2), kvc2.num_blocks)
    CopyEngine(kv2).scatter([(EntryCopy(0, 0, (0, 1), (11, 4)), entry)])
    for name in ("a0", "a1"):
        got = logical(dst[name], kvc2.num_blocks)
        want = before[name].clone()
        want[[11, 4]] = logical(src[name], kvc.num_blocks)[[2, 6]]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(
    "layout",
    [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC, KVCacheLayout.BLHNC],
)
def test_every_block_compact_layout_registers_and_round_trips(layout):
    """A page per (layer, block) dense in memory, in any order within it: accepted, and
    a gather then scatter moves exactly the pages' bytes of every group."""
    kvc, caches = engine(layout, BLOCK)
    raw = next(iter(caches.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.int8)
    flat.set_(raw, 0, (raw.nbytes(),), (1,))
    flat.copy_(torch.randint(-128, 128, flat.shape, generator=torch.Generator().manual_seed(1)))
    kv = build_canonical(caches, group_layer_pages(kvc), kvc.num_blocks)
    copies = CopyEngine(kv)
    for g in range(3):
        [entry] = copies.gather([EntryCopy(g, 0, (0, 1), (3, 7))])
        before = flat.clone()
        copies.scatter([(EntryCopy(g, 0, (0, 1), (12, 13)), entry)])
        changed = (flat != before).nonzero().flatten()
        # Only bytes of blocks 12 and 13 of the group's layers, now those of 3 and 7.
        for name, page in group_layer_pages(kvc)[g]:
            t = caches[name]
            stride = t.stride(0) * t.element_size() * (t.shape[0] // kvc.num_blocks)
            base = t.storage_offset() * t.element_size()
            for src, dst in ((3, 12), (7, 13)):
                a, b = base + src * stride, base + dst * stride
                assert torch.equal(flat[b : b + page], before[a : a + page])
        pages = group_layer_pages(kvc)[g]
        assert len(changed) <= 2 * sum(p for _, p in pages)


def test_a_page_spread_over_layers_is_refused_at_registration():
    kvc, caches = engine(KVCacheLayout.BHLNC, BLOCK)
    with pytest.raises(ValueError, match="dense"):
        build_canonical(caches, group_layer_pages(kvc), kvc.num_blocks)
