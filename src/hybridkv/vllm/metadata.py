"""What the scheduler side tells the worker side each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hybridkv.core.planner import EntryCopy


@dataclass(frozen=True)
class KeyedCopy:
    key: bytes  # tier key of the entry (chunk key + group id)
    copy: EntryCopy


@dataclass
class RequestLoad:
    """An asynchronous load: vLLM waits for the worker to report `req_id` received.

    `failed` loads carry no copies: planning went wrong after the hit was reported, and
    the worker only reports them as failed so vLLM recomputes the request.
    """

    req_id: str
    copies: list[KeyedCopy]
    failed: bool = False


@dataclass
class RequestStore:
    req_id: str
    copies: list[KeyedCopy]  # write to the tiers now
    # Newest decode-time states: replace what this request staged before.
    staged: list[KeyedCopy] = field(default_factory=list)


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    stores: list[RequestStore] = field(default_factory=list)
