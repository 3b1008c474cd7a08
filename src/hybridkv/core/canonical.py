"""Canonical byte views of an engine's KV cache tensors, and block copies through them.

Whatever shape and dtype a layer's cache has (attention `[blocks, heads, tokens, dim]` in
bf16, a recurrent state packed as int8), the bytes of one block are a fixed-size page at a
fixed stride. We view every unique backing region as int8 `(num_blocks, page_bytes)` and
copy whole pages, the same way for every layer kind and with no per-block Python loops:
every copy of a step is one table of row copies (`row_table`), run natively across threads
on the CPU (`row_copy.py`) and by one Triton kernel on a GPU (`cuda_rows.py`).

Engines alias memory: in vLLM every group's layer i overlays the same bytes (a block id
belongs to one group at a time). Views are deduplicated by (address, block stride) so an
aliased region is one tensor with several group references.

A stored entry of a group holds its blocks layer-major: for each of the group's layers in
order, `n_blocks * page_bytes` bytes, each page in the physical order of vLLM's layout
(`kv_cache_layout`, part of the layout's identity). A page need not be a contiguous
tensor, only dense: vLLM's GPU default (LBNHC) views `[N, H, C]` bytes as `[H, N, C]`.

A kernel may split a block into k smaller ones. Where heads come before tokens in a page
(LBHNC), the k pieces hold `[H, N/k, C]` each, not the `[H, N, C]` of an unsplit engine
with the same layout: such a page is copied in `H * k` pieces (`LayerRef.pieces`) so an
entry's bytes never depend on the kernel's block size, which differs between attention
backends of replicas sharing a tier while the keys cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch


@dataclass(frozen=True)
class LayerRef:
    """One layer of a group: which canonical tensor, and how many bytes of each page."""

    layer_name: str
    tensor_idx: int
    page_bytes: int
    # (offset in the engine's page, offset in the entry's page, bytes) per piece of a
    # page whose kernel blocks hold it in another order (`page_pieces`); None: whole.
    pieces: tuple[tuple[int, int, int], ...] | None = None


@dataclass
class CanonicalKV:
    tensors: list[torch.Tensor]  # int8 (num_blocks, padded page) views
    groups: list[list[LayerRef]]

    def block_bytes(self, g: int) -> int:
        return sum(r.page_bytes for r in self.groups[g])

    @property
    def num_blocks(self) -> int:
        return self.tensors[0].shape[0] if self.tensors else 0


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill `t.numel()` consecutive elements, in any order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def canonical_view(t: torch.Tensor, num_blocks: int, page_bytes: int) -> torch.Tensor:
    """int8 `(num_blocks, page_bytes)` view of a layer cache whose dim 0 indexes blocks.

    A kernel may split each block into k smaller ones (dim 0 = k * num_blocks); the k
    pieces of a block are then adjacent and form one page (`page_pieces` says in which
    order).
    """
    if t.shape[0] % num_blocks:
        raise ValueError(f"cache dim 0 ({t.shape[0]}) is not a multiple of {num_blocks} blocks")
    split = t.shape[0] // num_blocks
    esize = t.element_size()
    inner = t[0]
    if not _dense(inner):
        raise ValueError("a block's page must be dense in memory")
    if split > 1 and t.stride(0) != inner.numel():
        raise ValueError("kernel blocks of one block are not adjacent")
    stride = t.stride(0) * esize * split
    if page_bytes > stride:
        raise ValueError(f"page of {page_bytes} bytes overruns the block stride {stride}")
    base = torch.empty(0, dtype=torch.int8, device=t.device)
    base.set_(
        t.untyped_storage(), t.storage_offset() * esize, (num_blocks, page_bytes), (stride, 1)
    )
    return base


def page_pieces(t: torch.Tensor, num_blocks: int) -> tuple[tuple[int, int, int], ...] | None:
    """Where a block's bytes go in its entry when a kernel splits it into k blocks whose
    pages put heads before tokens: `t` is vLLM's `[k * num_blocks, H, N/k, C]` view, a
    kernel block `[H, N/k, C]` in memory, an unsplit page `[H, N, C]`. Each (head, kernel
    block) row of `N/k` tokens is one piece: (offset in the engine's page, offset in the
    entry's page, bytes). None when the page is the same bytes either way (no split,
    tokens before heads, one head, or a view of another shape)."""
    split = t.shape[0] // num_blocks
    if split == 1 or t.dim() != 4:
        return None
    _, heads, tokens, content = t.shape
    s_heads, s_tokens = t.stride(1), t.stride(2)
    if heads == 1 or s_heads < s_tokens:
        return None  # [N/k, H, C]: the k pieces in a row are [N, H, C]
    if t.stride(3) != 1 or s_tokens != content or s_heads < tokens * content:
        raise ValueError("a kernel block's page is not [heads, tokens, content] in memory")
    row = tokens * content * t.element_size()  # one head's tokens of one kernel block
    kernel = t.stride(0) * t.element_size()
    head = s_heads * t.element_size()
    return tuple(
        (j * kernel + h * head, (h * split + j) * row, row)
        for h in range(heads)
        for j in range(split)
    )


def build_canonical(
    kv_caches: Mapping[str, torch.Tensor],
    group_layers: Sequence[Sequence[tuple[str, int]]],
    num_blocks: int,
) -> CanonicalKV:
    """`group_layers[g]` lists (layer name, unpadded page bytes) for group g."""
    index: dict[tuple[int, int], int] = {}
    tensors: list[torch.Tensor] = []
    groups: list[list[LayerRef]] = []
    for layers in group_layers:
        refs = []
        for name, page in layers:
            t = kv_caches[name]
            view = canonical_view(t, num_blocks, page)
            key = (view.data_ptr(), view.stride(0))
            idx = index.get(key)
            if idx is None:
                idx = index[key] = len(tensors)
                tensors.append(view)
            elif view.shape[1] > tensors[idx].shape[1]:
                tensors[idx] = view  # keep the widest page over an aliased region
            pieces = page_pieces(t, num_blocks)
            if pieces is not None and sum(n for _, _, n in pieces) != page:
                raise ValueError(f"{name}: kernel blocks hold {page} page bytes in other pieces")
            refs.append(LayerRef(name, idx, page, pieces))
        groups.append(refs)
    return CanonicalKV(tensors, groups)


def row_table(
    kv: CanonicalKV,
    g: int,
    entries: Sequence[torch.Tensor],
    slots: Sequence[Sequence[int]],
    block_ids: Sequence[Sequence[int]],
    to_engine: bool,
) -> np.ndarray:
    """Copies between host entries of group g and the engine's blocks, as an int64 table
    of (dst address, src address, bytes) rows for `row_copy.copy_rows`: for entry i, each
    layer of the group, and each k, entry row `slots[i][k]` and engine block
    `block_ids[i][k]`. The direction is entry -> engine if `to_engine`, else back.

    The native copy trusts these addresses, so everything torch's index kernels would
    check is checked here: whole-block host entries, block ids and slots in range.
    """
    refs = kv.groups[g]
    if not refs or not entries:
        return np.empty((0, 3), dtype=np.int64)
    bb = kv.block_bytes(g)
    rows, counts = [], []
    for e, sl, ids in zip(entries, slots, block_ids, strict=True):
        n, rest = divmod(e.numel(), bb)
        if rest or e.dtype != torch.int8 or e.device.type != "cpu" or not e.is_contiguous():
            raise ValueError(f"entry of {e.numel()} bytes is not whole blocks of group {g}")
        if len(sl) != len(ids):
            raise ValueError(f"{len(sl)} slots for {len(ids)} blocks")
        rows.append(n)
        counts.append(len(ids))
    total = sum(counts)
    ids = np.fromiter(chain.from_iterable(block_ids), np.int64, total)
    slot = np.fromiter(chain.from_iterable(slots), np.int64, total)
    n = np.repeat(np.array(rows, dtype=np.int64), counts)
    if total and (ids.min() < 0 or ids.max() >= kv.num_blocks):
        raise IndexError(f"block id out of range 0..{kv.num_blocks - 1}")
    if total and (slot.min() < 0 or (slot >= n).any()):
        raise IndexError("slot beyond its entry")
    ptr = np.repeat(np.array([e.data_ptr() for e in entries], dtype=np.int64), counts)
    # One row per (layer, block): layer-major, as the entry is laid out.
    views = [kv.tensors[r.tensor_idx] for r in refs]
    page = np.array([r.page_bytes for r in refs], dtype=np.int64)[:, None]
    base = np.array([v.data_ptr() for v in views], dtype=np.int64)[:, None]
    stride = np.array([v.stride(0) for v in views], dtype=np.int64)[:, None]
    engine = base + ids * stride
    entry = ptr + n * (np.cumsum(page, axis=0) - page) + slot * page
    if any(r.pieces for r in refs):  # a row per piece of each such page
        layers = []
        for r, eng, ent, size in zip(refs, engine, entry, page[:, 0], strict=True):
            at = np.array(r.pieces or [(0, 0, size)], dtype=np.int64)
            layers.append(
                np.stack(
                    np.broadcast_arrays(eng[:, None] + at[:, 0], ent[:, None] + at[:, 1], at[:, 2]),
                    axis=-1,
                ).reshape(-1, 3)
            )
        table = np.concatenate(layers)
        return table if to_engine else table[:, [1, 0, 2]]
    dst, src = (engine, entry) if to_engine else (entry, engine)
    return np.stack((dst, src, np.broadcast_to(page, engine.shape)), axis=-1).reshape(-1, 3)
