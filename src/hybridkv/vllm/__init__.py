"""The vLLM connector. Load it with
`KVTransferConfig(kv_connector="HybridKVConnector", kv_connector_module_path="hybridkv.vllm",
kv_role="kv_both", kv_connector_extra_config={...})`.

The connector is imported on first use (vLLM's `getattr(module, name)`), so that the
worker side's modules import without the rest of vLLM: the GPU step-order harness
(tests/step_replay.py) runs them where vLLM is not installed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.vllm.connector import HybridKVConnector

__all__ = ["HybridKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "HybridKVConnector":
        from hybridkv.vllm.connector import HybridKVConnector

        return HybridKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
