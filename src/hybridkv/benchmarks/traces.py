"""Request traces to replay against an engine: seeded synthetic workloads and readers for
public trace formats (no engine import here; bench/hit_rate.py replays them).

A trace is a list of requests in arrival order, each a prompt of token ids. Synthetic
generators are deterministic for a given seed and parameters, in every process and on
every machine (seeds are strings hashed by `random.Random`, never Python's `hash`).

The model's answers are not known when a trace is made, so multi-turn workloads put a
fixed synthetic *answer* (seeded tokens) into the next turn's prompt in place of what the
model generated. Every system then sees the very same prompts, whatever it generates,
and a replay needs no per-session sequencing. The cost: an engine cannot reuse KV it
computed while decoding (the answer it generated is not the answer in the next prompt);
only prompt KV is reusable, which is what vLLM's offloading (`offload_prompt_only`) and
hybridkv's prompt-time stores keep anyway.

Generators:
  multi_turn_chat     sessions on a few shared system prompts; turn k+1 = turn k's
                      prompt + answer + new user tokens; a few sessions open at a time
  agentic_branching   a trunk of steps over a long shared history, then several branches
                      fork from the trunk's end and continue a few steps each
  document_qa         D documents, Q questions each, asked in rounds so a document comes
                      back after the others
Readers: Mooncake JSONL (`read_mooncake`; `mooncake_trace` turns records of that format
into a trace, for the synthetic Mooncake-like family too), ShareGPT JSON (`read_sharegpt`).
Workloads from published statistics, held out from tuning, are in `held_out`; every
family and its group (tuning or held-out) in `families`.
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Request:
    arrival: int  # position in the trace (replay order)
    prompt: list[int]
    max_tokens: int = 1
    timestamp: float | None = None  # seconds, where the source has one
    session: str | None = None  # conversation, agent tree, document...
    tag: str | None = None  # what the request is within its session


@dataclass
class Trace:
    name: str
    requests: list[Request]
    vocab: int
    params: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    def max_prompt(self) -> int:
        return max((len(r.prompt) for r in self.requests), default=0)

    def head(self, n: int) -> Trace:
        """The first n requests (a smaller replay of the same workload)."""
        return Trace(self.name, self.requests[:n], self.vocab, {**self.params, "head": n})

    def summary(self, block: int) -> dict[str, Any]:
        bounds = reuse_bound(self, block)
        total = self.prompt_tokens()
        return {
            "name": self.name,
            "requests": len(self),
            "prompt_tokens": total,
            "max_prompt_tokens": self.max_prompt(),
            "unique_blocks": len(_block_chains(self, block)),
            "block": block,
            "reusable_tokens": sum(bounds),
            "reuse_bound": sum(bounds) / total if total else 0.0,
        }

    # ---- files ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """JSON lines: a header {"trace", "vocab", "params"}, then one request a line."""
        with open(path, "w") as f:
            f.write(json.dumps({"trace": self.name, "vocab": self.vocab, "params": self.params}))
            f.write("\n")
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        with open(path) as f:
            head = json.loads(f.readline())
            reqs = [Request(**json.loads(line)) for line in f if line.strip()]
        return cls(head["trace"], reqs, head["vocab"], head.get("params", {}))


# ---- reuse analysis ---------------------------------------------------------------------------
def block_chain(prompt: list[int], block: int) -> list[bytes]:
    """Hash chain over the prompt's full blocks: entry i names tokens [0, (i+1)*block), so
    two prompts share entry i exactly when they share those tokens."""
    out, h = [], b""
    for i in range(len(prompt) // block):
        h = hashlib.blake2b(
            h + array("I", prompt[i * block : (i + 1) * block]).tobytes(), digest_size=16
        ).digest()
        out.append(h)
    return out


def _block_chains(trace: Trace, block: int) -> set[bytes]:
    return {h for r in trace for h in block_chain(r.prompt, block)}


def reuse_bound(trace: Trace, block: int) -> list[int]:
    """Per request, the prompt tokens an unbounded prefix cache of `block`-token blocks
    could serve: the full blocks it shares with any earlier prompt, short of the last
    token (an engine always computes at least one). A bound for every system, hybrid or
    not: a recurrent model also needs a state at that boundary."""
    seen: set[bytes] = set()
    out = []
    for r in trace:
        chain = block_chain(r.prompt, block)
        n = 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        out.append(min(n * block, (len(r.prompt) - 1) // block * block))
        seen.update(chain)
    return out


# ---- synthetic generators ---------------------------------------------------------------------
def seeded(seed: int, *parts: object) -> random.Random:
    """A generator for one named part of a workload: the same in every process (a string
    seed, never Python's `hash`), and independent of how many draws other parts made."""
    return random.Random("/".join(str(p) for p in (seed, *parts)))


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """`n` token ids in [1, vocab): distinct draws rarely share a chunk by chance."""
    return [rng.randrange(1, vocab) for _ in range(n)]


def _length(rng: random.Random, mean: int, jitter: float) -> int:
    lo, hi = round(mean * (1 - jitter)), round(mean * (1 + jitter))
    return max(1, rng.randint(lo, hi))


def conversation(
    rng: random.Random, prompt: list[int], n: int, new: int, answer: int, jitter: float, vocab: int
) -> list[list[int]]:
    """`n` prompts of one conversation: the first is `prompt` + about `new` tokens, each
    next one the previous + a synthetic answer of about `answer` tokens + `new` more."""
    out = []
    for i in range(n):
        if i:
            prompt = prompt + random_tokens(rng, _length(rng, answer, jitter), vocab)
        prompt = prompt + random_tokens(rng, _length(rng, new, jitter), vocab)
        out.append(prompt)
    return out


def interleave(streams: list[list[Any]], concurrency: int, rng: random.Random) -> list[Any]:
    """Merge streams in a seeded random order keeping each stream's own order: at most
    `concurrency` streams are open at a time, the next one opens when one ends."""
    pending = list(range(len(streams)))[::-1]
    open_: list[int] = []
    pos = [0] * len(streams)
    out = []
    while pending or open_:
        while pending and len(open_) < concurrency:
            open_.append(pending.pop())
        s = rng.choice(open_)
        out.append(streams[s][pos[s]])
        pos[s] += 1
        if pos[s] == len(streams[s]):
            open_.remove(s)
    return out


def numbered_trace(
    name: str, items: list[tuple[list[int], str, str]], vocab: int, max_tokens: int, params: dict
) -> Trace:
    """A trace of (prompt, session, tag) items in the order given."""
    reqs = [
        Request(i, prompt, max_tokens, None, session, tag)
        for i, (prompt, session, tag) in enumerate(items)
    ]
    return Trace(name, reqs, vocab, params)


def multi_turn_chat(
    sessions: int = 16,
    turns: int = 6,
    system_prompts: int = 3,
    system_tokens: int = 1024,
    user_tokens: int = 200,
    answer_tokens: int = 150,
    concurrency: int = 6,
    jitter: float = 0.5,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """Chat sessions, each on one of `system_prompts` shared system prompts: turn 1 is
    system + user tokens, turn k+1 is turn k's prompt + a synthetic answer + new user
    tokens. User and answer lengths vary by +-`jitter`."""
    params = {k: v for k, v in locals().items()}
    systems = [
        random_tokens(seeded(seed, "sys", i), system_tokens, vocab) for i in range(system_prompts)
    ]
    streams = []
    for s in range(sessions):
        rng = seeded(seed, "chat", s)
        k = rng.randrange(system_prompts)
        prompts = conversation(rng, systems[k], turns, user_tokens, answer_tokens, jitter, vocab)
        streams.append([(p, f"chat{s}", f"sys{k}/turn{t}") for t, p in enumerate(prompts)])
    order = interleave(streams, concurrency, seeded(seed, "chat-order"))
    return numbered_trace("chat", order, vocab, max_tokens, params)


def agentic_branching(
    trees: int = 4,
    system_tokens: int = 512,
    history_tokens: int = 1024,
    trunk_steps: int = 3,
    branches: int = 4,
    branch_steps: int = 3,
    step_tokens: int = 160,
    answer_tokens: int = 96,
    concurrency: int = 2,
    jitter: float = 0.5,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """Agent trees on one shared system prompt. Each tree: a history (task), then
    `trunk_steps` steps (each = previous prompt + answer + step tokens), then `branches`
    continuations fork from the trunk's last prompt + answer and run `branch_steps`
    steps each, the branches taking turns. `concurrency` trees are open at a time."""
    params = {k: v for k, v in locals().items()}
    system = random_tokens(seeded(seed, "agent-sys"), system_tokens, vocab)
    streams = []
    for t in range(trees):
        rng = seeded(seed, "tree", t)
        history = system + random_tokens(rng, history_tokens, vocab)
        trunk = conversation(rng, history, trunk_steps, step_tokens, answer_tokens, jitter, vocab)
        tree = [(p, f"tree{t}", f"trunk/step{s}") for s, p in enumerate(trunk)]
        fork = trunk[-1] + random_tokens(rng, _length(rng, answer_tokens, jitter), vocab)
        paths = []
        for b in range(branches):
            brng = seeded(seed, "tree", t, "branch", b)
            steps = conversation(
                brng, fork, branch_steps, step_tokens, answer_tokens, jitter, vocab
            )
            paths.append([(p, f"tree{t}", f"branch{b}/step{s}") for s, p in enumerate(steps)])
        for s in range(branch_steps):  # branches explored side by side
            tree.extend(path[s] for path in paths)
        streams.append(tree)
    order = interleave(streams, concurrency, seeded(seed, "agent-order"))
    return numbered_trace("agentic", order, vocab, max_tokens, params)


def document_qa(
    documents: int = 8,
    doc_tokens: int = 2500,
    questions: int = 4,
    question_tokens: int = 48,
    system_tokens: int = 256,
    jitter: float = 0.2,
    vocab: int = 2048,
    max_tokens: int = 1,
    seed: int = 0,
) -> Trace:
    """Questions over long documents: prompt = shared system prompt + document +
    question. Asked in `questions` rounds, each round every document once in a seeded
    order, so a document comes back after the others."""
    params = {k: v for k, v in locals().items()}
    system = random_tokens(seeded(seed, "doc-sys"), system_tokens, vocab)
    docs = []
    for d in range(documents):
        rng = seeded(seed, "doc", d)
        docs.append(random_tokens(rng, _length(rng, doc_tokens, jitter), vocab))
    items = []
    for q in range(questions):
        order = list(range(documents))
        seeded(seed, "doc-round", q).shuffle(order)
        for d in order:
            rng = seeded(seed, "question", d, q)
            question = random_tokens(rng, _length(rng, question_tokens, 0.5), vocab)
            items.append((system + docs[d] + question, f"doc{d}", f"q{q}"))
    return numbered_trace("docqa", items, vocab, max_tokens, params)


SYNTHETIC = {"chat": multi_turn_chat, "agentic": agentic_branching, "docqa": document_qa}


# ---- readers ----------------------------------------------------------------------------------
def read_mooncake(
    path: str | Path,
    *,
    block_size: int = 512,
    tokens_per_block: int | None = None,
    vocab: int = 2048,
    limit: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
) -> Trace:
    """Mooncake's JSONL (`{"timestamp", "input_length", "output_length", "hash_ids"}`
    a line; timestamps in ms), read as `mooncake_trace` reads records."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return mooncake_trace(
        records,
        f"mooncake-{Path(path).stem}",
        block_size=block_size,
        tokens_per_block=tokens_per_block,
        vocab=vocab,
        limit=limit,
        max_tokens=max_tokens,
        seed=seed,
        params={"path": str(path)},
    )


def mooncake_trace(
    records: list[dict[str, Any]],
    name: str,
    *,
    block_size: int = 512,
    tokens_per_block: int | None = None,
    vocab: int = 2048,
    limit: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    params: dict[str, Any] | None = None,
) -> Trace:
    """Requests from Mooncake-format records: every hash id stands for one
    `block_size`-token block, the same id the same tokens (seeded by the id), so shared
    ids are shared prefixes. `tokens_per_block` < `block_size` scales the whole trace down
    for small models (lengths scaled by the same ratio). `max_tokens` overrides the output
    lengths; `limit` keeps the first requests."""
    tpb = tokens_per_block or block_size
    blocks: dict[int, list[int]] = {}
    reqs: list[Request] = []
    for rec in records:
        if limit is not None and len(reqs) >= limit:
            break
        ids = [int(h) for h in rec["hash_ids"]]
        if not ids:
            continue
        for h in ids:
            if h not in blocks:
                blocks[h] = random_tokens(seeded(seed, "mooncake", h), tpb, vocab)
        n = -(-int(rec["input_length"]) * tpb // block_size)
        n = min(max(n, (len(ids) - 1) * tpb + 1), len(ids) * tpb)
        prompt = [t for h in ids for t in blocks[h]][:n]
        out = max_tokens if max_tokens is not None else int(rec.get("output_length", 1))
        ts = rec.get("timestamp")
        timestamp = None if ts is None else ts / 1e3
        reqs.append(Request(len(reqs), prompt, max(out, 1), timestamp, rec.get("session"), None))
    params = {**(params or {}), "block_size": block_size, "tokens_per_block": tpb, "seed": seed}
    return Trace(name, reqs, vocab, params)


_USER = {"human", "user"}
_ANSWER = {"gpt", "assistant", "chatgpt", "bard", "model", "bing"}


def word_token(word: str, vocab: int) -> int:
    """A whitespace word's token id in [1, vocab): the same word, the same id, anywhere."""
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (vocab - 1)


def read_sharegpt(
    path: str | Path,
    *,
    vocab: int = 2048,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    max_tokens: int | None = None,
    concurrency: int | None = 8,
    seed: int = 0,
) -> Trace:
    """ShareGPT-style JSON (`[{"conversations": [{"from": "human", "value": ...}, ...]}]`):
    one request per user turn, its prompt every earlier turn of the conversation (system,
    user and answer) plus the new user turn, words hashed to ids (`word_token`). Max tokens
    is the next answer's length unless `max_tokens` is given. A conversation stops before
    the first prompt longer than `max_prompt_tokens`. Conversations are interleaved as in
    `multi_turn_chat` (`concurrency` open at a time; None: one after the other); `limit`
    counts conversations."""
    data = json.loads(Path(path).read_text())
    streams = []
    for c, conv in enumerate(data[:limit] if limit is not None else data):
        turns = conv.get("conversations") or conv.get("messages") or []
        sid = str(conv.get("id", c))
        context: list[int] = []
        stream = []
        for i, turn in enumerate(turns):
            role = str(turn.get("from", turn.get("role", ""))).lower()
            toks = [
                word_token(w, vocab)
                for w in str(turn.get("value", turn.get("content", ""))).split()
            ]
            if role in _USER:
                prompt = context + toks
                if not prompt or (
                    max_prompt_tokens is not None and len(prompt) > max_prompt_tokens
                ):
                    break
                nxt = turns[i + 1] if i + 1 < len(turns) else None
                answer = len(str(nxt.get("value", nxt.get("content", ""))).split()) if nxt else 1
                stream.append((prompt, sid, f"turn{len(stream)}", max_tokens or max(answer, 1)))
            context = context + toks
        if stream:
            streams.append(stream)
    order = interleave(streams, concurrency or 1, seeded(seed, "sharegpt-order"))
    reqs = [Request(i, p, mt, None, s, t) for i, (p, s, t, mt) in enumerate(order)]
    return Trace(f"sharegpt-{Path(path).stem}", reqs, vocab, {"path": str(path), "seed": seed})


def with_max_tokens(trace: Trace, max_tokens: int) -> Trace:
    """Every request capped at `max_tokens` output tokens (replays keep them short)."""
    reqs = [replace(r, max_tokens=min(r.max_tokens, max_tokens)) for r in trace]
    return Trace(trace.name, reqs, trace.vocab, trace.params)
