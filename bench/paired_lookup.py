"""bench/lookup.py's serving stream, "before" and "after" in one process, their steps
interleaved, so that both see the same machine.

Why: on the 2-vCPU VM the speed of one run drifts by up to 1.5x within minutes, and two
runs side by side on its two cores by as much (docs/benchmarks.md), which buries a change
of 10 % either way. Here the "before" source tree is copied under another package name
(`hybridkv_before`, its imports rewritten), both streams are built and filled, then each
timed step of one is followed by the same step of the other (alternating which goes
first). The streams are the same seeded serving stream, so both make the same decisions
unless the change altered them (the evictions and hit tokens printed say). A step a
garbage collection fell in is counted, and the longest step without one printed apart:
at a million entries each the first full collection after the fills walks two streams'
objects, and which stream's step it lands in says nothing about the change.

    .venv/bin/python bench/paired_lookup.py --before /tmp/base/src --entries 100000

`--events-cost`: no "before"; this tree's stream with vLLM's KV cache events off against
the same stream with them on (what turning them on costs a step).
"""

from __future__ import annotations

import argparse
import gc
import re
import shutil
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def before_tree(src: Path, into: Path) -> None:
    """`src`/hybridkv and its bench/lookup.py copied into `into` as `hybridkv_before` and
    `lookup_before`, every import of hybridkv rewritten."""
    shutil.copytree(src / "hybridkv", into / "hybridkv_before")
    # A fresh worktree has no native parts built: this tree's, where their sources match.
    for built in (BENCH.parent / "src" / "hybridkv").glob("_*.so"):
        name = built.name.split(".")[0]
        copied = into / "hybridkv_before"
        if (copied / f"{name}.c").exists() and not list(copied.glob(f"{name}.*.so")):
            if (copied / f"{name}.c").read_bytes() != (built.parent / f"{name}.c").read_bytes():
                raise SystemExit(f"{name}.c differs in --before: build it there first")
            shutil.copy(built, copied)
    shutil.copy(src.parent / "bench" / "lookup.py", into / "lookup_before.py")
    pattern = re.compile(r"\bhybridkv(?=[. ])")
    for path in [*(into / "hybridkv_before").rglob("*.py"), into / "lookup_before.py"]:
        path.write_text(pattern.sub("hybridkv_before", path.read_text()))


def percentiles(times: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max, in ms."""
    times = sorted(times)
    return times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3, times[-1] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="the src directory of 'before'")
    p.add_argument("--entries", type=int, default=100000)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--events", action="store_true", help="both with vLLM's KV cache events on")
    p.add_argument(
        "--events-cost", action="store_true", help="events off against on, both this tree"
    )
    args = p.parse_args()
    if (args.before is None) != args.events_cost:
        p.error("give --before or --events-cost (one of them)")
    with tempfile.TemporaryDirectory() as tmp:
        sys.path[:0] = [tmp, str(BENCH)]
        import lookup

        if args.events_cost:
            streams = {
                "off": lookup.Serving(args.entries),
                "on": lookup.Serving(args.entries, events=True),
            }
        else:
            before_tree(args.before.resolve(), Path(tmp))
            import lookup_before

            streams = {
                "before": lookup_before.Serving(args.entries, events=args.events),
                "after": lookup.Serving(args.entries, events=args.events),
            }
        gc.collect()
        gc.freeze()  # as bench/lookup.py does: what start-up allocated is not walked
        for stream in streams.values():
            index = stream.side.index
            while index.gauges()["cpu_bytes"] < 0.99 * index.capacity:
                stream.step()
        hits = {name: s.hit_tokens for name, s in streams.items()}
        steps: dict[str, list[float]] = {name: [] for name in streams}
        without: dict[str, list[float]] = {name: [] for name in streams}
        uncollected: dict[str, list[float]] = {name: [] for name in streams}
        collections = [0]

        def count(phase: str, info: dict) -> None:
            collections[0] += phase == "stop"

        gc.callbacks.append(count)
        names = list(streams)
        for i in range(args.steps):
            for name in names if i % 2 else names[::-1]:
                before = collections[0]
                secs, hashing = streams[name].step()
                steps[name].append(secs)
                without[name].append(secs - hashing)
                if collections[0] == before:
                    uncollected[name].append(secs)
        gc.callbacks.remove(count)
    events = ", KV cache events on" if args.events else ""
    events = ", KV cache events off and on" if args.events_cost else events
    first, second = names
    print(f"{args.entries} entries, {args.steps} steps each, interleaved{events}")
    for name, stream in streams.items():
        evictions = stream.side.index.stats.cpu_evictions
        hit = (stream.hit_tokens - hits[name]) / args.steps
        print(f"  {name:7} evictions {evictions}, hit tokens per step {hit:.1f}")
    for label, times in (("step", steps), ("step without chain keys", without)):
        b, a = percentiles(times[first]), percentiles(times[second])
        shown = "  ".join(
            f"{q} {x:.3f} -> {y:.3f} ms ({y / x:.2f})"
            for q, x, y in zip(("p50", "p99", "max"), b, a, strict=True)
        )
        print(f"  {label:24} {shown}")
    fell = {name: args.steps - len(times) for name, times in uncollected.items()}
    longest = {name: max(times, default=0.0) * 1e3 for name, times in uncollected.items()}
    print(
        f"  steps a collection fell in: {first} {fell[first]}, {second} {fell[second]}; "
        f"max of the others {longest[first]:.3f} -> {longest[second]:.3f} ms"
    )


if __name__ == "__main__":
    main()
