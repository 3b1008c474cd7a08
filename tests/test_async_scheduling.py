"""Stores under vLLM's async scheduling (its GPU default), driven without a model.

vLLM's real `Scheduler` / `AsyncScheduler` runs with hybridkv's scheduler-role connector,
as vLLM's own connector unit tests drive it: a hand-made `KVCacheConfig` shaped like
tiny Qwen3-Next's (one full-attention group, three GDN groups in `align` mode), requests
added, `schedule()` and `update_from_output()` with made-up sampled tokens. The steps go
through a batch queue the way `EngineCore.step_with_batch_queue` does (two in flight
under async scheduling), so step N+1 is scheduled before step N's token is known.

A fake model runner executes each step in schedule order, as the worker does: it keeps
its own block tables and tokens from the scheduler output, zeroes the blocks vLLM tells it
to (`new_block_ids_to_zero`: newly allocated ones, which a hybrid model's runner zeroes),
"computes" by writing into a fake KV cache a digest of the tokens each position saw (an
attention slot: the prefix up to it; a recurrent group: the prefix up to the step's end,
in block `cdiv(end, block) - 1`, as vLLM's align mode keeps the running state), and runs
hybridkv's worker-role connector hooks in the order of vLLM's Model Runner V1
(`handle_preemptions` before the zeroing) or V2 (after it), reporting `finished_sending`
as vLLM does. So every stored entry can be checked against the key it is stored under:
the key is recomputed from the request's final token ids, the bytes must be the digest of
exactly those tokens. A request starting from a hit checks its blocks the same way before
it computes on top of them.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3
import pytest
import torch

C = 16  # block size of every group = chunk tokens
NUM_BLOCKS = 160
ATTN_PAGE = 2 * C * 2 * 64 * 2  # K and V, 2 heads of 64, bf16: 8192 bytes
SLOT = ATTN_PAGE // C  # bytes of one token in an attention page
DIGEST = 16
STATE_GROUPS = (1, 2, 3)


def digest(group: int, tokens) -> torch.Tensor:
    h = blake3.blake3(group.to_bytes(2, "little") + bytes(str(list(tokens)), "ascii"))
    return torch.frombuffer(bytearray(h.digest(DIGEST)), dtype=torch.int8)


def config_dir(tmp_path_factory):
    """A tiny Qwen3-Next config (no weights: nothing is computed)."""
    from transformers import AutoConfig

    from hybridkv.models import model_config

    cfg = model_config("qwen3-next", "tiny")
    out = tmp_path_factory.mktemp("qwen3-next")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.architectures = ["Qwen3NextForCausalLM"]
    config.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return config_dir(tmp_path_factory)


def _configs(
    model_dir,
    async_scheduling: bool,
    num_blocks: int = NUM_BLOCKS,
    kv_events: bool = False,
    extra: dict | None = None,
):
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from hybridkv.engine import CONNECTOR

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=512),
        cache_config=CacheConfig(
            block_size=C, enable_prefix_caching=True, mamba_cache_mode="align"
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=128, max_num_seqs=8, max_model_len=512, is_encoder_decoder=False
        ),
        kv_transfer_config=KVTransferConfig(
            **CONNECTOR,
            kv_connector_extra_config={"cpu_bytes": 64 << 20, **(extra or {})},
            kv_load_failure_policy="recompute",
        ),
    )
    if kv_events:
        vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    # The CPU platform turns async scheduling off; on a GPU it is the default.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    attn = FullAttentionSpec(block_size=C, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert attn.page_size_bytes == ATTN_PAGE
    gdn = MambaSpec(
        block_size=C,
        shapes=((3, 64), (4, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=ATTN_PAGE,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    groups = [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn)] + [
        KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], gdn) for i in range(3)
    ]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="NHD"
    )
    return vllm_config, kv_cache_config


@dataclass
class _RunnerRequest:
    tokens: list[int]
    blocks: list[list[int]]
    checked: bool = False  # blocks restored from a hit were verified


@dataclass
class Engine:
    """vLLM's scheduler with hybridkv on both sides and a fake model runner."""

    model_dir: object
    async_scheduling: bool
    seed: int = 0
    queue: deque = field(default_factory=deque)
    # Run between a step's schedule and the previous step's update, where the engine core
    # processes aborts: (condition, action), once.
    interrupts: list = field(default_factory=list)
    # (request id, position) -> the token sampled there (else a random one).
    forced: dict = field(default_factory=dict)
    runner: str = "v1"  # whose hook order: "v1" or "v2" (see `execute`)
    num_blocks: int = NUM_BLOCKS
    # Called with the step's number as it starts: where a test lets copies still in
    # flight (a GPU's side streams) land.
    copies_land: Callable[[int], None] | None = None
    kv_events: bool = False  # vLLM's KV cache events enabled (a null publisher)
    # The worker's copies may land after their step, as on a GPU (tests hold them in
    # flight with slow_copies.py). False: the scheduler side keeps what the connector
    # decided for this CPU configuration (a store lands within its step).
    copies_in_flight: bool = True
    extra: dict | None = None  # more of hybridkv's settings (a disk tier)

    def __post_init__(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from hybridkv.vllm.connector import HybridKVConnector
        from hybridkv.vllm.layout import group_layer_pages

        vllm_config, kv_cache_config = _configs(
            self.model_dir, self.async_scheduling, self.num_blocks, self.kv_events, self.extra
        )
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.sched = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        self.depth = vllm_config.max_concurrent_batches
        assert self.depth == (2 if self.async_scheduling else 1)
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_block_size, hash_fn)
        self.side = self.sched.connector.scheduler_side
        if self.copies_in_flight:
            self.side.stores_land_in_step = False
        self.worker_conn = HybridKVConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        pages = group_layer_pages(kv_cache_config)
        # One tensor shared by a layer of each group, as vLLM lays out a hybrid cache: a
        # block handed from one group to another is the same memory.
        shared = torch.zeros(self.num_blocks, ATTN_PAGE, dtype=torch.int8)
        self.kv = {name: shared for layers in pages for name, _ in layers}
        self.group_kv = [self.kv[layers[0][0]] for layers in pages]
        self.worker_conn.register_kv_caches(self.kv)
        self.worker = self.worker_conn.worker_side
        self.worker.hook_before_reuse = self.runner == "v1"  # as the connector sets it
        self.rng = random.Random(self.seed)
        self.running: dict[str, _RunnerRequest] = {}
        self.first_start: dict[str, int] = {}  # where each request's first step began
        self.requests = {}  # every request added, by id
        self.steps = 0

    # ---- the engine core's side -------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int, stop: int | None = None):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            stop_token_ids=[stop] if stop is not None else None,
        )
        req = Request(req_id, list(prompt), sp, None, block_hasher=self.hasher)
        self.sched.add_request(req)
        self.requests[req_id] = req
        return req

    def step(self) -> None:
        """`EngineCore.step_with_batch_queue` (a queue of one: `EngineCore.step`)."""
        sched = self.sched
        if sched.has_requests():
            out = sched.schedule()
            result = self.execute(out)
            self.queue.appendleft((out, result))
            executed = out.total_num_scheduled_tokens > 0
            if len(self.queue) < self.depth and (executed or sched.has_requests()):
                return
        if self.queue:
            for item in list(self.interrupts):
                if item[0]():
                    self.interrupts.remove(item)
                    item[1]()
            out, result = self.queue.pop()
            sched.update_from_output(out, result)

    def run(self, until=None, limit: int = 400) -> None:
        for _ in range(limit):
            if until is not None and until():
                return
            if not self.sched.has_requests() and not self.queue:
                assert until is None, "the engine went idle first"
                return
            self.step()
        raise AssertionError("the engine did not finish")

    # ---- the worker's side ------------------------------------------------------------------
    def execute(self, out):
        """One step of the model runner: V1's `execute_model` calls `handle_preemptions`
        first, then zeroes the new blocks (`_update_states`); V2's calls it in
        `pre_forward`, after `update_requests` zeroed them. Then the forward, and the
        connector's end of step (`start_load_kv`, `wait_for_save`, `get_transfer_results`,
        `build_connector_worker_meta`)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        if self.copies_land is not None:
            self.copies_land(self.steps)
        conn = self.worker_conn
        if self.runner == "v1":
            conn.handle_preemptions(out.kv_connector_metadata)
        self.group_kv[0][out.new_block_ids_to_zero or []] = 0
        if self.runner == "v2":
            conn.handle_preemptions(out.kv_connector_metadata)
        for req_id in out.finished_req_ids | (out.preempted_req_ids or set()):
            self.running.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.running[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids), [list(b) for b in new.block_ids]
            )
        cached = out.scheduled_cached_reqs
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        for i, req_id in enumerate(cached.req_ids):
            starts[req_id] = cached.num_computed_tokens[i]
            blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tokens = cached.all_token_ids.get(req_id)
                if tokens is None:
                    tokens = self.requests[req_id].all_token_ids
                self.running[req_id] = _RunnerRequest(list(tokens), [list(b) for b in blocks])
            elif blocks is not None:
                for table, new_ids in zip(self.running[req_id].blocks, blocks, strict=True):
                    table.extend(new_ids)
        sampled = []
        req_ids = list(out.num_scheduled_tokens)
        for req_id in req_ids:
            start = starts[req_id]
            self.first_start.setdefault(req_id, start)
            sampled.append(self.forward(req_id, start, start + out.num_scheduled_tokens[req_id]))
        # vLLM's KVConnectorModelRunnerMixin: bind, (forward), start_load_kv, wait_for_save.
        conn.bind_connector_metadata(out.kv_connector_metadata)
        conn.start_load_kv(None)
        conn.wait_for_save()
        results = conn.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
        )
        conn.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def forward(self, req_id: str, start: int, end: int) -> list[int]:
        r = self.running[req_id]
        assert len(r.tokens) >= end, "an input token the runner does not have"
        if not r.checked:
            r.checked = True
            self.check_restored(r, start)
        for p in range(start, end):
            block = r.blocks[0][p // C]
            self.group_kv[0][block, (p % C) * SLOT : (p % C) * SLOT + DIGEST] = digest(
                0, r.tokens[: p + 1]
            )
        for g in STATE_GROUPS:
            block = r.blocks[g][-(-end // C) - 1]
            self.group_kv[g][block, :DIGEST] = digest(g, r.tokens[:end])
        if end < len(r.tokens):
            return []  # a prefill chunk: nothing sampled
        token = self.forced.get((req_id, len(r.tokens))) or self.rng.randrange(1, 2000)
        r.tokens.append(token)
        return [token]

    def check_restored(self, r: _RunnerRequest, start: int) -> None:
        """What the step reads before it computes: vLLM's local hit or hybridkv's load."""
        if start == 0:
            return
        assert start % C == 0
        for p in range(start):
            block = r.blocks[0][p // C]
            got = self.group_kv[0][block, (p % C) * SLOT : (p % C) * SLOT + DIGEST]
            assert torch.equal(got, digest(0, r.tokens[: p + 1])), f"attention at {p}"
        for g in STATE_GROUPS:
            got = self.group_kv[g][r.blocks[g][start // C - 1], :DIGEST]
            assert torch.equal(got, digest(g, r.tokens[:start])), f"state of group {g}"

    # ---- what hybridkv holds ----------------------------------------------------------------
    def expected(self) -> dict[bytes, torch.Tensor]:
        """Every entry a stored key may name, from the requests' final token ids, with the
        digests its bytes must hold."""
        from hybridkv.core.keys import chunk_keys, group_key
        from hybridkv.vllm.request_identity import key_context

        out = {}
        for req in self.requests.values():
            tokens = list(req.all_token_ids)
            ctx = key_context(req, self.side.layout.fingerprint)
            for c, key in enumerate(chunk_keys(ctx.seed, tokens, C)):
                end = (c + 1) * C
                out[group_key(key, 0)] = torch.stack(
                    [digest(0, tokens[: c * C + s + 1]) for s in range(C)]
                )
                for g in STATE_GROUPS:
                    out[group_key(key, g)] = digest(g, tokens[:end])[None]
        return out

    def state_keys(self, req, boundary: int) -> list[bytes]:
        from hybridkv.core.keys import chunk_keys, group_key
        from hybridkv.vllm.request_identity import key_context

        ctx = key_context(req, self.side.layout.fingerprint)
        key = chunk_keys(ctx.seed, list(req.all_token_ids)[:boundary], C)[boundary // C - 1]
        return [group_key(key, g) for g in STATE_GROUPS]

    def stored(self) -> dict[bytes, torch.Tensor]:
        return dict(self.worker.store.cpu._entries)

    def check_entries(self) -> None:
        """Every stored entry holds what its key says, and the index knows exactly them."""
        expected = self.expected()
        stored = self.stored()
        for key, entry in stored.items():
            assert key in expected, "an entry under a key of tokens no request has"
            want = expected[key]
            got = entry[:DIGEST][None] if len(want) == 1 else entry.view(C, SLOT)[:, :DIGEST]
            assert torch.equal(got, want), "an entry computed from other tokens than its key's"
        index = self.side.index
        assert index.gauges()["cpu_entries"] == len(stored)
        assert all(index.in_cpu(key) for key in stored)

    def check_settled(self, lossy: bool = False) -> None:
        """Nothing held, pinned or staged once no request is in flight; nothing lost
        unless `lossy` (stores dropped on purpose, and loads of what they held)."""
        assert not self.queue and not self.sched.has_requests()
        assert self.side.index.pinned() == 0
        assert self.side.pending_tags() == 0
        assert self.worker.staged_entries == 0
        assert self.side.stats.hook_errors == 0 and self.worker.stats.hook_errors == 0
        assert self.worker.stats.failed_stores == 0
        assert self.worker.sending.held == 0 and self.worker.restoring == 0
        if not lossy:
            assert self.side.index.stats.lost == 0 and self.worker.stats.failed_loads == 0


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


def stored_on_disk(model_dir, disk: dict) -> list[int]:
    """A 40-token prompt a first engine stored with the hybridkv settings `disk` (a disk
    tier), its worker closed: an engine started on the same disk finds it there only."""
    first = Engine(model_dir, False, seed=13, extra=disk)
    a = first.add("a", _prompt(40, 51), max_tokens=2)
    first.run()
    first.worker.close()
    return list(a.prompt_token_ids)


def next_turn_restores_64(eng: Engine, a) -> None:
    """The next turn: a's conversation so far (64 tokens computed) plus 10. vLLM's own
    cache is dropped, so the 64 tokens come from hybridkv (the decode-end state and four
    chunks), and every entry and pin is as it should be after."""
    assert eng.sched.reset_prefix_cache()
    hits = eng.side.stats.hit_tokens
    eng.add("a2", list(a.all_token_ids) + _prompt(10, 3), max_tokens=3)
    eng.run()
    assert eng.side.stats.hit_tokens - hits == 64 and eng.first_start["a2"] == 64
    eng.check_entries()
    eng.check_settled()


MODES = [pytest.param(True, id="async"), pytest.param(False, id="sync")]


@pytest.mark.parametrize("async_scheduling", MODES)
def test_decode_states_are_stored_under_their_final_tokens(model_dir, async_scheduling):
    """A request's decode-time boundaries (48, then 64: the last position it computes is
    63) are planned and stored, the last one staged for the next turn, with every
    attention chunk, each under the key of the tokens it was computed from; the next turn
    restores 64 tokens from hybridkv alone."""
    eng = Engine(model_dir, async_scheduling)
    # 40 prompt tokens + 25 sampled: positions 0..63 are computed (the last token never is).
    a = eng.add("a", _prompt(40, 1), max_tokens=25)
    b = eng.add("b", _prompt(23, 2), max_tokens=30)  # a neighbour in the same batches
    eng.run()
    assert a.num_tokens == 65 and b.num_tokens == 53
    stored = eng.stored()
    for key in eng.state_keys(a, 64):
        assert key in stored, "the decode-end state at 64 was not stored"
    for key in eng.state_keys(a, 48):
        assert key not in stored, "the state at 48 should have been replaced by 64's"
    for key in eng.state_keys(a, 32):
        assert key in stored  # the prompt's checkpoint
    for key in eng.state_keys(b, 48):
        assert key in stored  # b computes 0..51: 48 is its last boundary
    expected = eng.expected()
    chunk_keys = {k for k in expected if k[-2:] == b"\x00\x00"}
    assert len([k for k in chunk_keys if k in stored]) == 4 + 3  # every attention chunk
    eng.check_entries()
    eng.check_settled()

    next_turn_restores_64(eng, a)


def test_a_fault_in_the_kv_events_turns_them_off_and_nothing_else(model_dir, monkeypatch):
    """The index tells the KV cache events of every change in the middle of its own (an
    eviction, a store). A fault in the events' tracker (injected: no input makes the real
    one fail) must not leave such a change half done nor reach vLLM (which asks for the
    events every step): the events stop, and stores and restores go on as before."""
    from hybridkv.core.resumable import ResumableTracker

    def fail(*args, **kwargs):
        raise RuntimeError("injected tracker fault")

    eng = Engine(model_dir, async_scheduling=False, kv_events=True)
    events = eng.side.events
    assert events is not None and not events.broken
    monkeypatch.setattr(ResumableTracker, "changed", fail)
    a = eng.add("a", _prompt(40, 1), max_tokens=25)
    eng.run()  # vLLM's scheduler calls take_events after every step
    assert events.broken and eng.side.snapshot()["kv_events_stopped"] == 1
    assert list(eng.sched.connector.take_events()) == []
    eng.check_entries()
    eng.check_settled()
    next_turn_restores_64(eng, a)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_fault_planning_one_requests_stores_costs_its_stores_alone(
    model_dir, monkeypatch, async_scheduling
):
    """A fault while one request's stores are planned (injected where it hurts most:
    after its chunks were admitted to the index, when its decode-time state is staged;
    no input makes the real code fail) costs that request's stores alone. Its neighbour's
    stores in the same step go out, what it admitted is withdrawn (the index holds
    exactly what the workers do), its tagged stores are dropped, and it stores no more.
    (The whole step's stores used to be dropped, the index still counting them.)"""
    from hybridkv.vllm.scheduler_side import SchedulerSide

    stage = SchedulerSide._stage

    def failing(self, st, keys, copies):
        if st.request.request_id == "b" and copies:
            raise RuntimeError("injected planning fault")
        return stage(self, st, keys, copies)

    eng = Engine(model_dir, async_scheduling)
    monkeypatch.setattr(SchedulerSide, "_stage", failing)
    a = eng.add("a", _prompt(40, 1), max_tokens=25)
    b = eng.add("b", _prompt(23, 2), max_tokens=30)
    eng.run()
    assert a.num_tokens == 65 and b.num_tokens == 53
    assert eng.side.stats.hook_errors == 1  # b's first decode-time state, then no more
    stored = eng.stored()
    assert all(key in stored for key in eng.state_keys(a, 64))
    assert not any(key in stored for key in eng.state_keys(b, 48))
    eng.check_entries()
    eng.side.stats.hook_errors = 0
    eng.check_settled()
    next_turn_restores_64(eng, a)


@pytest.mark.parametrize("drop", [True, False], ids=["dropped", "delivered"])
@pytest.mark.parametrize("async_scheduling", MODES)
def test_abort_and_preemption_at_a_boundary_leave_nothing_behind(model_dir, async_scheduling, drop):
    """One request is aborted and one preempted just after the step that reaches a chunk
    boundary is scheduled, before the previous step's output is processed (where the
    engine core handles aborts). Under async scheduling the last token of that boundary's
    key is then never known: the aborted request's token is discarded, the preempted
    one's is dropped and sampled again (as `reset_prefix_cache(reset_running_requests=
    True)` preempts). Nothing is stored under a key of tokens the state did not see,
    nothing stays staged or pinned, and the preempted request's boundaries are stored once
    it has computed them again. vLLM preempts for memory keeping the output in flight
    (`drop` False), as hybridkv asks (`requires_kv_delivery`): the same holds."""
    import time

    from vllm.v1.request import RequestStatus

    eng = Engine(model_dir, async_scheduling, seed=7)
    sched = eng.sched
    x = eng.add("x", _prompt(40, 4), max_tokens=40)
    y = eng.add("y", _prompt(35, 5), max_tokens=40)

    def preempt_y():
        sched.running.remove(y)
        sched._preempt_request(y, time.monotonic(), drop_stale_output=drop)

    eng.interrupts = [
        (
            lambda: x.num_computed_tokens == 48,
            lambda: sched.finish_requests("x", RequestStatus.FINISHED_ABORTED),
        ),
        (lambda: y.num_computed_tokens == 64, preempt_y),
    ]
    eng.run()
    assert not eng.interrupts and x.num_tokens == 48 - async_scheduling
    assert y.num_preemptions == 1 and y.num_tokens == 75
    stored = eng.stored()
    x48 = [k in stored for k in eng.state_keys(x, 48)] if x.num_tokens >= 48 else [False] * 3
    # Sync: the tokens were known when the step was planned. Async: never known.
    assert x48 == [not async_scheduling] * 3
    for key in eng.state_keys(y, 64):
        assert key in stored  # y's last boundary: 74 positions computed
    eng.check_entries()
    eng.check_settled()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_the_state_after_a_stop_token_is_kept_for_the_next_turn(model_dir, async_scheduling):
    """A request stops on a token sampled for position 63. Under async scheduling the step
    that computes position 63 (on that very token) is already scheduled when the stop is
    processed: its state at 64 is named when the request finishes, its key's tokens being
    known then (and admitted to the index at once). A next turn arriving right then hits
    it: the step that plans its load also carries the names, and the workers store named
    entries before the step's loads. Under sync scheduling position 63 is never computed:
    48 is the last boundary."""
    eng = Engine(model_dir, async_scheduling, seed=3)
    side = eng.side
    stop = 4321
    z = eng.add("z", _prompt(40, 6), max_tokens=100, stop=stop)
    eng.forced[("z", 63)] = stop
    eng.run(until=z.is_finished)
    assert z.num_tokens == 64 and z.all_token_ids[-1] == stop
    last = 64 if async_scheduling else 48
    assert side.pending_tags() == (4 if async_scheduling else 0)  # a chunk and three states
    eng.add("z2", list(z.all_token_ids) + _prompt(10, 7), max_tokens=3)
    eng.run()
    assert eng.first_start["z2"] == last
    # vLLM's own cache may hold up to 48 (then hybridkv has nothing to add under sync).
    assert (side.stats.hit_tokens > 0) == async_scheduling
    eng.check_entries()
    eng.check_settled()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_failed_load_stores_what_its_recompute_computes(model_dir, async_scheduling):
    """An entry the index holds goes missing on the worker: the hit that needs it fails,
    vLLM recomputes the prefix, and that recompute stores the chunks again (before, the
    load had marked them stored: the lost one stayed lost for every later request)."""
    from hybridkv.core.keys import chunk_keys, group_key
    from hybridkv.vllm.request_identity import key_context

    eng = Engine(model_dir, async_scheduling, seed=13)
    side = eng.side
    a = eng.add("a", _prompt(40, 51), max_tokens=2)
    eng.run()
    prompt = list(a.prompt_token_ids)
    first = group_key(chunk_keys(key_context(a, side.layout.fingerprint).seed, prompt, C)[0], 0)
    assert first in eng.stored()
    eng.worker.store.cpu.delete(first)  # lost behind the index's back
    assert eng.sched.reset_prefix_cache()
    eng.add("b", prompt, max_tokens=2)
    eng.run()
    assert eng.worker.stats.failed_loads == 1 and eng.first_start["b"] == 0
    assert first in eng.stored() and side.index.in_cpu(first)
    assert eng.sched.reset_prefix_cache()
    hit = side.stats.hit_tokens
    eng.add("c", prompt, max_tokens=2)
    eng.run()
    assert side.stats.hit_tokens - hit > 0 and eng.first_start["c"] > 0
    eng.check_entries()
    eng.check_settled(lossy=True)
    assert side.index.stats.lost == 1 and eng.worker.stats.failed_loads == 1


def test_an_engine_without_prefix_caching_gets_no_hits(model_dir):
    """vLLM turns prefix caching off for models a restored prefix would break (pooling by
    mean or CLS cannot prefill a part; non-causal attention makes a prefix's KV depend
    on later tokens) and on request: hybridkv then neither offers a hit nor stores."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import Request

    from hybridkv.vllm.connector import HybridKVConnector

    vllm_config, kv_cache_config = _configs(model_dir, False)
    vllm_config.cache_config.enable_prefix_caching = False
    conn = HybridKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    req = Request("r", _prompt(100, 3), SamplingParams(max_tokens=1), None)
    assert not conn.scheduler_side.enabled
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)


def test_kv_events_that_stop_retract_what_they_announced(model_dir, monkeypatch):
    """Once a fault stops the events, what they announced can never be corrected: the
    next step retracts every block they may have announced, on each tier, then nothing
    more comes (a router would otherwise keep sending this replica those prefixes)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from hybridkv.core.resumable import ResumableTracker

    def fail(*args, **kwargs):
        raise RuntimeError("injected tracker fault")

    eng = Engine(model_dir, async_scheduling=False, kv_events=True)
    published: list = []
    monkeypatch.setattr(
        eng.sched.kv_event_publisher, "publish", lambda batch: published.extend(batch.events)
    )

    def hashes(kind) -> set:
        return {
            h
            for e in published
            if isinstance(e, kind) and e.medium == "CPU"
            for h in e.block_hashes
        }

    eng.add("a", _prompt(40, 1), max_tokens=25)
    eng.run()
    announced = hashes(BlockStored) - hashes(BlockRemoved)
    assert announced
    published.clear()
    monkeypatch.setattr(ResumableTracker, "changed", fail)
    eng.add("b", _prompt(40, 2), max_tokens=25)
    eng.run()
    assert eng.side.events.broken
    assert announced <= hashes(BlockRemoved) and not hashes(BlockStored)
    assert list(eng.sched.connector.take_events()) == []
    eng.check_entries()
    eng.check_settled()
