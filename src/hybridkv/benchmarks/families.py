"""Every trace family the hit-rate bench replays, marked `tuning` or `held-out`.

`tuning`: the three synthetic workloads (chat, agentic, docqa) the eviction policy's
thresholds were chosen on (docs/benchmarks.md, "Hit rate at equal CPU bytes"); a policy's
figures there may be fitted to them. `held-out`: families the policy was not tuned on,
from published workload statistics (`held_out`), and traces read from a user's file
(Mooncake JSONL, ShareGPT JSON). The bench reports the two groups separately, so a
change that only helps the tuning group shows as such.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridkv.benchmarks import held_out
from hybridkv.benchmarks.traces import SYNTHETIC, Trace, read_mooncake, read_sharegpt

TUNING = "tuning"
HELD_OUT = "held-out"


@dataclass(frozen=True)
class Family:
    make: Callable[..., Trace]
    group: str


FAMILIES: dict[str, Family] = {
    **{name: Family(make, TUNING) for name, make in SYNTHETIC.items()},
    "sharegpt-like": Family(held_out.sharegpt_chat, HELD_OUT),
    "mooncake-like": Family(held_out.mooncake_like, HELD_OUT),
    "coding-agent": Family(held_out.coding_agent, HELD_OUT),
    "rag": Family(held_out.rag_passages, HELD_OUT),
    "mixture": Family(held_out.mixture, HELD_OUT),
    "issue29": Family(held_out.issue29, HELD_OUT),
}


def make_trace(spec: str, vocab: int = 2048, **overrides: Any) -> Trace:
    """A trace from a short spec: a family's name (optionally `name:key=value,...` for
    its generator's parameters), `mooncake:PATH[:TOKENS_PER_BLOCK]`, `sharegpt:PATH` or
    `file:PATH` (a trace saved by `Trace.save`). Its group is in `params["group"]`."""
    check_trace_spec(spec)
    kind, _, rest = spec.partition(":")
    if kind in FAMILIES:
        kwargs: dict[str, Any] = {"vocab": vocab, **overrides}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            kwargs[key] = float(value) if "." in value else int(value)
        trace = FAMILIES[kind].make(**kwargs)
        group = FAMILIES[kind].group
    elif kind == "mooncake":
        file, _, tpb = rest.partition(":")
        tokens = int(tpb) if tpb else None
        trace = read_mooncake(file, vocab=vocab, tokens_per_block=tokens, **overrides)
        group = HELD_OUT
    elif kind == "sharegpt":
        trace, group = read_sharegpt(rest, vocab=vocab, **overrides), HELD_OUT
    else:  # file:
        trace = Trace.load(rest)
        group = trace.params.get("group", HELD_OUT)
    trace.params["group"] = group
    return trace


def check_trace_spec(spec: str) -> None:
    """Raise a ValueError naming `trace` unless `spec` names a family or an existing
    file of a trace format: checked before a run starts, not when its turn comes."""
    kind, _, rest = spec.partition(":")
    if kind in FAMILIES:
        return
    if kind not in ("mooncake", "sharegpt", "file"):
        raise ValueError(
            f"trace: expected one of {', '.join(FAMILIES)}, mooncake:, sharegpt: or file:,"
            f" got {spec!r}"
        )
    path = rest.partition(":")[0] if kind == "mooncake" else rest
    if not os.path.exists(path) or os.path.isdir(path):  # a pipe or <(zcat ...) reads too
        raise ValueError(f"trace: {spec!r} names no file ({path!r})")
