"""Replays vLLM's per-step order around hybridkv's worker side, on tensors shaped like a
hybrid KV cache, and checks every byte hybridkv stores and restores.

What vLLM does each step, on the compute stream, read from vLLM 0.32:
- Model Runner V1 (`GPUModelRunner.execute_model`, then `sample_tokens`):
  `handle_preemptions`, `_update_states` (zeroes the new blocks), `preprocess_mamba`
  (copies each recurrent state into the block of the step's end), the forward, and as
  the forward context exits `start_load_kv`, `wait_for_save`, `get_transfer_results`,
  `build_connector_worker_meta`; then the logits and sampling.
- Model Runner V2 (worker/gpu/model_runner.py, worker/gpu/kv_connector.py):
  `update_requests` (zeroes the new blocks), `preprocess_state` (the same copy),
  `pre_forward` (`handle_preemptions`), the forward, sampling, then `post_forward`
  (`start_load_kv`, `wait_for_save`, `get_transfer_results`, ...).
And between steps the scheduler, played here by `Replay` itself with hybridkv's rules
(which stores to plan, which finished requests to delay, which blocks to list as handed
over): it frees a finished request's blocks at once, or once the worker has reported it
in `finished_sending` if it was delayed; a superseded recurrent state's block (Mamba
align mode retires it two chunks later) and a preempted request's blocks at once; and
hands freed blocks to the next allocation, before the step's new blocks.

The forward writes each request's attention block of the step (a pattern of prompt,
chunk and layer) and XORs the step's delta into the recurrent state the pre-copy brought
into the step's state block, behind a few matrix products that keep the compute stream
busy. On a GPU the store stream is held back after each forward (a sleep on a side
stream, as a busy link would), so a store lands after the next step's zeroing unless
something orders them; the host runs at most one step ahead of the GPU, as vLLM's
scheduler does by waiting for each step's sampled tokens. On a CPU the copies are held in
flight instead (tests/slow_copies.py), each landing two steps after the step that made
it unless hybridkv waits for it, so the same races happen there.

The GPU machine this runs on has no vLLM: the worker side needs only the two metadata
base classes of vLLM's connector API, stood in for there (`_without_vllm`); hybridkv's
other dependencies travel as wheels.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, field

import torch

PAGE = 16 << 10  # bytes of a block in one layer: the attention page
STATE_PAGE = 12 << 10  # a recurrent state's page, padded to the block stride as vLLM does
LAYERS = 4  # each layer tensor is shared by one layer of each group, as in vLLM
CHUNK = 16  # tokens a block holds: every group's block, hybridkv's chunk
NUM_BLOCKS = 96
# On a GPU: the forward's matrix products (a few ms on an H100), and the store stream's
# hold after each forward (~2 ms at 2 GHz): far longer than the next step's zeroing
# takes to come, shorter than a step, so stores do not pile up behind one another.
BUSY_SIZE, BUSY_PRODUCTS = 4096, 3
STORE_DELAY_CYCLES = 4_000_000
CPU_COPY_STEPS = 2  # on a CPU, a copy lands this many steps after the step that made it
RETIRED_STEPS = 8  # steps a block retired by a running request rests before reuse


def _without_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    path = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    parts = path.split(".")
    for i in range(len(parts)):
        sys.modules[".".join(parts[: i + 1])] = types.ModuleType(".".join(parts[: i + 1]))
    base = sys.modules[path]
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
    base.KVConnectorWorkerMetadata = type("KVConnectorWorkerMetadata", (), {})


_without_vllm()

from slow_copies import SlowCopies  # noqa: E402

from hybridkv.core.host_pool import HostPool  # noqa: E402
from hybridkv.core.layout import GroupKind, GroupSpec  # noqa: E402
from hybridkv.core.planner import EntryCopy, Planner  # noqa: E402
from hybridkv.core.store import TieredStore  # noqa: E402
from hybridkv.core.tiers.memory import MemoryTier  # noqa: E402
from hybridkv.vllm.metadata import (  # noqa: E402
    HybridKVMetadata,
    KeyedCopy,
    RequestLoad,
    RequestStore,
)
from hybridkv.vllm.worker_side import TransferResults, WorkerSide  # noqa: E402


def pattern(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`n` int8 bytes that `seed` decides."""
    i = torch.arange(n, dtype=torch.int32, device=device)
    return ((i * 131 + seed * 7919) % 251 - 125).to(torch.int8)


def _seed(prompt: int, chunk: int, group: int, layer: int) -> int:
    return ((prompt * 64 + chunk) * 2 + group) * LAYERS + layer


def _key(prompt: int, chunk: int, group: int) -> bytes:
    return f"{prompt}:{chunk}:{group}".encode()


def expected_entry(prompt: int, chunk: int, group: int) -> torch.Tensor:
    """The bytes of an entry, layer-major: the attention block of the chunk, or the
    recurrent state at its end (the XOR of every delta up to it)."""
    if group == 0:
        return torch.cat([pattern(_seed(prompt, chunk, 0, j), PAGE) for j in range(LAYERS)])
    layers = []
    for j in range(LAYERS):
        state = torch.zeros(STATE_PAGE, dtype=torch.int8)
        for c in range(chunk + 1):
            state ^= pattern(_seed(prompt, c, 1, j), STATE_PAGE)
        layers.append(state)
    return torch.cat(layers)


@dataclass
class _Request:
    rid: str
    prompt: int
    chunks: int  # chunks it computes
    arrives: int  # the step it arrives in
    next: int = 0  # the next chunk to compute
    attn: list[int] = field(default_factory=list)  # attention block of each chunk
    state: dict[int, int] = field(default_factory=dict)  # chunk -> block of its end state
    loading: bool = False  # waits for hybridkv's load
    stored: int = 0  # the last step a store was planned on its blocks in (0: none)

    def blocks(self) -> list[int]:
        return self.attn + list(self.state.values())


class Replay:
    def __init__(
        self,
        device: str,
        runner: str = "v1",
        loads: bool = False,
        preempt: bool = False,
        delayed_free: bool = True,
        list_handed_over: bool = True,
    ):
        """`loads`: later requests repeat earlier prompts and restore them through
        hybridkv while others compute and store. `preempt`: every third step the newest
        running request is preempted, and blocks a running request retires are handed
        out again at once. `delayed_free` and `list_handed_over` switch off hybridkv's
        two protections (to show that the checks catch it)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.runner, self.loads, self.preempt = runner, loads, preempt
        self.delayed_free, self.list_handed_over = delayed_free, list_handed_over
        self.kv = [
            torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8, device=device) for _ in range(LAYERS)
        ]
        caches = {f"{g}.{j}": self.kv[j] for g in ("attn", "state") for j in range(LAYERS)}
        attn = [(f"attn.{j}", PAGE) for j in range(LAYERS)]
        state = [(f"state.{j}", STATE_PAGE) for j in range(LAYERS)]
        groups = [
            GroupSpec(GroupKind.FULL, CHUNK, LAYERS * PAGE, tuple(n for n, _ in attn)),
            GroupSpec(GroupKind.STATE, CHUNK, LAYERS * STATE_PAGE, tuple(n for n, _ in state)),
        ]
        store = TieredStore([MemoryTier(1 << 30)], HostPool(pin=self.cuda))
        self.worker = WorkerSide(Planner(groups), store, hook_before_reuse=runner == "v1")
        self.worker.register(caches, [attn, state], NUM_BLOCKS)
        self._cpu_copies = None if self.cuda else SlowCopies(self.worker.copies, lambda: self.steps)
        self._fresh = list(range(NUM_BLOCKS - 1, 0, -1))  # block 0 is vLLM's null block
        self._freed: list[int] = []  # handed out again, last freed first
        self._retired: list[tuple[int, int]] = []  # (step retired, block)
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self._held: dict[str, _Request] = {}  # finished, blocks kept for the worker
        self._delayed: list[str] = []  # to name in the next step's metadata
        self._finished: set[str] = set()  # vLLM's finished_req_ids of the next step
        self._landed = 0  # the newest step whose stores the worker reported landed
        self.planned: set[tuple[int, int, int]] = set()  # (prompt, chunk, group) stored
        self.lost: set[bytes] = set()
        self.restored_blocks = 0
        self.steps = 0
        self._sampled: torch.cuda.Event | None = None
        if self.cuda:
            self._busy = torch.randn(BUSY_SIZE, BUSY_SIZE, device=device)
            self._out = torch.empty_like(self._busy)
            self._slow = torch.cuda.Stream(self.device)

    # ---- the workload ---------------------------------------------------------------------
    def add(self, rid: str, prompt: int, chunks: int, arrives: int = 0) -> None:
        self.waiting.append(_Request(rid, prompt, chunks, arrives))

    def run(self, limit: int = 400) -> None:
        for _ in range(limit):
            if not (self.waiting or self.running or self._held or self._finished):
                if self.cuda:
                    torch.cuda.synchronize()
                else:
                    self._cpu_copies.land()
                self.worker.report()  # every copy has landed: into the tiers
                return
            self.step()
        raise AssertionError("the replay did not finish")

    # ---- the scheduler ------------------------------------------------------------------------
    def _allocate(self, handed: list[int]) -> int:
        block = self._freed.pop() if self._freed else self._fresh.pop()
        handed.append(block)
        return block

    def _free(self, blocks: list[int]) -> None:
        self._freed += blocks

    def _room(self) -> int:
        return len(self._fresh) + len(self._freed)

    def _hit(self, req: _Request) -> int:
        """Chunks a new request restores: those every earlier store covers, with the
        state at the last (the keys `lost` reports removed are not counted)."""
        k = 0
        while k < req.chunks - 1 and (req.prompt, k, 0) in self.planned:
            if _key(req.prompt, k, 0) in self.lost:
                break
            k += 1
        while k and (
            (req.prompt, k - 1, 1) not in self.planned or _key(req.prompt, k - 1, 1) in self.lost
        ):
            k -= 1
        return k if self.loads else 0

    def schedule(self) -> tuple[HybridKVMetadata, list[int], list[_Request]]:
        """The step's metadata, the new blocks to zero, the requests computed."""
        meta = HybridKVMetadata(delayed=self._delayed, step=self.steps)
        self._delayed = []
        handed: list[int] = []
        zero: list[int] = []
        rested = [b for t, b in self._retired if self.steps - t >= RETIRED_STEPS]
        self._fresh[:0] = rested  # handed out after every fresh block
        self._retired = [(t, b) for t, b in self._retired if b not in rested]
        victims = [r for r in self.running if not r.loading]
        if self.preempt and self.steps % 3 == 2 and len(victims) > 1:
            self.running.remove(victims[-1])  # `_preempt_request`: its blocks go at once
            self._free(victims[-1].blocks())
        for req in self.running:
            if not req.loading and req.next - 2 in req.state:  # retired two chunks on
                block = req.state.pop(req.next - 2)
                if self.preempt:
                    self._free([block])
                else:
                    self._retired.append((self.steps, block))
        while (
            self.waiting
            and self.waiting[0].arrives <= self.steps
            and self._room() >= self.waiting[0].chunks + 2
        ):
            req = self.waiting.pop(0)
            k = self._hit(req)
            if k:
                req.attn = [self._allocate(handed) for _ in range(k)]
                req.state[k - 1] = self._allocate(handed)
                req.next, req.loading = k, True
                copies = [
                    KeyedCopy(_key(req.prompt, c, 0), EntryCopy(0, c, (0,), (b,)))
                    for c, b in enumerate(req.attn)
                ]
                copies.append(
                    KeyedCopy(
                        _key(req.prompt, k - 1, 1), EntryCopy(1, k - 1, (0,), (req.state[k - 1],))
                    )
                )
                meta.loads.append(RequestLoad(req.rid, copies))  # not zeroed: being written
            self.running.append(req)
        computed = [r for r in self.running if not r.loading]
        for req in computed:
            c = req.next
            req.attn.append(self._allocate(handed))
            req.state[c] = self._allocate(handed)
            zero += [req.attn[c], req.state[c]]
            copies = [
                KeyedCopy(_key(req.prompt, c, g), EntryCopy(g, c, (0,), (block,)), below=False)
                for g, block in ((0, req.attn[c]), (1, req.state[c]))
                if (req.prompt, c, g) not in self.planned
            ]
            if copies:
                self.planned |= {(req.prompt, c, g) for g in (0, 1)}
                req.stored = self.steps
                meta.stores.append(RequestStore(req.rid, copies))
        if self.list_handed_over:
            meta.allocated_blocks = handed
        return meta, zero, computed

    def update(self, results: TransferResults, computed: list[_Request]) -> None:
        """The scheduler processes the step's output (the step's report last, as vLLM
        hands it to the connector after the requests the step finished)."""
        for rid in results.sending:
            self._free(self._held.pop(rid).blocks())
        for req in [r for r in self.running if r.rid in results.received]:
            req.loading = False
            if req.rid in results.failed:  # vLLM recomputes it: here it simply ends
                self.running.remove(req)
                self._free(req.blocks())
            else:
                self._check_restored(req)
        for req in computed:
            req.next += 1
            if req.next == req.chunks and req in self.running:  # finished
                self.running.remove(req)
                self._finished.add(req.rid)
                if self.delayed_free and req.stored > self._landed:
                    self._held[req.rid] = req
                    self._delayed.append(req.rid)
                else:
                    self._free(req.blocks())
        self.lost |= set(self.worker.report().lost)
        self._landed = self.worker.landed_through()

    # ---- the model runner ---------------------------------------------------------------------
    def step(self) -> None:
        self.steps += 1
        if self._cpu_copies is not None:
            self._cpu_copies.land(queued_before=self.steps + 1 - CPU_COPY_STEPS)
        meta, zero, computed = self.schedule()
        finished, self._finished = self._finished, set()
        ws = self.worker
        if self.runner == "v1":
            ws.guard(meta)  # handle_preemptions, first in execute_model
        self._zero(zero)
        self._pre_copy(computed)
        if self.runner == "v2":
            ws.guard(meta)  # pre_forward
        self._forward(computed)
        if self.runner == "v1":  # the forward context exits
            results = self._connector_end(meta, finished)
            self._sample()
        else:
            self._sample()
            results = self._connector_end(meta, finished)
        self.update(results, computed)

    def _connector_end(self, meta: HybridKVMetadata, finished: set[str]) -> TransferResults:
        self.worker.begin_step(meta)
        self._hold_store_stream()
        self.worker.end_step(meta)
        return self.worker.transfer_results(finished)

    def _zero(self, blocks: list[int]) -> None:
        if blocks:
            ids = torch.tensor(blocks, device=self.device)
            for t in self.kv:
                t.index_fill_(0, ids, 0)

    def _pre_copy(self, computed: list[_Request]) -> None:
        for req in computed:
            if req.next:
                src, dst = req.state[req.next - 1], req.state[req.next]
                for t in self.kv:
                    t[dst, :STATE_PAGE] = t[src, :STATE_PAGE]

    def _forward(self, computed: list[_Request]) -> None:
        if self.cuda:
            for _ in range(BUSY_PRODUCTS):
                torch.mm(self._busy, self._busy, out=self._out)
        for req in computed:
            c = req.next
            for j, t in enumerate(self.kv):
                t[req.attn[c]] = pattern(_seed(req.prompt, c, 0, j), PAGE, self.device)
                t[req.state[c], :STATE_PAGE] ^= pattern(
                    _seed(req.prompt, c, 1, j), STATE_PAGE, self.device
                )

    def _hold_store_stream(self) -> None:
        """The store stream's next copy starts a while after the forward (GPU only)."""
        if not self.cuda:
            return
        self._slow.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._slow):
            torch.cuda._sleep(STORE_DELAY_CYCLES)
        self.worker.copies._stores.wait_stream(self._slow)

    def _sample(self) -> None:
        """The step's sampling; the host then waits for the step before it, as vLLM's
        scheduler waits for its sampled tokens: at most one step ahead of the GPU."""
        if not self.cuda:
            return
        sampled = torch.cuda.Event()
        self._out[:8].argmax()
        sampled.record()
        if self._sampled is not None:
            self._sampled.synchronize()
        self._sampled = sampled

    # ---- checks -------------------------------------------------------------------------------
    def _check_restored(self, req: _Request) -> None:
        for c in range(req.next):
            got = torch.cat([t[req.attn[c]].cpu() for t in self.kv])
            assert torch.equal(got, expected_entry(req.prompt, c, 0)), f"restored chunk {c}"
        got = torch.cat([t[req.state[req.next - 1], :STATE_PAGE].cpu() for t in self.kv])
        assert torch.equal(got, expected_entry(req.prompt, req.next - 1, 1)), "restored state"
        self.restored_blocks += req.next + 1

    def check(self, dropped: bool) -> None:
        """Every entry stored holds its key's bytes; `dropped`: stores may have been
        dropped (their blocks handed over in flight), else every one arrived."""
        cpu = self.worker.store.cpu
        missing = 0
        for prompt, chunk, group in self.planned:
            entry = cpu.get(_key(prompt, chunk, group))
            if entry is None:
                missing += 1
                continue
            want = expected_entry(prompt, chunk, group)
            assert torch.equal(entry, want), f"entry {prompt}:{chunk}:{group} holds other bytes"
        stats = self.worker.stats
        assert missing <= stats.overtaken_entries
        if not dropped:
            assert missing == 0 and stats.overtaken_entries == 0, "a store was dropped"
        assert stats.failed_stores == 0 and stats.hook_errors == 0
        assert self.worker.sending.held == 0 and self.worker.restoring == 0
