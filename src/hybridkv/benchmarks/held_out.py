"""Workload families the eviction policy was not tuned on (issue 29), built from published
workload statistics rather than our own guesses. Each generator is deterministic for a
seed; its lengths come from a *plan* function (no tokens) so that tests can check the
published means on many draws cheaply.

Where a source publishes only a mean, lengths follow the maximum-entropy distribution
with that mean (exponential for token counts, geometric for counts of turns); where a
public trace is available its own shape is used. Token counts given in words use
OpenAI's rule of thumb, 100 tokens for 75 words. `scale` multiplies every token length,
so a trace fits a tiny model's context and a small engine (its sharing structure is
unchanged); the published figures hold at `scale` 1.

Families:
  sharegpt_chat    multi-turn chat with ShareGPT's statistics: 3.51 turns per
                   conversation, 94.46 tokens per user turn, 348.45 per answer (ShareGPT
                   row of the dataset comparison in Zheng et al., "LMSYS-Chat-1M",
                   ICLR 2024, Table 1; repeated in WildChat's Table 1, Zhao et al.,
                   ICLR 2024). No system prompt: ShareGPT conversations carry none.
  mooncake_like    Mooncake's conversation trace (FAST'25 release,
                   github.com/kvcache-ai/Mooncake, FAST25-release/traces): records of
                   its own format (timestamp ms, input_length, output_length, hash ids
                   of 512-token prefix blocks). Published there: 12,031 requests in an
                   hour, average input 12,035 and output 343 tokens (README table).
                   Computed here from conversation_trace.jsonl at commit 3b5a594
                   (`MOONCAKE`): 3.40 requests/s (generated as Poisson arrivals);
                   every request starts with one shared 512-token block; 61.3 % start
                   a new prefix (input log-normal, median 5,264, log-sd 1.265, at least
                   891 tokens), 32.9 % extend a whole earlier prompt (growth median 471,
                   mean 1,597 tokens; gap to it median 123 s, mean 212 s), 5.8 % share
                   part of one (median 6 blocks, log-sd 1.016; then median 19 new
                   blocks, log-sd 0.886); an unlimited cache of 512-token blocks hits
                   36.6 % of blocks.
                   A trace of fewer requests is the same hour for a share of the users
                   (arrival rate scaled down, per-conversation gaps kept in seconds).
                   The generator is checked against these (tests/test_held_out.py).
  coding_agent     coding-agent loops: one long context per task grows by the agent's
                   action and the tool's output every turn. 30.2 turns per task on
                   average (SWE-smith trajectories, SWE-agent scaffold: table of the
                   nebius/SWE-rebench-openhands-trajectories dataset card); the task is
                   a GitHub issue of 195.1 words on average (Jimenez et al., "SWE-bench",
                   ICLR 2024, Table 1); tool observations are 83.9 % of an agent's tokens
                   (Lindenbauer et al., "The Complexity Trap", 2025, Fig. 1); an action is
                   the model's output, 182 tokens on average in Mooncake's tool-and-agent
                   trace (README table). Agents share a few fully repetitive system
                   prompts (Mooncake paper); their length is not published (`system_tokens`
                   is an assumption).
  rag_passages     retrieval-augmented QA over many documents: each prompt is the top-10
                   retrieved passages (Lewis et al., "Retrieval-Augmented Generation",
                   NeurIPS 2020, k = 10) of 100 words each (Karpukhin et al., "Dense
                   Passage Retrieval", EMNLP 2020) in retrieval order, then a question
                   of about 100 tokens ("1000+ tokens" of documents added to a 100-token
                   request, Jin et al., "RAGCache", 2024). Passage popularity is Zipf-like
                   with 3 % of the documents serving 60 % of the requests (RAGCache, its
                   retrieval-pattern analysis): the first, most relevant passage follows
                   it, the others the same popularity among passages not drawn yet.
  mixture          the four families above arriving concurrently: their requests
                   interleaved (each family keeps its own order), meant for the
                   concurrent replay (`in_flight` > 1 in the hit-rate bench).
  issue29          issue 29's case: 3 shared system prompts of 800 tokens, 18
                   conversations of 4 turns with 300-token user turns and 24-token
                   answers, 6 of them forking after turn 2 (a second continuation of
                   turns 3 and 4 from the same turn-2 context, side by side with the
                   first), conversations interleaved 6 at a time.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Any

from hybridkv.benchmarks.traces import (
    Trace,
    conversation,
    interleave,
    mooncake_trace,
    numbered_trace,
    random_tokens,
    seeded,
)

TOKENS_PER_WORD = 4 / 3  # OpenAI: "100 tokens ~= 75 words"


def exponential(rng: random.Random, mean: float) -> float:
    """A draw with the maximum-entropy shape for a positive length of known mean."""
    return rng.expovariate(1 / mean)


def geometric(rng: random.Random, mean: float) -> int:
    """A count >= 1 with the given mean (maximum entropy for a count of known mean)."""
    if mean <= 1:
        return 1
    return 1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / mean))


def scaled(tokens: float, scale: float) -> int:
    """A token count at `scale`, at least one token."""
    return max(1, round(tokens * scale))


# ---- ShareGPT-like chat ------------------------------------------------------------------------
SHAREGPT_TURNS = 3.51
SHAREGPT_USER_TOKENS = 94.46
SHAREGPT_ANSWER_TOKENS = 348.45


def sharegpt_plan(conversations: int, seed: int = 0) -> list[list[tuple[float, float]]]:
    """Per conversation, (user tokens, answer tokens) of each turn, at scale 1."""
    plan = []
    for c in range(conversations):
        rng = seeded(seed, "sharegpt", c)
        turns = geometric(rng, SHAREGPT_TURNS)
        plan.append(
            [
                (exponential(rng, SHAREGPT_USER_TOKENS), exponential(rng, SHAREGPT_ANSWER_TOKENS))
                for _ in range(turns)
            ]
        )
    return plan


def sharegpt_chat(
    conversations: int = 32,
    concurrency: int = 8,
    scale: float = 1.0,
    max_prompt_tokens: int = 3500,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """One request per user turn; its prompt is every earlier turn and answer of the
    conversation plus the new user turn. A conversation stops before a prompt longer than
    `max_prompt_tokens`; `concurrency` conversations are open at a time."""
    params = dict(locals())
    streams = []
    for c, turns in enumerate(sharegpt_plan(conversations, seed)):
        rng = seeded(seed, "sharegpt-tokens", c)
        context: list[int] = []
        stream = []
        for t, (user, answer) in enumerate(turns):
            prompt = context + random_tokens(rng, scaled(user, scale), vocab)
            if len(prompt) > max_prompt_tokens:
                break
            stream.append((prompt, f"sharegpt{c}", f"turn{t}"))
            context = prompt + random_tokens(rng, scaled(answer, scale), vocab)
        if stream:
            streams.append(stream)
    order = interleave(streams, concurrency, seeded(seed, "sharegpt-order"))
    return numbered_trace("sharegpt-like", order, vocab, max_tokens, params)


# ---- Mooncake-like shared-prefix arrivals ------------------------------------------------------
@dataclass(frozen=True)
class MooncakeStats:
    """Mooncake's conversation trace (module docstring)."""

    requests_per_hour: int = 12031
    rate_per_s: float = 3.40
    block: int = 512
    mean_input: float = 12035  # README
    mean_output: float = 343  # README
    new_share: float = 0.613
    extend_share: float = 0.329  # the rest share part of an earlier prompt
    new_median: float = 5264
    new_log_sd: float = 1.265
    min_input: int = 891
    max_input: int = 126195
    growth_median: float = 471
    growth_mean: float = 1597
    gap_median_s: float = 123
    gap_mean_s: float = 212
    fork_blocks_median: float = 6
    fork_blocks_log_sd: float = 1.016
    fork_new_median: float = 19
    fork_new_log_sd: float = 0.886
    block_hit_ratio: float = 0.366  # an unlimited cache of 512-token prefix blocks


MOONCAKE = MooncakeStats()


def _lognormal(rng: random.Random, median: float, mean: float) -> float:
    return rng.lognormvariate(math.log(median), math.sqrt(2 * math.log(mean / median)))


def mooncake_records(requests: int, seed: int = 0) -> list[dict[str, Any]]:
    """Records in Mooncake's format with the conversation trace's statistics, at scale 1
    (module docstring): `requests` out of its hour, arriving at the rate that share of
    its users would send."""
    m = MOONCAKE
    rng = seeded(seed, "mooncake-like")
    rate = m.rate_per_s * requests / m.requests_per_hour
    records: list[dict[str, Any]] = []
    tips: list[tuple[float, int]] = []  # (time, record) of prompts not extended yet
    next_id, now = 1, 0.0  # hash id 0: the block every request starts with

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    for i in range(requests):
        now += rng.expovariate(rate)
        kind = rng.random()
        earlier = None
        if records and kind >= m.new_share:
            when = now - _lognormal(rng, m.gap_median_s, m.gap_mean_s)
            pool = (
                tips
                if kind < m.new_share + m.extend_share
                else [(r["timestamp"] / 1e3, j) for j, r in enumerate(records)]
            )
            at = min(bisect.bisect_right(pool, (when, math.inf)), len(pool)) - 1
            earlier = pool[max(at, 0)][1]
        if earlier is None:
            length = round(rng.lognormvariate(math.log(m.new_median), m.new_log_sd))
            length = min(max(length, m.min_input), m.max_input)
            ids = [0, *new_ids(-(-length // m.block) - 1)]
            session = f"user{i}"
        else:
            base = records[earlier]
            full = base["input_length"] // m.block
            session = base["session"]
            if kind < m.new_share + m.extend_share:
                tips.remove((base["timestamp"] / 1e3, earlier))
                growth = _lognormal(rng, m.growth_median, m.growth_mean)
                length = min(base["input_length"] + max(1, round(growth)), m.max_input)
                ids = base["hash_ids"][:full] + new_ids(-(-length // m.block) - full)
            else:
                shared = min(
                    full,
                    max(
                        1,
                        round(
                            rng.lognormvariate(math.log(m.fork_blocks_median), m.fork_blocks_log_sd)
                        ),
                    ),
                )
                fresh = max(
                    1, round(rng.lognormvariate(math.log(m.fork_new_median), m.fork_new_log_sd))
                )
                length = (shared + fresh) * m.block - rng.randrange(m.block)
                ids = base["hash_ids"][:shared] + new_ids(fresh)
        record = {
            "timestamp": round(now * 1e3),
            "input_length": length,
            "output_length": rng.randint(1, round(2 * m.mean_output) - 1),
            "hash_ids": ids,
            "session": session,
        }
        records.append(record)
        bisect.insort(tips, (record["timestamp"] / 1e3, i))
    return records


def mooncake_like(
    requests: int = 240,
    scale: float = 1 / 16,
    max_prompt_tokens: int = 4096,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """`mooncake_records` as a trace, each 512-token block `512 * scale` tokens long;
    prompts longer than `max_prompt_tokens` (scaled) keep only their head."""
    params = dict(locals())
    tokens_per_block = max(1, round(MOONCAKE.block * scale))
    cap = max_prompt_tokens * MOONCAKE.block // tokens_per_block
    records = [
        {**r, "input_length": cap, "hash_ids": r["hash_ids"][: -(-cap // MOONCAKE.block)]}
        if r["input_length"] > cap
        else r
        for r in mooncake_records(requests, seed)
    ]
    return mooncake_trace(
        records,
        "mooncake-like",
        block_size=MOONCAKE.block,
        tokens_per_block=tokens_per_block,
        vocab=vocab,
        max_tokens=max_tokens,
        seed=seed,
        params=params,
    )


# ---- coding-agent loops ------------------------------------------------------------------------
AGENT_TURNS = 30.2
AGENT_MAX_TURNS = 151  # the longest SWE-smith trajectory
ISSUE_TOKENS = 195.1 * TOKENS_PER_WORD
ACTION_TOKENS = 182.0
OBSERVATION_SHARE = 0.839
OBSERVATION_TOKENS = ACTION_TOKENS * OBSERVATION_SHARE / (1 - OBSERVATION_SHARE)


def agent_plan(tasks: int, seed: int = 0) -> list[tuple[float, list[tuple[float, float]]]]:
    """Per task, the issue's tokens and (action, observation) tokens of each turn after
    the first, at scale 1."""
    plan = []
    for t in range(tasks):
        rng = seeded(seed, "agent", t)
        turns = min(geometric(rng, AGENT_TURNS), AGENT_MAX_TURNS)
        steps = [
            (exponential(rng, ACTION_TOKENS), exponential(rng, OBSERVATION_TOKENS))
            for _ in range(turns - 1)
        ]
        plan.append((exponential(rng, ISSUE_TOKENS), steps))
    return plan


def coding_agent(
    tasks: int = 6,
    concurrency: int = 3,
    system_prompts: int = 2,
    system_tokens: int = 2048,
    scale: float = 1 / 8,
    max_prompt_tokens: int = 6000,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """One request per agent turn: turn 1 is a system prompt (scaled) + the issue, each
    next turn the previous prompt + the agent's action + the tool's output. A task stops
    before a prompt longer than `max_prompt_tokens`; `concurrency` tasks run at a time."""
    params = dict(locals())
    systems = [
        random_tokens(seeded(seed, "agent-sys", k), scaled(system_tokens, scale), vocab)
        for k in range(system_prompts)
    ]
    streams = []
    for t, (issue, steps) in enumerate(agent_plan(tasks, seed)):
        rng = seeded(seed, "agent-tokens", t)
        k = rng.randrange(system_prompts)
        prompt = systems[k] + random_tokens(rng, scaled(issue, scale), vocab)
        stream = [(prompt, f"task{t}", f"sys{k}/turn0")]
        for s, (action, observation) in enumerate(steps, 1):
            step = scaled(action, scale) + scaled(observation, scale)
            if len(prompt) + step > max_prompt_tokens:
                break
            prompt = prompt + random_tokens(rng, step, vocab)
            stream.append((prompt, f"task{t}", f"sys{k}/turn{s}"))
        streams.append(stream)
    order = interleave(streams, concurrency, seeded(seed, "agent-order"))
    return numbered_trace("coding-agent", order, vocab, max_tokens, params)


# ---- RAG over many documents -------------------------------------------------------------------
RAG_PASSAGES_PER_PROMPT = 10
RAG_PASSAGE_TOKENS = 100 * TOKENS_PER_WORD
RAG_QUESTION_TOKENS = 100.0
RAG_TOP_SHARE, RAG_TOP_RETRIEVALS = 0.03, 0.60


def zipf_weights(n: int, top_share: float, top_mass: float) -> list[float]:
    """Popularity of n items, rank^-s, with s such that the top `top_share` of the items
    take `top_mass` of it (bisection: that mass grows with s)."""

    def mass(s: float) -> float:
        w = [r**-s for r in range(1, n + 1)]
        return sum(w[: max(1, round(top_share * n))]) / sum(w)

    lo, hi = 0.0, 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mass(mid) < top_mass else (lo, mid)
    return [r**-lo for r in range(1, n + 1)]


def rag_plan(documents: int, requests: int, seed: int = 0) -> list[list[int]]:
    """Per request, the documents retrieved, in retrieval order (each drawn by
    popularity among those not drawn yet)."""
    weights = zipf_weights(documents, RAG_TOP_SHARE, RAG_TOP_RETRIEVALS)
    plan = []
    for q in range(requests):
        rng = seeded(seed, "rag", q)
        left = list(range(documents))
        picked = []
        for _ in range(min(RAG_PASSAGES_PER_PROMPT, documents)):
            i = rng.choices(range(len(left)), [weights[d] for d in left])[0]
            picked.append(left.pop(i))
        plan.append(picked)
    return plan


def rag_passages(
    documents: int = 400,
    requests: int = 96,
    system_tokens: int = 0,
    scale: float = 1.0,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """Prompt = system prompt + the retrieved passages + a question (module docstring)."""
    params = dict(locals())
    system = random_tokens(seeded(seed, "rag-sys"), system_tokens, vocab)
    passages = [
        random_tokens(seeded(seed, "passage", d), scaled(RAG_PASSAGE_TOKENS, scale), vocab)
        for d in range(documents)
    ]
    items = []
    for q, picked in enumerate(rag_plan(documents, requests, seed)):
        rng = seeded(seed, "rag-question", q)
        question = random_tokens(rng, scaled(exponential(rng, RAG_QUESTION_TOKENS), scale), vocab)
        prompt = system + [t for d in picked for t in passages[d]] + question
        items.append((prompt, f"doc{picked[0]}", f"q{q}"))
    return numbered_trace("rag", items, vocab, max_tokens, params)


# ---- mixtures ----------------------------------------------------------------------------------
def mixture(
    conversations: int = 12,
    mooncake_requests: int = 48,
    tasks: int = 2,
    rag_requests: int = 32,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """ShareGPT-like chat, Mooncake-like arrivals, coding agents and RAG at once: the
    families' requests interleaved in a seeded order, each family keeping its own."""
    params = dict(locals())
    parts = [
        sharegpt_chat(conversations, vocab=vocab, seed=seed),
        mooncake_like(mooncake_requests, vocab=vocab, seed=seed),
        coding_agent(tasks, vocab=vocab, seed=seed),
        rag_passages(requests=rag_requests, vocab=vocab, seed=seed),
    ]
    streams = [[(r.prompt, f"{part.name}/{r.session}", r.tag) for r in part] for part in parts]
    order = interleave(streams, len(streams), seeded(seed, "mixture-order"))
    return numbered_trace("mixture", order, vocab, max_tokens, params)


# ---- issue 29 ----------------------------------------------------------------------------------
def issue29(
    system_prompts: int = 3,
    system_tokens: int = 800,
    conversations: int = 18,
    turns: int = 4,
    user_tokens: int = 300,
    answer_tokens: int = 24,
    forks: int = 6,
    fork_after: int = 2,
    concurrency: int = 6,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """Issue 29's multi-turn + branching case (module docstring)."""
    params = dict(locals())
    systems = [
        random_tokens(seeded(seed, "issue29-sys", k), system_tokens, vocab)
        for k in range(system_prompts)
    ]
    forking = set(seeded(seed, "issue29-forks").sample(range(conversations), forks))
    streams = []
    for c in range(conversations):
        rng = seeded(seed, "issue29", c)
        k = c % system_prompts
        head = conversation(rng, systems[k], fork_after, user_tokens, answer_tokens, 0.0, vocab)
        stream = [(p, f"conv{c}", f"sys{k}/turn{t}") for t, p in enumerate(head)]
        fork = head[-1] + random_tokens(rng, answer_tokens, vocab)
        rest = turns - fork_after
        branches = [
            [
                (p, f"conv{c}", f"sys{k}/branch{b}/turn{fork_after + t}")
                for t, p in enumerate(
                    conversation(rng, fork, rest, user_tokens, answer_tokens, 0.0, vocab)
                )
            ]
            for b in range(2 if c in forking else 1)
        ]
        for step in zip(*branches, strict=True):  # branches side by side
            stream.extend(step)
        streams.append(stream)
    order = interleave(streams, concurrency, seeded(seed, "issue29-order"))
    return numbered_trace("issue29", order, vocab, max_tokens, params)
