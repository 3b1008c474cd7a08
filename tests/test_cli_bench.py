"""`hybridkv bench ttft | restart | hit-rate --quick` end to end on the tiny model, as
`python -m hybridkv.cli` forked from the suite's zygote (conftest.run_cli; the installed
script itself where a test checks its errors): each writes a JSON whose figures agree
with what must have happened (restores hit what vLLM's own prefix cache hits, cold runs
hit nothing), and a PNG plot beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

HYBRIDKV = str(Path(sys.executable).with_name("hybridkv"))


def bench(*args: str) -> subprocess.CompletedProcess:
    proc = run_cli("bench", *args)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc


def check_png(path: Path) -> None:
    """A real PNG of the figure's size (6.4 x 4 in at 110 dpi), not an empty file."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (704, 440)


def test_bench_ttft_quick_restores_from_cpu_disk_and_after_a_restart(model_dirs, tmp_path):
    out = tmp_path / "ttft.json"
    model = model_dirs["qwen3-next"]
    proc = bench("ttft", "--quick", "--restart", "--model", model, "--json", str(out))
    result = json.loads(out.read_text())
    figures = result["figures"]
    assert list(figures) == [
        "cold", "native", "cpu", "disk", "restart", "restart native", "recompute"
    ]  # fmt: skip
    native = figures["native"]["hit_tokens"]
    assert native > 0
    assert figures["cold"]["hit_tokens"] == figures["recompute"]["hit_tokens"] == 0
    for mode in ("cpu", "disk", "restart"):
        assert figures[mode]["hit_tokens"] == native
        assert figures[mode]["loaded_bytes"] > 0
        assert figures[mode]["ttft_p90_s"] >= figures[mode]["ttft_p50_s"] > 0
    # vLLM's own hits: hybridkv loads nothing for them.
    assert figures["native"]["loaded_bytes"] == figures["restart native"]["loaded_bytes"] == 0
    assert figures["native"]["x_native"] == figures["restart native"]["x_native"] == 1.0
    # The restarted engine held nothing in memory: its first sight of every prompt came
    # from the disk the first engine wrote.
    assert all(h == native for h in result["phases"]["restart"]["modes"]["restart"]["hit"])
    assert "restart: hybridkv" in proc.stdout
    # The summary's ratios, printed rather than divided by hand.
    cold = figures["cold"]["ttft_p50_s"]
    assert f"cold / restored p50: cpu {cold / figures['cpu']['ttft_p50_s']:.1f}x" in proc.stdout
    assert "every attention layer over the" in proc.stdout
    check_png(out.with_suffix(".png"))


def test_bench_hit_rate_quick(model_dirs, tmp_path):
    proc = bench(
        "hit-rate",
        "--quick",
        "--model",
        model_dirs["qwen3-next"],
        "--system",
        "hybridkv",
        "--budget-mib",
        "8",
        "--out-dir",
        str(tmp_path),
    )
    result = json.loads((tmp_path / "hit_rate-quick.json").read_text())
    (run,) = result["runs"]
    f = run["figures"]
    assert f["system"] == "hybridkv" and f["budget_bytes"] == 8 << 20
    # The engine's own cache is too small to keep the chat's turns: hybridkv serves
    # what vLLM's prefix cache no longer holds.
    assert f["connector_hit_rate"] > 0 and f["loaded_bytes"] > 0
    assert f["token_hit_rate"] == pytest.approx(f["local_hit_rate"] + f["connector_hit_rate"])
    assert f["faults"] == 0  # no hit counted here was a failed load recomputed
    # The oracle bounds what a real engine hit, replayed in order.
    assert run["raw"]["in_order"] and f["token_hit_rate"] <= f["oracle_hit_rate"]
    assert f["of_oracle"] == pytest.approx(f["token_hit_rate"] / f["oracle_hit_rate"])
    assert result["group"] == "tuning"
    assert "hit_rate-quick.png" in proc.stdout
    check_png(tmp_path / "hit_rate-quick.png")


def test_bench_hit_rate_replays_requests_concurrently(model_dirs, tmp_path):
    """`--in-flight 3`: requests share the engine's steps, every one is answered and
    counted, and the held-out trace is summarized in its group."""
    trace = "issue29:conversations=4,forks=2,concurrency=4"
    bench(
        "hit-rate",
        "--model",
        model_dirs["qwen3-next"],
        "--trace",
        trace,
        "--system",
        "none",
        "--kv-cache-mib",
        "5",
        "--in-flight",
        "3",
        "--out-dir",
        str(tmp_path),
    )
    result = json.loads((tmp_path / "hit_rate-issue29.json").read_text())
    (run,) = result["runs"]
    raw = run["raw"]
    assert result["in_flight"] == raw["in_flight"] == 3 and result["group"] == "held-out"
    assert len(raw["rows"]) == result["trace"]["requests"] == 4 * 4 + 2 * 2
    assert all(row[0] > 0 and 0 <= row[1] < row[0] and row[4] > 0 for row in raw["rows"])
    steps = raw["first_step"]
    assert len(set(steps)) < len(steps)  # some requests were scheduled in the same step
    summary = json.loads((tmp_path / "hit_rate-summary.json").read_text())
    assert "none 0 MiB" in summary["groups"]["held-out"]


@pytest.mark.parametrize(
    ("option", "value", "shown"),
    [
        ("--system", "lmcache", "lmcache"),
        ("--hybridkv-extra", "notjson", "notjson"),
        ("--hybridkv-extra", '{"cpu_byts": "1GiB"}', "cpu_byts"),
        ("--trace", "chta", "chta"),
        ("--trace", "mooncake:/nonexistent/trace.jsonl", "/nonexistent"),
        ("--budget-mib", "-4", "-4"),
        ("--in-flight", "0", "0"),
    ],
)
def test_bench_rejects_a_bad_option_naming_it(tmp_path, option, value, shown):
    """At once, before any engine runs (a misspelt trace or setting failed minutes in,
    or only when its turn came), with the option named and no traceback."""
    proc = subprocess.run(
        [HYBRIDKV, "bench", "hit-rate", option, value, "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    said = "".join(proc.stderr.split())  # rich wraps the message in a box
    assert "".join(shown.split()) in said and option in said, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_hit_rate_reuses_only_comparable_runs_of_other_systems(tmp_path):
    from hybridkv.benchmarks.hit_rate import reuse

    def result(kv: int, *systems: str) -> dict:
        runs = [{"figures": {"system": s}} for s in systems]
        return {"trace_params": {"seed": 0}, "kv_cache_bytes": kv, "runs": runs}

    earlier = tmp_path / "hit_rate-chat.json"
    earlier.write_text(json.dumps(result(4, "hybridkv@old", "vllm-offload", "none")))
    now = result(4, "hybridkv")
    reuse(now, earlier)
    assert [r["figures"]["system"] for r in now["runs"]] == ["hybridkv", "vllm-offload", "none"]
    assert now["reused"]["systems"] == ["none", "vllm-offload"]
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        reuse(result(8, "hybridkv"), earlier)
    with pytest.raises(ValueError, match="vllm_version"):
        reuse({**result(4, "hybridkv"), "vllm_version": "0.33.0"}, earlier)
    # A directory that is not there fails before any engine runs.
    from hybridkv.benchmarks.hit_rate import HitRateSettings

    with pytest.raises(ValueError, match="reuse_runs"):
        HitRateSettings(reuse_runs=tmp_path / "missing")


def test_engine_processes_take_no_hybridkv_settings_from_the_shell(tmp_path, monkeypatch):
    """A `HYBRIDKV_DISK_PATH` left in the shell would give the hybridkv runs of a
    benchmark a disk tier beyond the budget the others get; only HYBRIDKV_HOME (where
    models are) reaches the engine processes."""
    from hybridkv.benchmarks.figures import engine_process

    (tmp_path / "show_env.py").write_text(
        "import json, os\n"
        "names = sorted(k for k in os.environ if k.startswith('HYBRIDKV_'))\n"
        "print('RESULT ' + json.dumps(names))\n"
    )
    monkeypatch.setenv("HYBRIDKV_DISK_PATH", str(tmp_path / "disk"))
    monkeypatch.setenv("HYBRIDKV_CPU_BYTES", "1GiB")
    monkeypatch.setenv("HYBRIDKV_HOME", str(tmp_path / "home"))
    names = engine_process("show_env", {}, "env", pythonpath=tmp_path)
    assert names == ["HYBRIDKV_HOME"]


def test_hit_rate_table_divides_unrounded_shares_and_flags_faults():
    """The ratio to vLLM's connector comes from the unrounded shares (agentic at 3 MiB
    was once divided by hand from 0.026 / 0.017); a run with failed loads is flagged:
    vLLM's prefill stats count a recomputed hit as one."""
    from hybridkv.benchmarks.hit_rate import table

    def run(system: str, conn: float, faults: int | None) -> dict:
        figures = {
            "system": system,
            "budget_bytes": 3 << 20,
            "token_hit_rate": 0.6,
            "local_hit_rate": 0.6 - conn,
            "connector_hit_rate": conn,
            "requests_with_hit": 1,
            "requests": 2,
            "ttft_p50_s": 0.1,
            "ttft_p90_s": 0.2,
            "stored_bytes": None,
            "loaded_bytes": None,
            "faults": faults,
        }
        return {"figures": figures}

    trace = {"name": "agentic", "requests": 2, "prompt_tokens": 10, "reuse_bound": 0.8}
    result = {
        "trace": {**trace, "block": 256},
        "runs": [run("hybridkv", 0.02649, 2), run("vllm-offload", 0.01651, None)],
    }
    out = table(result)
    assert "connector share at 3 MiB: hybridkv 1.60x vllm-offload's" in out
    assert "WARNING: hybridkv at 3 MiB had 2 failed loads" in out
    assert "vllm-offload at 3 MiB had" not in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
