"""Translate vLLM's `KVCacheConfig` and `VllmConfig` into hybridkv's engine-agnostic
`Layout`: the groups, plus the settings that change the stored bytes (its identity)."""

from __future__ import annotations

import dataclasses
import json
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
from hybridkv.vllm.checkpoint import checkpoint_fingerprint


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


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def layout_identity(
    vllm_config: Any, kv_cache_config: KVCacheConfig
) -> tuple[tuple[str, str], ...]:
    """The engine settings, besides the groups, that decide what a stored page's bytes mean.

    The physical layout orders a page's heads and tokens; the dtypes and quantization fix
    the encoding; weights, revision and config overrides fix the values. Tensor-parallel
    size and rank are `Layout` fields already.
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    physical = kv_cache_config.kv_cache_layout or cache.kv_cache_layout
    if physical is None:
        raise UnsupportedLayout("vLLM has not resolved its KV cache layout yet")
    overrides = model.hf_overrides
    if callable(overrides):  # a function edits the HF config: its name is all we know
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    return (
        ("kv_cache_layout", physical),
        ("model_dtype", str(model.dtype)),
        ("kv_cache_dtype", str(cache.cache_dtype)),
        ("kv_cache_dtype_skip_layers", _json(sorted(cache.kv_cache_dtype_skip_layers))),
        ("quantization", _json([model.quantization, model.quantization_config])),
        ("revision", str(model.revision or "")),
        ("hf_overrides", _json(overrides)),
        ("load_format", str(vllm_config.load_config.load_format)),
        (
            "weights",
            checkpoint_fingerprint(
                model.model, model.revision, vllm_config.load_config.download_dir
            ),
        ),
    )


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
        identity=layout_identity(vllm_config, kv_cache_config),
    )
