"""Block copies through canonical byte views, on a fake engine cache laid out like vLLM's.

Every group's layer j overlays the same bytes (one backing region per layer index, one
page per block id at a fixed stride). Attention layers see their page as bf16
`[heads, block_tokens, head_dim * 2]`; the recurrent state layer sees a smaller int8 page,
padded up to the stride. Checks compare raw bytes, so bf16 NaN patterns compare exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core import copy_engine
from hybridkv.core.canonical import (
    CanonicalKV,
    build_canonical,
    canonical_view,
)
from hybridkv.core.copy_engine import CopyEngine
from hybridkv.core.planner import EntryCopy

NB = 12  # blocks
BT = 16  # tokens per attention block
HEADS = 2
HD2 = 8  # head_dim * 2 (K and V side by side)
STRIDE = HEADS * BT * HD2 * 2  # bytes per block: the bf16 attention page
STATE = 300  # unpadded state page, smaller than the stride
LAYERS = 2  # layers per group

GROUPS = ("full", "sliding", "state")
PAGE = {"full": STRIDE, "sliding": STRIDE, "state": STATE}


def gather(kv: CanonicalKV, g: int, block_ids) -> torch.Tensor:
    """A new host entry of group g's blocks, through the copy engine the worker uses."""
    ids = tuple(block_ids)
    return CopyEngine(kv).gather([EntryCopy(g, 0, tuple(range(len(ids))), ids)])[0]


def scatter(kv: CanonicalKV, g: int, entry: torch.Tensor, slots, block_ids) -> None:
    CopyEngine(kv).scatter([(EntryCopy(g, 0, tuple(slots), tuple(block_ids)), entry)])


@dataclass
class FakeCache:
    buf: torch.Tensor  # int8, LAYERS * NB * STRIDE bytes
    kv_caches: dict[str, torch.Tensor]
    group_layers: list[list[tuple[str, int]]]

    def page(self, layer: int, block: int, nbytes: int, buf: torch.Tensor | None = None):
        b = self.buf if buf is None else buf
        off = layer * NB * STRIDE + block * STRIDE
        return b[off : off + nbytes]


def make_cache(
    seed: int = 0, order: tuple[str, ...] = GROUPS, split_full: int = 1, device: str = "cpu"
) -> FakeCache:
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 128, (LAYERS * NB * STRIDE,), dtype=torch.int8, generator=gen)
    buf = buf.to(device)
    caches = {}
    for j in range(LAYERS):
        off = j * NB * STRIDE
        region = buf[off : off + NB * STRIDE]
        bf16 = region.view(torch.bfloat16)
        caches[f"full.{j}"] = bf16.view(NB * split_full, HEADS, BT // split_full, HD2)
        caches[f"sliding.{j}"] = bf16.view(NB, BT, HEADS, HD2)  # another shape, same bytes
        caches[f"state.{j}"] = buf.as_strided((NB, 1, 1, STATE), (STRIDE, STATE, STATE, 1), off)
    group_layers = [[(f"{g}.{j}", PAGE[g]) for j in range(LAYERS)] for g in order]
    return FakeCache(buf, caches, group_layers)


@pytest.mark.parametrize("order", [GROUPS, ("state", "sliding", "full")])
def test_aliased_layers_share_one_canonical_tensor(order):
    cache = make_cache(order=order)
    kv = build_canonical(cache.kv_caches, cache.group_layers, NB)
    assert len(kv.tensors) == LAYERS
    for g in range(3):
        assert [r.tensor_idx for r in kv.groups[g]] == [r.tensor_idx for r in kv.groups[0]]
        assert [r.page_bytes for r in kv.groups[g]] == [PAGE[order[g]]] * LAYERS
        assert kv.block_bytes(g) == LAYERS * PAGE[order[g]]
    assert len({r.tensor_idx for r in kv.groups[0]}) == LAYERS
    for j, ref in enumerate(kv.groups[0]):
        t = kv.tensors[ref.tensor_idx]
        # The widest page is kept whichever group registered the region first.
        assert t.dtype == torch.int8 and t.shape == (NB, STRIDE)
        for b in range(NB):
            assert torch.equal(t[b], cache.page(j, b, STRIDE))  # a view of the engine bytes
        t[3, 5] = 7
        assert cache.page(j, 3, STRIDE)[5] == 7


def _expected_after_scatter(cache, g_name, before, entry_pages, slots, dst):
    """The whole backing buffer after writing `entry_pages[layer][slot]` to block `dst`."""
    expect = before.clone()
    n = PAGE[g_name]
    for j in range(LAYERS):
        for slot, b in zip(slots, dst, strict=True):
            cache.page(j, b, n, expect).copy_(entry_pages[j][slot])
    return expect


@settings(max_examples=100, deadline=None)
@given(data=st.data(), g=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_gather_then_scatter_round_trips_bit_exactly(data, g, seed):
    cache = make_cache(seed)
    kv = build_canonical(cache.kv_caches, cache.group_layers, NB)
    name = GROUPS[g]
    n = data.draw(st.integers(1, NB // 2), label="n")
    src = data.draw(st.lists(st.integers(0, NB - 1), min_size=n, max_size=n, unique=True))
    free = [b for b in range(NB) if b not in src]
    dst = data.draw(st.permutations(free).map(lambda p: p[:n]), label="dst")

    entry = gather(kv, g, src)
    assert entry.dtype == torch.int8 and entry.shape == (n * LAYERS * PAGE[name],)
    # Layer-major: each layer's pages for all blocks, in block order.
    pages = entry.view(LAYERS, n, PAGE[name])
    for j in range(LAYERS):
        for k, b in enumerate(src):
            assert torch.equal(pages[j, k], cache.page(j, b, PAGE[name]))
    # The entry is a copy, not a view of the engine cache.
    assert entry.untyped_storage().data_ptr() != cache.buf.untyped_storage().data_ptr()

    before = cache.buf.clone()
    scatter(kv, g, entry.clone(), range(n), dst)
    expect = _expected_after_scatter(cache, name, before, pages, range(n), dst)
    assert torch.equal(cache.buf, expect)  # including the state page's padding bytes
    if name != "state":
        # Seen through the engine's own typed view, block dst[k] now is block src[k].
        typed = cache.kv_caches[f"{name}.0"]
        old = before[: NB * STRIDE].view(torch.bfloat16).view(typed.shape)
        assert torch.equal(typed[dst].view(torch.int16), old[src].view(torch.int16))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), g=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_scatter_of_a_slot_subset_writes_only_those_blocks(data, g, seed):
    cache = make_cache(seed)
    kv = build_canonical(cache.kv_caches, cache.group_layers, NB)
    name = GROUPS[g]
    n = data.draw(st.integers(1, 6), label="n")
    gen = torch.Generator().manual_seed(seed + 1)
    entry = torch.randint(-128, 128, (n * kv.block_bytes(g),), dtype=torch.int8, generator=gen)
    slots = data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True), label="slots")
    dst = data.draw(
        st.lists(st.integers(0, NB - 1), min_size=len(slots), max_size=len(slots), unique=True),
        label="dst",
    )
    before = cache.buf.clone()
    scatter(kv, g, entry, slots, dst)
    expect = _expected_after_scatter(
        cache, name, before, entry.view(LAYERS, n, PAGE[name]), slots, dst
    )
    assert torch.equal(cache.buf, expect)


def test_state_scatter_keeps_the_padding_beyond_the_page():
    cache = make_cache(3)
    kv = build_canonical(cache.kv_caches, cache.group_layers, NB)
    before = cache.buf.clone()
    entry = torch.full((LAYERS * STATE,), 42, dtype=torch.int8)
    scatter(kv, 2, entry, [0], [5])
    for j in range(LAYERS):
        assert (cache.page(j, 5, STATE) == 42).all()
        off = j * NB * STRIDE + 5 * STRIDE
        assert torch.equal(
            cache.buf[off + STATE : off + STRIDE], before[off + STATE : off + STRIDE]
        )
    # Gathering a state block reads the unpadded page only.
    assert torch.equal(gather(kv, 2, [5]), entry)


def test_kernel_split_blocks_view_as_one_page():
    plain = make_cache(7)
    split = make_cache(7, split_full=2)
    assert split.kv_caches["full.0"].shape[0] == 2 * NB
    for j in range(LAYERS):
        a = canonical_view(plain.kv_caches[f"full.{j}"], NB, STRIDE)
        b = canonical_view(split.kv_caches[f"full.{j}"], NB, STRIDE)
        assert b.shape == (NB, STRIDE) and b.stride() == (STRIDE, 1)
        assert torch.equal(a, b)
        assert b.data_ptr() == split.page(j, 0, 1).data_ptr()
    # The split view dedupes with the other groups' views of the same bytes; its entries
    # order each page as an unsplit engine holds it (tests/test_canonical_vllm.py), and
    # a round trip through the same split restores the pages.
    kv = build_canonical(split.kv_caches, split.group_layers, NB)
    assert len(kv.tensors) == LAYERS
    assert kv.groups[0][0].pieces is not None and kv.groups[1][0].pieces is None
    scatter(kv, 0, gather(kv, 0, [1, 2]), [1, 0], [9, 10])
    assert torch.equal(split.page(0, 9, STRIDE), split.page(0, 2, STRIDE))
    assert torch.equal(split.page(1, 10, STRIDE), split.page(1, 1, STRIDE))


def test_wrong_entry_size_is_rejected():
    cache = make_cache()
    kv = build_canonical(cache.kv_caches, cache.group_layers, NB)
    before = cache.buf.clone()
    for g in range(3):
        bad = torch.zeros(2 * kv.block_bytes(g) + 1, dtype=torch.int8)
        with pytest.raises(ValueError):
            scatter(kv, g, bad, [0, 1], [3, 4])
    assert torch.equal(cache.buf, before)


def test_views_that_cannot_be_paged_are_rejected():
    buf = torch.zeros(NB * 2 * 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="multiple"):
        canonical_view(buf.view(2 * NB, 64)[:7], NB, 8)  # 7 rows for 12 blocks
    with pytest.raises(ValueError, match="overruns"):
        canonical_view(buf.view(NB, 128), NB, 129)
    as_split = buf.view(2 * NB, 2, 32)
    with pytest.raises(ValueError, match="adjacent"):
        canonical_view(as_split[:, 0, :], NB, 64)  # kernel blocks interleaved with others
    with pytest.raises(ValueError, match="dense"):
        canonical_view(buf.view(NB, 2, 64)[:, :, 0], NB, 2)


@pytest.mark.parametrize("page", [301, 302, 300, 512, 4104])
def test_round_trip_at_any_page_size(page):
    gen = torch.Generator().manual_seed(page)
    caches = {
        f"l{j}": torch.randint(-128, 128, (NB, page), dtype=torch.int8, generator=gen)
        for j in range(3)
    }
    kv = build_canonical(caches, [[(name, page) for name in caches]], NB)
    src, dst = [7, 2, 9], [1, 11, 4]
    entry = gather(kv, 0, src)
    assert torch.equal(entry.view(3, 3, page), torch.stack([c[src] for c in caches.values()]))
    before = {name: c.clone() for name, c in caches.items()}
    scatter(kv, 0, entry, [0, 1, 2], dst)
    for name, c in caches.items():
        expect = before[name].clone()
        expect[dst] = before[name][src]
        assert torch.equal(c, expect)


def test_out_of_range_block_or_slot_is_rejected_before_any_copy():
    cache = make_cache()
    kv = build_canonical(cache.kv_caches, cache.group_layers, NB)
    before = cache.buf.clone()
    entry = gather(kv, 0, [1, 2])
    for slots, ids in (([0, 1], [3, NB]), ([0, 1], [-1, 3]), ([0, 2], [3, 4])):
        with pytest.raises(IndexError):
            scatter(kv, 0, entry, slots, ids)
    with pytest.raises(IndexError):
        gather(kv, 1, [0, NB])
    assert torch.equal(cache.buf, before)


@given(st.lists(st.integers(1, 3 * copy_engine.LAUNCH_BYTES // 2), max_size=40))
def test_a_gpu_batch_is_cut_into_launches_in_order_and_within_the_limit(sizes):
    parts = copy_engine._launches(sizes)
    assert [i for p in parts for i in p] == list(range(len(sizes)))
    for p in parts:
        assert len(p) == 1 or sum(sizes[i] for i in p) <= copy_engine.LAUNCH_BYTES
    # As few launches as that allows: no launch could have taken the next copy too.
    for p, q in pairwise(parts):
        assert sum(sizes[i] for i in p) + sizes[q[0]] > copy_engine.LAUNCH_BYTES


def test_caches_on_another_device_are_refused_at_registration(monkeypatch):
    """The CPU path would copy device addresses with memcpy (a crash, not an error); a
    ROCm GPU (torch's "cuda") runs a kernel never run there."""
    meta = torch.empty((NB, STRIDE), dtype=torch.int8, device="meta")
    kv = CanonicalKV([meta], [[]])
    with pytest.raises(ValueError, match="meta"):
        CopyEngine(kv)
    copy_engine.check_device(torch.device("cuda"))  # NVIDIA: accepted
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(ValueError, match="ROCm"):
        copy_engine.check_device(torch.device("cuda"))
