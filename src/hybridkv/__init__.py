"""hybridkv: KV-cache offloading for hybrid LLMs, as an out-of-tree vLLM KV connector."""

__version__ = "0.1.0"
