"""The disk tier under real vLLM engines: restarts, damage, faults, capacity, sharing.

Restart and sharing tests run each engine in a new Python process (tests/engine_proc.py):
what one process stored must be hit by another, with output identical to vLLM's own
prefix hit. Damage tests run in this process so they can reach the files and counters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import SEED, EngineProc, reference_salt, run_engine_proc, tokens
from serving import last_boundary, real_difference

from hybridkv.core.keys import chain_seed, chunk_keys, group_key
from hybridkv.core.layout import GroupKind
from hybridkv.core.tiers.entry_file import HEADER_BYTES, write_entry
from hybridkv.engine import (
    drop_cpu_tier,
    generate,
    make_llm,
    scheduler_connector,
    shutdown,
    worker_connector,
)

pytestmark = pytest.mark.engine

PROMPT = 700


def disk_config(root: Path, **more) -> dict:
    return {"cpu_bytes": "64MiB", "disk_path": str(root), "disk_bytes": "256MiB", **more}


def gen(name: str, prompt: list[int], fresh: bool = False, salt: str | None = None) -> dict:
    return {"op": "generate", "name": name, "prompt": prompt, "fresh": fresh, "salt": salt}


def recomputed(name: str, prompt: list[int]) -> dict:
    """The reference for a restore in an engine process: the prompt under a cache salt
    of its own, computed from its first token (see conftest.recomputed)."""
    return gen(name, prompt, salt=reference_salt())


def entry_files(root: Path, pattern: str = "*.kv") -> list[Path]:
    return sorted(root.rglob(pattern))


def same_output(a: dict, b: dict) -> bool:
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def same_but_rounding(a: dict, b: dict) -> bool:
    """Equal up to batch rounding (serving.real_difference): a restore against a
    recomputation, whose prefill ran in other shapes."""
    return real_difference(SimpleNamespace(**a), SimpleNamespace(**b)) is None


def hit_tokens(chunk_tokens: int, prompt_len: int = PROMPT) -> int:
    """The longest hit of a `prompt_len`-token prompt (this module's by default)."""
    return last_boundary(prompt_len, chunk_tokens)


# ---- restart ------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "direct_io"), [("qwen3-next", True), ("gemma3", False)])
def test_restarted_engine_hits_what_the_previous_process_stored(
    arch, direct_io, model_dirs, tmp_path
):
    """The restarted engine reads past the page cache (`disk_direct_io`) for one model and
    through it for the other: either way the same greedy tokens and logprobs."""
    prompt = tokens(PROMPT, seed=11)
    spec = {"model": model_dirs[arch], "extra": disk_config(tmp_path)}
    # Process A exits with the engine still up: its exit hook must finish the writes.
    a = run_engine_proc(
        {**spec, "steps": [gen("cold", prompt), gen("native", prompt)], "shutdown": False}
    )
    assert a["runs"]["native"]["num_cached_tokens"] > 0
    [layout_dir] = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert json.loads((layout_dir / "layout.json").read_text())["fingerprint"] == layout_dir.name
    assert entry_files(tmp_path) and not entry_files(tmp_path, "*.tmp")

    # B is a fresh interpreter: another hash seed than A's (forked by the zygote).
    extra = disk_config(tmp_path, disk_direct_io=direct_io)
    b = run_engine_proc({**spec, "extra": extra, "steps": [gen("restored", prompt)]}, fresh=True)
    restored = b["runs"]["restored"]
    assert restored["num_cached_tokens"] == hit_tokens(b["chunk_tokens"])
    assert b["stats"]["disk"]["hits"] > 0 and b["stats"]["disk"]["corrupt"] == 0
    assert same_output(restored, a["runs"]["native"])


# ---- damage (in this process) -----------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3-next", "gemma3"])
def disk_engine(request, model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"disk-{request.param}")
    llm = make_llm(model_dirs[request.param], disk_config(root))
    yield llm
    shutdown(llm)


def _fresh(llm) -> None:
    """Forget everything but the disk: vLLM's own prefix cache and the CPU tier."""
    drop_cpu_tier(llm)
    llm.reset_prefix_cache()


def _flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 100] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:10] = (99).to_bytes(2, "little")
    path.write_bytes(bytes(data))


def _foreign(path: Path) -> None:
    """A well-formed entry of the same size written for another layout, under this name."""
    import torch

    key = bytes.fromhex(path.stem)
    gen = torch.Generator().manual_seed(SEED)
    payload = torch.randint(
        -128, 127, (path.stat().st_size - HEADER_BYTES,), dtype=torch.int8, generator=gen
    )
    with open(path, "wb") as f:
        write_entry(f, bytes(16), key, payload)


DAMAGE = {"payload": _flip_payload, "truncated": _truncate, "version": _version}
DAMAGE["foreign-layout"] = _foreign


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_entry_is_a_counted_miss_and_heals(disk_engine, kind):
    """Damage the last full-attention chunk of the best hit: the restore falls back to an
    earlier boundary (or none), and its output is exactly vLLM's own at that boundary.

    vLLM's output depends on where its prefix hit ends and even on how the cached prefix
    was batched when it was computed (kernels round differently), so the reference must
    use the very same KV bytes: a first prompt sharing only the shorter prefix computes
    them for both vLLM's own cache and hybridkv's entries.
    """
    llm = disk_engine
    side = scheduler_connector(llm).scheduler_side
    disk = worker_connector().worker_side.store.disk
    C = side.planner.chunk_tokens
    seed = 20 + 2 * sorted(DAMAGE).index(kind)
    prompt = tokens(PROMPT, seed=seed)
    shorter = hit_tokens(C) - C  # the boundary before the damaged chunk
    generate(llm, [prompt[:shorter] + tokens(PROMPT - shorter, seed=seed + 1)])
    reference = generate(llm, [prompt])[0]  # vLLM's own hit on the shared prefix
    native = generate(llm, [prompt])[0]  # vLLM's own hit on the whole prompt
    assert native.num_cached_tokens == hit_tokens(C)
    _fresh(llm)

    full = next(g for g, s in enumerate(side.layout.groups) if s.kind is GroupKind.FULL)
    keys = chunk_keys(chain_seed(side.layout.fingerprint, None), prompt, C)
    DAMAGE[kind](disk.path_of(group_key(keys[hit_tokens(C) // C - 1], full)))
    corrupt = disk.stats().corrupt

    restored = generate(llm, [prompt])[0]
    assert disk.stats().corrupt == corrupt + 1
    # Both fall back to `shorter`. Qwen3-Next had no recurrent state there when the
    # reference ran (vLLM computed it from scratch), but the reference's prefill stopped at
    # the fork (vLLM's shared-prefix junction) and hybridkv kept the state (core/policy.py).
    assert restored.num_cached_tokens == shorter > 0
    recurrent = any(s.kind is GroupKind.STATE for s in side.layout.groups)
    assert reference.num_cached_tokens == (0 if recurrent else shorter)
    assert (restored.token_ids, restored.logprobs) == (reference.token_ids, reference.logprobs)

    # The recompute stored the chunk again: a fresh start restores the whole hit from disk.
    _fresh(llm)
    again = generate(llm, [prompt])[0]
    assert again.num_cached_tokens == hit_tokens(C)
    assert (again.token_ids, again.logprobs) == (native.token_ids, native.logprobs)
    assert disk.stats().corrupt == corrupt + 1
    llm.reset_prefix_cache()


# ---- capacity -------------------------------------------------------------------------------


def test_disk_budget_holds_under_an_engine(model_dirs, tmp_path):
    budget = 1 << 20  # about two prompts' entries
    prompts = [tokens(PROMPT, seed=40 + i) for i in range(6)]
    steps = [s for i, p in enumerate(prompts) for s in (gen(f"p{i}", p), {"op": "flush"})]
    steps += [gen("oldest", prompts[0], fresh=True), gen("newest", prompts[-1], fresh=True)]
    steps += [recomputed("newest_native", prompts[-1])]
    r = run_engine_proc(
        {
            "model": model_dirs["qwen3-next"],
            "extra": disk_config(tmp_path, disk_bytes=budget),
            "steps": steps,
        }
    )
    assert r["stats"]["disk"]["evictions"] > 0
    assert sum(f.stat().st_size for f in entry_files(tmp_path)) <= budget
    assert r["runs"]["oldest"]["num_cached_tokens"] == 0  # evicted long ago
    assert r["runs"]["newest"]["num_cached_tokens"] == hit_tokens(r["chunk_tokens"])
    assert r["runs"]["newest_native"]["num_cached_tokens"] == 0
    assert same_but_rounding(r["runs"]["newest"], r["runs"]["newest_native"])


# ---- faults ---------------------------------------------------------------------------------


def test_full_disk_degrades_to_the_cpu_tier(model_dirs, tmp_path):
    """Every disk write fails (a file-size limit below one entry file): the engine serves
    correct output, counts the failures, and leaves no partial file behind."""
    prompt = tokens(PROMPT, seed=50)
    r = run_engine_proc(
        {
            "model": model_dirs["qwen3-next"],
            "extra": disk_config(tmp_path),
            "steps": [
                # Warm up first: vLLM compiles kernels (big files) on its first request.
                gen("warm-up", tokens(100, seed=51)),
                {"op": "limit_file_size", "bytes": 4096},
                gen("cold", prompt),
                gen("native", prompt),
                {"op": "flush"},
                gen("cpu", prompt, fresh=True),
            ],
        }
    )
    disk = r["stats"]["disk"]
    assert disk["write_errors"] > 0 and disk["puts"] == 0
    assert not entry_files(tmp_path) and not entry_files(tmp_path, "*.tmp")
    assert r["runs"]["cpu"]["num_cached_tokens"] == 0  # CPU tier emptied, disk holds nothing
    assert same_output(r["runs"]["cpu"], r["runs"]["native"])


def test_engine_killed_while_writing_leaves_a_usable_cache(model_dirs, tmp_path):
    """SIGKILL an engine while it writes an entry file (by construction: its writes stop
    halfway once the first prompt is on disk): the next engine on the directory removes
    what the dead one left, finds only whole entries, and restores them correctly."""
    root, flag = tmp_path / "cache", tmp_path / "stalled"
    first = tokens(PROMPT, seed=55)
    spec = {"model": model_dirs["qwen3-next"], "extra": disk_config(root)}
    busy = [gen(f"busy{i}", tokens(PROMPT, seed=56 + i)) for i in range(4)]
    a = EngineProc(
        {
            **spec,
            "steps": [
                gen("first", first),
                {"op": "flush"},
                {"op": "stall_disk_writes", "path": str(flag)},
                *busy,
                {"op": "wait", "path": str(tmp_path / "never")},
            ],
        }
    )
    deadline = time.monotonic() + 300
    while not flag.exists() and a.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), "engine A never began writing a busy prompt"
    assert entry_files(root, "*.tmp"), "no write in progress when A is killed"
    a.kill()

    b = run_engine_proc({**spec, "steps": [gen("restored", first), recomputed("native", first)]})
    assert b["runs"]["restored"]["num_cached_tokens"] == hit_tokens(b["chunk_tokens"])
    assert b["runs"]["native"]["num_cached_tokens"] == 0
    assert same_but_rounding(b["runs"]["restored"], b["runs"]["native"])
    assert b["stats"]["disk"]["corrupt"] == 0
    assert not entry_files(root, "*.tmp")


def _mount_tmpfs(path: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(path)]).returncode
        == 0
    )


@pytest.fixture
def read_only_later(tmp_path):
    """A directory and a function that makes it read-only for real (EROFS or EACCES)."""
    root = tmp_path / "ro"
    if _mount_tmpfs(root):
        yield root, lambda: subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        subprocess.run(["umount", "-l", str(root)])
    elif os.geteuid() != 0:
        root.mkdir()
        yield root, lambda: [os.chmod(d, 0o555) for d in [root, *root.rglob("*")] if d.is_dir()]
        for d in [root, *root.rglob("*")]:
            if d.is_dir():
                os.chmod(d, 0o755)
    else:
        pytest.skip("running as root without mount: no way to make a directory read-only")


def test_read_only_disk_path_serves_hits_and_stores_nothing(model_dirs, read_only_later):
    root, make_read_only = read_only_later
    prompt, other = tokens(PROMPT, seed=60), tokens(PROMPT, seed=61)
    spec = {"model": model_dirs["qwen3-next"], "extra": disk_config(root)}
    a = run_engine_proc({**spec, "steps": [gen("cold", prompt), gen("native", prompt)]})
    files = entry_files(root)
    assert files
    make_read_only()
    b = run_engine_proc({**spec, "steps": [gen("restored", prompt), gen("other", other)]})
    assert b["runs"]["restored"]["num_cached_tokens"] == hit_tokens(b["chunk_tokens"])
    assert same_output(b["runs"]["restored"], a["runs"]["native"])
    assert b["stats"]["disk"]["rejected_puts"] > 0 and b["stats"]["disk"]["puts"] == 0
    assert entry_files(root) == files


# ---- sharing --------------------------------------------------------------------------------


def test_two_engines_share_one_disk_path(model_dirs, tmp_path):
    """Two engine processes at once on one directory: each hits what the other stored."""
    root, flags = tmp_path / "shared", tmp_path / "flags"
    flags.mkdir()
    prompts = {"a": tokens(PROMPT, seed=70), "b": tokens(PROMPT, seed=71)}

    def spec(me: str, other: str) -> dict:
        steps = [
            gen("own_cold", prompts[me]),
            gen("own_native", prompts[me]),
            {"op": "flush"},
            {"op": "touch", "path": str(flags / me)},
            {"op": "wait", "path": str(flags / other)},
            gen("theirs", prompts[other], fresh=True),
            gen("theirs_native", prompts[other]),
        ]
        return {"model": model_dirs["qwen3-next"], "extra": disk_config(root), "steps": steps}

    procs = {"a": EngineProc(spec("a", "b")), "b": EngineProc(spec("b", "a"))}
    results = {name: p.result() for name, p in procs.items()}
    for me, other in (("a", "b"), ("b", "a")):
        runs = results[me]["runs"]
        assert runs["theirs"]["num_cached_tokens"] == hit_tokens(results[me]["chunk_tokens"])
        assert same_output(runs["theirs"], runs["theirs_native"])
        assert same_output(runs["theirs"], results[other]["runs"]["own_native"])
        assert results[me]["stats"]["disk"]["corrupt"] == 0
