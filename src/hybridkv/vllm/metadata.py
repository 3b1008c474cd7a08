"""What the scheduler side tells the workers each step, and what they tell it back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hybridkv.core.index import Orders, WorkerReport
from hybridkv.core.planner import EntryCopy


@dataclass(frozen=True)
class KeyedCopy:
    key: bytes  # tier key of the entry (chunk key + group id)
    copy: EntryCopy
    cpu: bool = True  # a store: into CPU memory too (False: the index had no room)
    # A store: into the lower tiers too (False: a staged decode-time state, in CPU memory
    # only until its request finishes; then `Orders.persist` writes it down).
    below: bool = True


@dataclass
class RequestLoad:
    """An asynchronous load: vLLM waits for every worker to report `req_id` received.

    `failed` loads carry no copies: planning went wrong after the hit was reported, and
    the workers only report them as failed so vLLM recomputes the request.
    """

    req_id: str
    copies: list[KeyedCopy]
    failed: bool = False


@dataclass(frozen=True)
class TaggedCopy:
    """A store whose key is not known yet (under async scheduling, the step's last input
    token is still being sampled): the workers gather it now, while its blocks are sure
    to hold it, and keep it under `tag` until a later step names or drops it."""

    tag: int
    copy: EntryCopy


@dataclass(frozen=True)
class TagName:
    """The fate of a tagged entry: stored under `key` (into CPU memory too if `cpu`, into
    the lower tiers too if `below`: see `KeyedCopy`), or dropped (`key` None)."""

    tag: int
    key: bytes | None
    cpu: bool = True
    below: bool = True


@dataclass
class RequestStore:
    req_id: str
    copies: list[KeyedCopy]
    tagged: list[TaggedCopy] = field(default_factory=list)  # gather, keep under a tag
    # Entries tagged in earlier steps (of this request), named or dropped now.
    named: list[TagName] = field(default_factory=list)


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    epoch: int = 0  # the index's epoch: advanced by every clear
    loads: list[RequestLoad] = field(default_factory=list)
    stores: list[RequestStore] = field(default_factory=list)
    orders: Orders = field(default_factory=Orders)
    idle: bool = False  # the step schedules no tokens: no forward runs in it
    step: int = 0  # the scheduler side's count of the steps it built, this one's included
    # Requests finished since the last step whose blocks vLLM keeps until every rank
    # reports them in `finished_sending` (`request_finished` returned True).
    delayed: list[str] = field(default_factory=list)
    # vLLM's requests finished since the last step (`finished_req_ids`): their loads stop
    # and their tags go before this step's work, which may be a new request's under the
    # same id.
    finished: list[str] = field(default_factory=list)
    # Blocks this step's schedule handed to a request: the step's zeroing, state copies,
    # forward and hybridkv's loads write them, in the compute stream's order. A store
    # still reading one lands first or is dropped (vllm/handover.py, `WorkerSide.guard`).
    allocated_blocks: list[int] = field(default_factory=list)
    # Blocks handed over that another connector loads into (MultiConnector; all of them
    # in a step with synchronous loads): those writes (RDMA) follow no stream of ours.
    foreign_blocks: list[int] = field(default_factory=list)
    # The blocks handed over are not known (listing them failed): any may be, so every
    # store in flight lands first, or is dropped where nothing can wait for it.
    all_handed: bool = False


@dataclass
class HybridKVWorkerMeta(KVConnectorWorkerMetadata):
    """Each rank's report, and the newest step whose stores have all landed on it (their
    blocks are read no more); vLLM merges the ranks' with `aggregate`."""

    reports: dict[int, WorkerReport] = field(default_factory=dict)
    landed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HybridKVWorkerMeta)
        merged = dict(self.reports)
        for rank, report in other.reports.items():
            merged[rank] = merged[rank].merge(report) if rank in merged else report
        landed = dict(self.landed)
        for rank, step in other.landed.items():
            landed[rank] = max(landed.get(rank, step), step)
        return HybridKVWorkerMeta(merged, landed)
