"""vLLM's default `kv_load_failure_policy` ("fail") ends a request whose load hybridkv
reports failed; the scheduler side warns at start, naming the fix. Built from a real
`VllmConfig` and `KVCacheConfig` (a tiny local model, no engine started)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from hybridkv.engine import CONNECTOR
from hybridkv.vllm import connector
from hybridkv.vllm.connector import HybridKVConnector


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hybridkv.models import make_model

    return make_model("qwen3", tmp_path_factory.mktemp("models") / "qwen3", size="tiny")


def start_warnings(model_dir: Path, caplog: pytest.LogCaptureFixture, **policy: str) -> str:
    """The warnings hybridkv's connector logs while its scheduler side is built."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True),
        cache_config=CacheConfig(enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            **CONNECTOR, kv_connector_extra_config={"cpu_bytes": "16MiB"}, **policy
        ),
    )
    spec = FullAttentionSpec(16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        kv_cache_layout="NHD",
    )
    # hybridkv's records go to vLLM's handlers, not up to the root logger caplog watches.
    logger = logging.getLogger(connector.__name__)
    logger.addHandler(caplog.handler)
    try:
        caplog.clear()
        side = HybridKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        assert side.scheduler_side is not None
    finally:
        logger.removeHandler(caplog.handler)
    return "\n".join(
        r.getMessage()
        for r in caplog.records
        if r.name == logger.name and r.levelno == logging.WARNING
    )


def test_vllms_default_policy_is_warned_about_naming_the_fix(model_dir, caplog):
    warned = start_warnings(model_dir, caplog)  # vLLM's default: "fail"
    assert "kv_load_failure_policy is 'fail'" in warned
    assert '"kv_load_failure_policy": "recompute"' in warned and "--kv-transfer-config" in warned
    assert start_warnings(model_dir, caplog, kv_load_failure_policy="recompute") == ""
