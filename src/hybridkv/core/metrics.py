"""Metrics without an engine: what a report holds, how reports merge, and counters that
never go negative.

hybridkv counts in several processes (the scheduler side, and one worker per
tensor-parallel rank), each with its own cumulative counters (`SchedulerStats`,
`WorkerStats`, each tier's `TierStats`). What goes to a metrics backend is a *report*:
the increase of those counters since the previous report, the current gauge values, and
the latency observations made meanwhile. Reports from every rank and from the scheduler
side merge into one (`merge`), as do reports of consecutive steps, so whoever exports
them (vLLM's Prometheus logger, or hybridkv's own `metrics_port` server) sees one figure
per metric and tier.

A report is plain data (string keys, numbers, lists) so that any of vLLM's serializers
carries it between processes unchanged::

    {"counters":   {name: {tier: increase}},
     "gauges":     {name: {source: {tier: value}}},
     "histograms": {name: {tier: [observation, ...]}}}

Gauges are kept per *source* (`"scheduler"`, `"rank0"`, ...): ranks report a gauge only
when it changed, so whoever reduces them (`gauge_values`) must remember each source's
last value; two reports of one source keep the newer.

A counter increment is never negative (`clamp`): Prometheus raises on one, which once
crashed a metrics logger under concurrency. A total that goes back is logged and not
counted, and the highest total stays the mark: nothing resets hybridkv's counters, so a
lower one is a reading that failed (a tier's `stats` answering zeros after a fault), and
re-basing on it would count the whole history again at the next good reading.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

Report = dict[str, Any]
ByTier = dict[str, float]
# What a side hands its Reporter: {name: {tier: cumulative total or gauge value}}, and
# {histogram: {tier: [observation, ...]}}.
Figures = dict[str, dict[str, int]]
Observations = dict[str, dict[str, list[float]]]

# How a gauge's values from several sources combine: bytes and entries add up over
# ranks; a tier is up only if it is up on every rank.
_GAUGE_REDUCE: dict[str, Callable[[Iterable[float]], float]] = {"tier_up": min}

_warned: set[str] = set()


def clamp(what: str, increase: float) -> float:
    """`increase`, or 0 with a warning if it is negative or not a number (`what` names
    the counter in the log: first time at warning level, then at debug)."""
    if increase >= 0:  # False for NaN too
        return increase
    level = logging.DEBUG if what in _warned else logging.WARNING
    _warned.add(what)
    log.log(level, "hybridkv: counter %s went back by %r; counted as 0", what, -increase)
    return 0


def empty() -> Report:
    return {"counters": {}, "gauges": {}, "histograms": {}}


def is_empty(report: Mapping[str, Any]) -> bool:
    return not any(report.get(part) for part in ("counters", "gauges", "histograms"))


def merge(into: Report, other: Mapping[str, Any]) -> Report:
    """Add `other` to `into` (changed in place and returned): counters summed, histogram
    observations joined, gauges of each source taken from `other` (the newer)."""
    for name, by_tier in other.get("counters", {}).items():
        mine = into["counters"].setdefault(name, {})
        for tier, inc in by_tier.items():
            mine[tier] = mine.get(tier, 0) + clamp(f"{name}[{tier}]", inc)
    for name, by_source in other.get("gauges", {}).items():
        mine = into["gauges"].setdefault(name, {})
        for source, by_tier in by_source.items():
            mine.setdefault(source, {}).update(by_tier)
    for name, by_tier in other.get("histograms", {}).items():
        mine = into["histograms"].setdefault(name, {})
        for tier, values in by_tier.items():
            mine.setdefault(tier, []).extend(values)
    return into


def reduce_gauge(name: str, values: Iterable[float]) -> float:
    """One figure from several sources' values of gauge `name`."""
    return _GAUGE_REDUCE.get(name, sum)(values)


def gauge_values(gauges: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, ByTier]:
    """{name: {tier: value}}, each reduced over the sources that report it."""
    out: dict[str, ByTier] = {}
    for name, by_source in gauges.items():
        tiers: dict[str, list[float]] = {}
        for by_tier in by_source.values():
            for tier, value in by_tier.items():
                tiers.setdefault(tier, []).append(value)
        out[name] = {tier: reduce_gauge(name, vs) for tier, vs in tiers.items()}
    return out


def summary(report: Mapping[str, Any]) -> dict[str, float]:
    """A flat summary for a log line: `name[tier]` for counters and gauges, and each
    histogram's count and mean."""
    out: dict[str, float] = {}
    for name, by_tier in report.get("counters", {}).items():
        out.update({f"{name}[{tier}]": v for tier, v in by_tier.items()})
    for name, by_tier in gauge_values(report.get("gauges", {})).items():
        out.update({f"{name}[{tier}]": v for tier, v in by_tier.items()})
    for name, by_tier in report.get("histograms", {}).items():
        for tier, values in by_tier.items():
            out[f"{name}[{tier}].count"] = len(values)
            out[f"{name}[{tier}].mean"] = math.fsum(values) / len(values) if values else 0.0
    return out


class GaugeBook:
    """Every source's latest gauges, kept where all reports meet (the engine core's
    scheduler side), so that a report carries all of them whenever one changed: vLLM
    hands a step's stats to one of its front ends only (`--api-server-count` > 1), and
    a front end that missed another rank's change would sum a stale or missing value."""

    def __init__(self) -> None:
        self._book: Report = empty()

    def complete(self, report: Report, *seen: Report | None) -> Report:
        """`report` (changed in place and returned) with every source's latest gauges if
        it or one of the reports `seen` with it changed any."""
        changed = False
        for r in (*seen, report):
            if r is not None and r.get("gauges"):
                merge(self._book, {"gauges": r["gauges"]})
                changed = True
        if changed:
            report["gauges"] = {
                name: {source: dict(by_tier) for source, by_tier in by_source.items()}
                for name, by_source in self._book["gauges"].items()
            }
        return report


class Reporter:
    """Turns one source's cumulative counters into reports: the increase since the last
    report, and the gauges that changed since then."""

    def __init__(self, source: str):
        self.source = source
        self._totals: dict[tuple[str, str], float] = {}
        self._gauges: dict[tuple[str, str], float] = {}

    def report(
        self,
        totals: Mapping[str, Mapping[str, float]],
        gauges: Mapping[str, Mapping[str, float]] | None = None,
        observations: Mapping[str, Mapping[str, list[float]]] | None = None,
    ) -> Report:
        """A report of what changed since the previous call; `is_empty` if nothing did.
        A total below the highest so far counts nothing (`clamp` logs it)."""
        out = empty()
        for name, by_tier in totals.items():
            for tier, total in by_tier.items():
                last = self._totals.get((name, tier), 0)
                self._totals[name, tier] = max(last, total)
                inc = clamp(f"{name}[{tier}]", total - last)
                if inc:
                    out["counters"].setdefault(name, {})[tier] = inc
        for name, by_tier in (gauges or {}).items():
            for tier, value in by_tier.items():
                if self._gauges.get((name, tier)) != value:
                    self._gauges[name, tier] = value
                    out["gauges"].setdefault(name, {}).setdefault(self.source, {})[tier] = value
        for name, by_tier in (observations or {}).items():
            for tier, values in by_tier.items():
                if values:
                    out["histograms"].setdefault(name, {})[tier] = list(values)
        return out
