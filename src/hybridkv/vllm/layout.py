"""Translate vLLM's `KVCacheConfig` into hybridkv's engine-agnostic `Layout`."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    iter_layer_specs,
)

from hybridkv.core.layout import GroupKind, GroupSpec, Layout


class UnsupportedLayout(ValueError):
    pass


def _layer_page_bytes(spec: KVCacheSpec) -> int:
    """Bytes of one block of one layer, without the padding vLLM adds to align pages."""
    if isinstance(spec, MambaSpec):
        return dataclasses.replace(spec, page_size_padded=None).page_size_bytes
    if isinstance(spec, AttentionSpec):
        return spec.unpadded_page_size_bytes
    raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not supported")


def _kind(spec: KVCacheSpec) -> tuple[GroupKind, int | None]:
    if isinstance(spec, MambaSpec):
        return GroupKind.STATE, None
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING, spec.sliding_window
    if isinstance(spec, FullAttentionSpec):
        # With the hybrid manager off, vLLM keeps sliding layers as full ones.
        return GroupKind.FULL, None
    raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not supported")


def group_layer_pages(kv_cache_config: KVCacheConfig) -> list[list[tuple[str, int]]]:
    """Per group, (layer name, unpadded page bytes) in the group's layer order."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        out.append(
            [
                (name, _layer_page_bytes(specs[name] if specs else group.kv_cache_spec))
                for name in group.layer_names
            ]
        )
    return out


def layout_from_vllm(vllm_config: Any, kv_cache_config: KVCacheConfig, model_id: str) -> Layout:
    groups = []
    for group, pages in zip(
        kv_cache_config.kv_cache_groups, group_layer_pages(kv_cache_config), strict=True
    ):
        first = next(iter(iter_layer_specs(group.kv_cache_spec)))
        kind, window = _kind(first)
        groups.append(
            GroupSpec(
                kind=kind,
                block_tokens=group.kv_cache_spec.block_size,
                block_bytes=sum(p for _, p in pages),
                layer_names=tuple(group.layer_names),
                window=window,
                dtype=str(getattr(first, "dtype", "") or getattr(first, "dtypes", "")),
            )
        )
    return Layout(
        model=model_id,
        groups=tuple(groups),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=vllm_config.parallel_config.rank,
    )
