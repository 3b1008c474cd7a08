"""Translate vLLM's `KVCacheConfig` and `VllmConfig` into hybridkv's engine-agnostic
`Layout`: the groups, plus the settings that change the stored bytes (its identity)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import vllm
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
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


# The layer kinds whose blocks hybridkv knows to hold a block's tokens in order (or a
# recurrent state) and nothing else, as vLLM's prefix cache treats them. Subclasses of
# these differ where it matters: sink blocks ahead of a request's tokens
# (`SinkFullAttentionSpec`), decode-time blocks freed and masked (`RSWASpec`), hidden
# states for a connector of their own. Refused at start, never stored by guesswork.
_SUPPORTED_SPECS = (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SlidingWindowMLASpec,
    MambaSpec,
)


def _check_spec(spec: KVCacheSpec) -> None:
    name = type(spec).__name__
    if type(spec) not in _SUPPORTED_SPECS:
        raise UnsupportedLayout(f"KV cache spec {name} is not supported")
    if not spec.prefix_cacheable or spec.prefix_replay_tokens:
        raise UnsupportedLayout(f"KV cache spec {name} is not prefix-cacheable")
    if isinstance(spec, AttentionSpec) and spec.tokens_per_state != 1:
        raise UnsupportedLayout(
            f"KV cache spec {name} keeps a state per {spec.tokens_per_state} tokens"
        )


def _kind(spec: KVCacheSpec) -> tuple[GroupKind, int | None]:
    if isinstance(spec, MambaSpec):
        return GroupKind.STATE, None
    if isinstance(spec, SlidingWindowSpec):
        # Speculative decoding's drafters may keep tokens past the window's trailing edge
        # (`extra_retained_tokens`): vLLM allocates their blocks for a hit, so a hit loads
        # them too, or they keep another request's bytes under this prefix's hash.
        return GroupKind.SLIDING, spec.sliding_window + spec.extra_retained_tokens
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


def _state_tensors(spec: MambaSpec) -> tuple[str, ...]:
    """A recurrent layer's state tensors, e.g. ("torch.bfloat16[3, 64]", ...)."""
    return tuple(
        f"{dtype}{list(shape)}" for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )


def _state_identity(kv_cache_config: KVCacheConfig) -> tuple[tuple[str, str], ...]:
    """What orders a recurrent state's bytes, for layouts with recurrent groups (none else).

    vLLM keeps a conv state as (state_len, dim) ("SD") or its transpose (dim, state_len)
    ("DS"): the same bytes per block, so `block_bytes` cannot tell them apart. The layout
    in effect is what `get_conv_state_layout()` returns, not the environment variable
    now: the function caches its first answer per process, and a worker's model layers
    asked before its connector is built. Where no model is built (the scheduler side
    under the `mp` executor) it reads the environment the workers inherit, which vLLM's
    CPU platform sets (`VLLM_SSM_CONV_STATE_LAYOUT`) when the config is made. A state
    tensor's shape and dtype fix how a page splits into tensors, which its byte count
    does not either.
    """
    tensors = {}  # group id -> its layers' distinct tensor lists (one, in vLLM's models)
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        specs = [s for s in iter_layer_specs(group.kv_cache_spec) if isinstance(s, MambaSpec)]
        if specs:
            tensors[str(i)] = list(dict.fromkeys(map(_state_tensors, specs)))
    if not tensors:
        return ()
    return (("conv_state_layout", get_conv_state_layout()), ("state_tensors", _json(tensors)))


def layout_identity(
    vllm_config: Any, kv_cache_config: KVCacheConfig
) -> tuple[tuple[str, str], ...]:
    """The engine settings, besides the groups, that decide what a stored page's bytes mean.

    The physical layout orders a page's heads and tokens; the dtypes and quantization fix
    the encoding; weights, revision and config overrides fix the values; the vLLM version
    stands for what no setting names (a kernel's layout, a quantization scheme's scales).
    Tensor-parallel size and rank are `Layout` fields already. An attention page's shape
    is the group's block size, bytes and dtype and the physical layout, its head count and
    size the model's config (in `weights`); recurrent states need more (`_state_identity`).
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    physical = kv_cache_config.kv_cache_layout or cache.kv_cache_layout
    if physical is None:
        raise UnsupportedLayout("vLLM has not resolved its KV cache layout yet")
    overrides = model.hf_overrides
    if callable(overrides):  # a function edits the HF config: its name is all we know
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    load = vllm_config.load_config
    return (
        ("vllm_version", vllm.__version__),
        ("kv_cache_layout", physical),
        ("model_dtype", str(model.dtype)),
        ("kv_cache_dtype", str(cache.cache_dtype)),
        ("kv_cache_dtype_skip_layers", _json(sorted(cache.kv_cache_dtype_skip_layers))),
        ("quantization", _json([model.quantization, model.quantization_config])),
        ("revision", str(model.revision or "")),
        ("hf_overrides", _json(overrides)),
        ("load_format", str(load.load_format)),
        ("model_loader_extra_config", _json(load.model_loader_extra_config)),
        ("model_impl", str(model.model_impl)),
        ("weights", checkpoint_fingerprint(model.model, model.revision, load.download_dir)),
        ("model_weights", _located(model.model_weights)),
        ("hf_config_path", _located(model.hf_config_path)),
        # Models read these at construction: longrope (Phi-3) switches every position's
        # rotary factors past the original context, Llama 4 tunes attention temperature
        # past 32k tokens unless the generation config says otherwise.
        ("max_model_len", str(model.max_model_len)),
        ("generation_config", _located(model.generation_config)),
        ("override_generation_config", _json(model.override_generation_config)),
        ("code_revision", str(model.code_revision or "")),
        *_multimodal_identity(model.multimodal_config),
        *_state_identity(kv_cache_config),
    )


# What a multimodal engine sets for all requests that changes an item's embeddings (and
# so the KV after it) while its placeholder tokens, and vLLM's item hash, may stay alike.
_MULTIMODAL = (
    "media_io_kwargs",
    "mm_processor_kwargs",
    "mm_device_do_normalize",
    "mm_encoder_attn_dtype",
    "mm_encoder_fp8_scale_path",
    "video_pruning_rate",
    "video_pruning_method",
)


def _multimodal_identity(config: Any) -> tuple[tuple[str, str], ...]:
    if config is None:
        return ()
    return (("multimodal", _json({k: getattr(config, k, None) for k in _MULTIMODAL})),)


def _located(path: str | None) -> str:
    """A setting that may name files (a config or weights folder): their fingerprint
    where they are here (a rewrite changes it), else the value."""
    if not path:
        return ""
    return checkpoint_fingerprint(path) if os.path.exists(path) else path


def layout_from_vllm(vllm_config: Any, kv_cache_config: KVCacheConfig, model_id: str) -> Layout:
    groups = []
    for group, pages in zip(
        kv_cache_config.kv_cache_groups, group_layer_pages(kv_cache_config), strict=True
    ):
        specs = list(iter_layer_specs(group.kv_cache_spec))
        for spec in specs:
            _check_spec(spec)
        first = specs[0]
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
