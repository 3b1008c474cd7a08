"""The vLLM connector. Load it with
`KVTransferConfig(kv_connector="HybridKVConnector", kv_connector_module_path="hybridkv.vllm",
kv_role="kv_both", kv_connector_extra_config={...})`."""

from hybridkv.vllm.connector import HybridKVConnector

__all__ = ["HybridKVConnector"]
