"""Deterministic random-weight hybrid models, written locally from a transformers config.

Nothing is downloaded: tests, the demo and the benchmarks run on these. The same
architecture, size and seed always give byte-identical weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ARCHS = ("qwen3-next", "gemma3", "qwen3")
SIZES = ("tiny", "small")

_VOCAB = {"tiny": 2048, "small": 32000}


def _dims(size: str, layers: tuple[int, int]) -> dict[str, Any]:
    """Shapes every architecture here shares; head dims are ones the CPU kernels take."""
    tiny = size == "tiny"
    return dict(
        hidden_size=256 if tiny else 768,
        intermediate_size=512 if tiny else 2048,
        num_hidden_layers=layers[0] if tiny else layers[1],
        num_attention_heads=4 if tiny else 8,
        num_key_value_heads=2,
        head_dim=64 if tiny else 128,
        max_position_embeddings=16384,
    )


def _qwen3_next(size: str) -> dict[str, Any]:
    # The CPU GDN kernel takes linear head dims of 64 or 128 only, and bf16.
    tiny = size == "tiny"
    return dict(
        _dims(size, (4, 8)),
        model_type="qwen3_next",
        full_attention_interval=4,
        linear_num_key_heads=2 if tiny else 4,
        linear_num_value_heads=4 if tiny else 8,
        linear_key_head_dim=64 if tiny else 128,
        linear_value_head_dim=64 if tiny else 128,
        linear_conv_kernel_dim=4,
        num_experts=4 if tiny else 8,
        num_experts_per_tok=2,
        moe_intermediate_size=128 if tiny else 512,
        shared_expert_intermediate_size=128 if tiny else 512,
        decoder_sparse_step=1,
    )


def _gemma3(size: str) -> dict[str, Any]:
    return dict(
        _dims(size, (6, 12)),
        model_type="gemma3_text",
        sliding_window=192 if size == "tiny" else 512,
    )


def _qwen3(size: str) -> dict[str, Any]:
    return dict(_dims(size, (2, 12)), model_type="qwen3")


_BUILDERS = {"qwen3-next": _qwen3_next, "gemma3": _gemma3, "qwen3": _qwen3}


def model_config(arch: str, size: str = "tiny") -> dict[str, Any]:
    if arch not in _BUILDERS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    cfg = _BUILDERS[arch](size)
    cfg.update(vocab_size=_VOCAB[size], tie_word_embeddings=False, torch_dtype="bfloat16")
    return cfg


def default_model_dir(arch: str, size: str) -> Path:
    """Where the demo and benchmarks keep generated models: $HYBRIDKV_HOME/models/."""
    home = Path(os.environ.get("HYBRIDKV_HOME", Path.home() / ".cache" / "hybridkv"))
    return home / "models" / f"{arch}-{size}"


def make_model(arch: str, out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write config + safetensors for a random-weight model; reuse an existing one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    marker = out / "hybridkv-model.json"
    spec = {"arch": arch, "size": size, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    cfg_dict = model_config(arch, size)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out
