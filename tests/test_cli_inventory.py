"""`hybridkv inspect` and `hybridkv gc` on what real parts wrote: a disk directory filled
by a real engine (one in-process engine for the module), and a real redis-server filled
by the Redis tier.

Counts are checked against the files on disk, the chunk keys hybridkv computes for the
prompts and the engine's own counters, never against numbers written here. gc's last
test trims the directory under the running engine and checks that the engine then serves
the same greedy output (a counted miss and a recompute for what was removed, a hit for
what was kept).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tokens
from redis_servers import redis_cluster, redis_server, require_redis

from hybridkv.cli import main
from hybridkv.core.keys import KEY_BYTES, chain_seed, chunk_keys, group_key
from hybridkv.core.layout import GroupKind
from hybridkv.core.tiers.disk import DiskTier
from hybridkv.core.tiers.entry_file import HEADER_BYTES, file_bytes
from hybridkv.core.tiers.redis import RedisTier

HYBRIDKV = str(Path(sys.executable).with_name("hybridkv"))
PROMPT = 300  # two chunks of 128 tokens; the kept state is at the boundary 256
HOUR = 3600


def run_cli(capsys, *args: str) -> tuple[int, str]:
    """`hybridkv ARGS` in this process: exit status and stdout."""
    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().out


def inspect_json(capsys, *args: str) -> tuple[int, dict]:
    rc, out = run_cli(capsys, "inspect", *args, "--json")
    return rc, json.loads(out)


def entry_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def group_of(path: Path) -> int:
    return int(path.stem[2 * KEY_BYTES :], 16)


def set_used(paths, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    for p in paths:
        os.utime(p, (t, t))


# ---- one engine run -------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two prompts through a qwen3-next engine with a disk tier, written and synced; a
    copy of the directory as it was then (`snapshot`, mtimes kept) for the tests that
    damage or trim it; the engine stays up for the last test."""
    from hybridkv.engine import (
        generate,
        make_llm,
        scheduler_connector,
        shutdown,
        sync_tiers,
        worker_connector,
    )
    from hybridkv.models import make_model

    base = tmp_path_factory.mktemp("inventory")
    model = str(make_model("qwen3-next", base / "model", size="tiny"))
    root = base / "cache"
    # Short prompts only: a small model length keeps the engine's start-up quick.
    llm = make_llm(
        model,
        {"cpu_bytes": "64MiB", "disk_path": str(root)},
        max_model_len=512,
        max_num_batched_tokens=512,
    )
    try:
        prompts = {"a": tokens(PROMPT, seed=81), "b": tokens(PROMPT, seed=82)}
        cold = {name: generate(llm, [p])[0] for name, p in prompts.items()}
        native_b = generate(llm, [prompts["b"]])[0]  # vLLM's own prefix hit
        sync_tiers(llm)
        side = scheduler_connector(llm).scheduler_side
        disk = worker_connector().worker_side.store.disk
        seed = chain_seed(side.layout.fingerprint, None)
        C = side.planner.chunk_tokens
        layout_dir = root / side.layout.fingerprint.hex()
        files = {
            name: [
                disk.path_of(group_key(k, g))
                for k in chunk_keys(seed, p, C)
                for g in range(len(side.layout.groups))
                if disk.path_of(group_key(k, g)).exists()
            ]
            for name, p in prompts.items()
        }
        snapshot = base / "snapshot"
        shutil.copytree(root, snapshot)
        yield SimpleNamespace(
            llm=llm,
            root=root,
            snapshot=snapshot,
            layout_dir=layout_dir,
            model=model,
            side=side,
            disk=disk,
            stats=disk.stats(),
            prompts=prompts,
            cold=cold,
            native_b=native_b,
            files=files,
            chunk_keys={name: chunk_keys(seed, p, C) for name, p in prompts.items()},
        )
    finally:
        shutdown(llm)


@pytest.fixture
def cache(run, tmp_path) -> Path:
    """A copy of the engine's directory, file times kept."""
    return Path(shutil.copytree(run.snapshot, tmp_path / "cache"))


def moved(run, cache: Path, name: str) -> list[Path]:
    """Prompt `name`'s files in the copy `cache`."""
    return [cache / p.relative_to(run.root) for p in run.files[name]]


# ---- inspect --------------------------------------------------------------------------


def test_inspect_counts_what_the_engine_wrote(run, capsys):
    files = entry_files(run.snapshot)
    sizes = [f.stat().st_size for f in files]
    rc, out = inspect_json(capsys, str(run.snapshot))
    assert rc == 0
    assert (out["entries"], out["bytes"]) == (len(files), sum(sizes))
    assert (out["entries"], out["bytes"]) == (run.stats.entries, run.stats.bytes_used)
    [lay] = out["layouts"]
    assert lay["fingerprint"] == run.side.layout.fingerprint.hex()
    assert lay["layout"]["model"] == run.model and lay["layout"]["tp_size"] == 1
    kinds = [g.kind.value for g in run.side.layout.groups]
    assert [g["kind"] for g in lay["layout"]["groups"]] == kinds
    # Per group: counts and bytes of the files named for that group.
    for g in lay["groups"]:
        mine = [f for f in files if group_of(f) == g["group"]]
        assert (g["entries"], g["bytes"]) == (len(mine), sum(f.stat().st_size for f in mine))
        assert g["kind"] == kinds[g["group"]]
    states = [f for f in files if kinds[group_of(f)] == GroupKind.STATE]
    assert lay["kinds"]["state"]["entries"] == len(states) > 0
    # Chunks: every chunk of both prompts; states only at each prompt's last boundary
    # (the default checkpoint policy), for every recurrent group.
    keys = run.chunk_keys["a"] + run.chunk_keys["b"]
    with_states = {run.chunk_keys["a"][-1], run.chunk_keys["b"][-1]}
    assert {bytes.fromhex(f.stem[: 2 * KEY_BYTES]) for f in states} == with_states
    assert lay["chunks"] == {
        "total": len(keys),
        "with_all_states": len(with_states),
        "with_some_states": 0,
        "without_states": len(keys) - len(with_states),
    }
    mtimes = [f.stat().st_mtime_ns / 1e9 for f in files]
    assert (lay["oldest_use"], lay["newest_use"]) == (min(mtimes), max(mtimes))
    assert lay["temporary_files"] == 0 and lay["strays"]["count"] == 0

    # The tables name the same things (one layout directory given directly).
    rc, text = run_cli(capsys, "inspect", str(run.snapshot / lay["fingerprint"]))
    assert rc == 0 and lay["fingerprint"] in text and run.model in text
    assert f"{len(files)} entries" in text


def _flip(path: Path, offset: int = HEADER_BYTES + 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_inspect_verify_finds_damage_and_exits_1(run, cache, capsys):
    n = len(entry_files(cache))
    rc, clean = run_cli(capsys, "inspect", str(cache), "--verify")
    assert rc == 0 and f"verified {n} entries: {n} good, 0 damaged" in clean

    layout_dir = cache / run.layout_dir.name
    flipped, cut = moved(run, cache, "a")[:2]
    _flip(flipped)
    os.truncate(cut, cut.stat().st_size // 2)
    newer = moved(run, cache, "b")[0]
    _flip(newer, 8)  # file version 1 -> another: a newer hybridkv's, left alone
    (layout_dir / "notes.txt").write_text("not an entry")
    (cache / "lost+found").mkdir()
    garbage = layout_dir / "ab" / ("ab" * (KEY_BYTES + 2) + ".kv")
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(b"not a hybridkv entry" * 10)

    rc, out = inspect_json(capsys, str(cache), "--verify")
    assert rc == 1
    damaged = {d["where"]: d["reason"] for d in out["verify"]["damaged"]}
    assert damaged == {str(flipped): "checksum", str(cut): "truncated", str(garbage): "magic"}
    assert [d["where"] for d in out["verify"]["not_usable_here"]] == [str(newer)]
    assert out["verify"]["good"] == n - 3 and out["verify"]["unreadable"] == []
    assert out["strays"]["count"] == 1 and out["layouts"][0]["strays"]["count"] == 1

    # Through the installed script, as an operator runs it.
    result = subprocess.run([HYBRIDKV, "inspect", str(cache), "--verify"], capture_output=True)
    assert result.returncode == 1
    report = result.stdout.decode()
    assert "3 damaged" in report and flipped.name in report and cut.name in report
    # Verifying deletes nothing: that is the engines' (and gc's) business.
    assert flipped.exists() and cut.exists() and garbage.exists()


# ---- gc -------------------------------------------------------------------------------


def test_gc_max_bytes_removes_least_recently_used_chunks_whole(run, cache, capsys):
    a, b = moved(run, cache, "a"), moved(run, cache, "b")
    set_used(a, 2 * HOUR)
    # b's last chunk (its attention KV and the states at its end) was used last.
    last = run.chunk_keys["b"][-1].hex()
    b_last = [p for p in b if p.stem.startswith(last)]
    b_first = [p for p in b if p not in b_last]
    set_used(b_first, HOUR)
    keep = sum(p.stat().st_size for p in b_last)
    total = sum(p.stat().st_size for p in entry_files(cache))

    rc, out = run_cli(capsys, "gc", str(cache), "--max-bytes", str(keep), "--dry-run")
    assert rc == 0 and "would remove" in out
    assert re.search(rf"all\s+{len(a) + len(b_first)}\s", out)
    assert len(entry_files(cache)) == len(a) + len(b)  # a dry run removes nothing

    rc, out = run_cli(capsys, "gc", str(cache), "--max-bytes", str(keep))
    assert rc == 0
    assert sorted(entry_files(cache)) == sorted(b_last)
    assert f"removed {len(a) + len(b_first)} entries" in out
    assert sum(p.stat().st_size for p in entry_files(cache)) == keep < total

    # One byte less: the last unit goes whole, never its states without its chunk.
    rc, _ = run_cli(capsys, "gc", str(cache), "--max-bytes", str(keep - 1))
    assert rc == 0 and entry_files(cache) == []


def test_gc_older_than(run, cache, capsys):
    a, b = moved(run, cache, "a"), moved(run, cache, "b")
    set_used(a, 3 * HOUR)
    set_used(b, 60)
    rc, _ = run_cli(capsys, "gc", str(cache), "--older-than", "4h")
    assert rc == 0 and len(entry_files(cache)) == len(a) + len(b)
    rc, out = run_cli(capsys, "gc", str(cache), "--older-than", "2h")
    assert rc == 0 and sorted(entry_files(cache)) == sorted(b)
    assert f"removed {len(a)} entries" in out
    rc, _ = run_cli(capsys, "gc", str(cache), "--older-than", "30s")
    assert rc == 0 and entry_files(cache) == []
    assert run_cli(capsys, "gc", str(cache), "--older-than", "7 days")[0] == 2  # a usage error


def test_gc_layout_removes_one_layout(run, cache, capsys):
    # A second layout in the same disk_path, written by the disk tier itself.
    other_fp = bytes(range(16))
    tier = DiskTier(cache, other_fp, {"model": "other"}, 1 << 30)
    for i in range(3):
        tier.put(group_key(i.to_bytes(KEY_BYTES, "big"), 0), torch.zeros(1000, dtype=torch.int8))
    tier.flush()
    tier.close()
    ours = entry_files(cache / run.layout_dir.name)

    assert run_cli(capsys, "gc", str(cache), "--layout", "ffff")[0] == 2  # no such layout
    rc, out = run_cli(capsys, "gc", str(cache), "--layout", other_fp.hex()[:6], "--dry-run")
    assert rc == 0 and "(whole layout)" in out and (cache / other_fp.hex()).is_dir()
    rc, out = run_cli(capsys, "gc", str(cache), "--layout", other_fp.hex()[:6])
    assert rc == 0 and "removed 3 entries" in out
    assert not (cache / other_fp.hex()).exists()
    assert entry_files(cache) == ours


def test_gc_under_a_running_engine(run, capsys):
    """Trim the live directory: what was removed is a counted miss and recomputed
    (output identical to the cold run), what was kept is a hit (identical to vLLM's own
    prefix hit), and the engine stores the removed prompt again."""
    from hybridkv.engine import drop_cpu_tier, generate, sync_tiers

    llm = run.llm
    drop_cpu_tier(llm)  # the engine's index still lists a's files, as it would in service
    llm.reset_prefix_cache()
    set_used(run.files["a"], 2 * HOUR)
    before = run.disk.stats()

    rc, out = run_cli(capsys, "gc", str(run.root), "--older-than", "1h")
    assert rc == 0 and f"removed {len(run.files['a'])} entries" in out
    assert not any(p.exists() for p in run.files["a"])

    a = generate(llm, [run.prompts["a"]])[0]
    after = run.disk.stats()
    assert after.misses > before.misses  # read under it: a miss, counted
    assert (after.errors, after.corrupt) == (before.errors, before.corrupt)  # nothing else
    assert a.num_cached_tokens == 0
    assert (a.token_ids, a.logprobs) == (run.cold["a"].token_ids, run.cold["a"].logprobs)
    b = generate(llm, [run.prompts["b"]])[0]
    C = run.side.planner.chunk_tokens
    assert b.num_cached_tokens == (PROMPT - 1) // C * C
    assert (b.token_ids, b.logprobs) == (run.native_b.token_ids, run.native_b.logprobs)
    sync_tiers(llm)
    assert all(p.exists() for p in run.files["a"])  # stored again


# ---- Redis ----------------------------------------------------------------------------


def test_inspect_redis(capsys):
    require_redis()
    fp, other = bytes(range(16)), bytes(range(50, 66))
    sizes = {0: 3000, 1: 10_000}  # group 1's entries are split into 3 parts of 4096

    with redis_server() as server:
        tier = RedisTier(server.url, fp, max_entry_bytes=4096)
        tier2 = RedisTier(server.url, other)
        for i in range(4):
            k = i.to_bytes(KEY_BYTES, "big")
            for g, n in sizes.items():
                tier.put(group_key(k, g), torch.full((n,), i, dtype=torch.int8))
        tier2.put(group_key(bytes(KEY_BYTES), 0), torch.zeros(500, dtype=torch.int8))
        for t in (tier, tier2):
            t.flush()
            t.close()

        rc, out = inspect_json(capsys, server.url, "--verify")
        assert rc == 0 and out["verify"]["good"] == out["entries"] == 9
        by_fp = {lay["fingerprint"]: lay for lay in out["layouts"]}
        groups = {g["group"]: g for g in by_fp[fp.hex()]["groups"]}
        for g, n in sizes.items():
            assert (groups[g]["entries"], groups[g]["bytes"]) == (4, 4 * file_bytes(n, False))
        assert by_fp[other.hex()]["bytes"] == file_bytes(500, False)
        assert by_fp[fp.hex()]["chunks"]["total"] == 4

        client = server.client()
        split = tier.names(group_key((2).to_bytes(KEY_BYTES, "big"), 1), 3)
        client.setrange(split[1], 100, b"\xff\xfe")  # a middle part damaged
        client.delete(tier.names(group_key((3).to_bytes(KEY_BYTES, "big"), 1), 3)[2])
        client.set("hybridkv:not-ours", b"x")
        rc, out = inspect_json(capsys, server.url, "--verify")
        assert rc == 1
        damaged = {d["where"]: d["reason"] for d in out["verify"]["damaged"]}
        assert damaged == {
            split[0]: "checksum",
            tier.names(group_key((3).to_bytes(KEY_BYTES, "big"), 1))[0]: "truncated",
        }
        assert out["strays"]["count"] == 1
        rc, text = run_cli(capsys, "inspect", server.url)
        assert rc == 0 and fp.hex() in text and "Redis records no layout description" in text


def test_inspect_redis_cluster(capsys):
    """A three-master Cluster: every master's entries are listed and verified."""
    require_redis()
    fp = bytes(range(16))
    with redis_cluster() as nodes:
        tier = RedisTier(nodes[0].url, fp, cluster=True, max_entry_bytes=4096)
        for i in range(12):
            key = group_key(i.to_bytes(KEY_BYTES, "big"), i % 2)
            tier.put(key, torch.full((5000,), i, dtype=torch.int8))
        tier.flush()
        tier.close()
        on_nodes = sum(n.client().dbsize() for n in nodes)
        assert on_nodes == 12 * 2  # two parts each, spread over the masters
        rc, out = inspect_json(capsys, nodes[1].url, "--verify")
        assert rc == 0 and out["entries"] == out["verify"]["good"] == 12
        assert out["bytes"] == 12 * file_bytes(5000, False)


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:1/0?password=TOPSECRET", "redis://:TOPSECRET@127.0.0.1:notaport/0"],
    ids=["query-password", "bad-port"],
)
def test_inspect_of_a_redis_it_cannot_reach_says_so_without_the_password(capsys, url):
    capsys.readouterr()
    rc = main(["inspect", url])
    out = capsys.readouterr()
    assert rc != 0 and "cannot read redis://" in out.err, out
    assert "TOPSECRET" not in out.out + out.err and "Traceback" not in out.err


def test_gc_layout_removes_a_layout_without_entries(tmp_path, capsys):
    """A layout directory holding only its layout.json (emptied, or never written):
    `gc --layout` removes it, as it says."""
    fp = bytes(range(16))
    DiskTier(tmp_path, fp, {"model": "empty"}, 1 << 30).close()
    assert (tmp_path / fp.hex() / "layout.json").is_file()
    rc, out = run_cli(capsys, "gc", str(tmp_path), "--layout", fp.hex()[:6])
    assert rc == 0 and "(whole layout)" in out, out
    assert not (tmp_path / fp.hex()).exists()


def test_verify_never_holds_a_payload_a_sparse_file_claims(tmp_path):
    """A file under an entry's name whose header claims 2 GiB, as large as it says but
    sparse (no disk): verify reports it damaged, streaming it through one piece's buffer
    (the whole claim was allocated and read in; anyone who can write the directory
    chooses the size)."""
    fp = bytes(range(16))
    tier = DiskTier(tmp_path, fp, {"model": "m"}, 1 << 30)
    k = group_key(b"\x01" * KEY_BYTES, 0)
    tier.put(k, torch.zeros(100, dtype=torch.int8))
    tier.flush()
    tier.close()
    (path,) = entry_files(tmp_path)
    claim = 2 << 30
    with open(path, "r+b") as f:
        f.seek(48)
        f.write(claim.to_bytes(8, "little"))
    try:
        os.truncate(path, file_bytes(claim, False))
    except OSError as e:
        pytest.skip(f"no sparse file of 2 GiB here: {e}")
    # The child's peak from its own memory map (VmHWM starts over at exec; ru_maxrss
    # would carry the peak of the test process it was started from).
    child = f"""
import json, re
from hybridkv.core.inventory import open_store, verify
store = open_store({str(tmp_path)!r})
report = verify(store, store.inventory())
status = open("/proc/self/status").read()
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024
print(json.dumps({{"damaged": [vars(p) for p in report.damaged], "peak": peak}}))
"""
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, check=True)
    out = json.loads(result.stdout.decode().splitlines()[-1])
    assert [d["reason"] for d in out["damaged"]] == ["checksum"]
    assert out["peak"] < claim // 2, out["peak"]


def test_inspect_reads_layout_json_as_text_not_markup(tmp_path, capsys):
    """layout.json is anyone's to write in a shared directory: rich markup in it is shown,
    never parsed (a stray closing tag crashed the table)."""
    fp = bytes(range(16))
    description = {"model": "m", "groups": [{"kind": "[/x]", "block_tokens": "[/y]"}]}
    tier = DiskTier(tmp_path, fp, description, 1 << 30)
    tier.put(group_key(b"\x01" * KEY_BYTES, 0), torch.zeros(100, dtype=torch.int8))
    tier.flush()
    tier.close()
    rc, out = run_cli(capsys, "inspect", str(tmp_path))
    assert rc == 0 and "[/y]" in out, out


def test_inspect_notes_a_layout_it_cannot_list(tmp_path, capsys, monkeypatch):
    """Another user's layout directory (0700 under the default disk_mode) in a shared
    disk_path: a note on that layout, the others inspected. (The fault is injected: this
    suite runs as root, whom permissions do not stop.)"""
    from hybridkv.core import inventory

    for i in range(2):
        tier = DiskTier(tmp_path, bytes([i]) * 16, {"model": f"m{i}"}, 1 << 30)
        tier.put(group_key(b"\x01" * KEY_BYTES, 0), torch.zeros(100, dtype=torch.int8))
        tier.flush()
        tier.close()
    scan = inventory.scan_layout_dir
    theirs = str(tmp_path / (bytes([1]) * 16).hex())

    def scan_or_refuse(layout_dir):
        if str(layout_dir) == theirs:
            raise PermissionError(13, "Permission denied", theirs)
        return scan(layout_dir)

    monkeypatch.setattr(inventory, "scan_layout_dir", scan_or_refuse)
    rc, data = inspect_json(capsys, str(tmp_path))
    assert rc == 0
    notes = {lay["fingerprint"]: lay.get("note") for lay in data["layouts"]}
    assert "Permission denied" in notes[(bytes([1]) * 16).hex()]
    assert notes[(bytes([0]) * 16).hex()] is None


def _one_layout(root: Path, fp: bytes = bytes(range(16))) -> Path:
    tier = DiskTier(root, fp, {"model": "m"}, 1 << 30)
    tier.put(group_key(b"\x01" * KEY_BYTES, 0), torch.zeros(100, dtype=torch.int8))
    tier.flush()
    tier.close()
    return root / fp.hex()


def test_gc_prints_a_path_as_text_not_markup(tmp_path, capsys):
    """A directory named like rich markup: gc says the path it removed, and a stray
    closing tag no longer fails the command after it removed the entries."""
    for name in ("cache[old]", "x[/b]"):
        root = tmp_path / name
        layout_dir = _one_layout(root)
        rc, out = run_cli(capsys, "gc", str(root), "--layout", layout_dir.name[:6])
        said = "".join(out.split())  # the console wraps long lines
        assert rc == 0 and f"removedlayoutdirectory{layout_dir}" in said, out


def test_gc_keeps_a_layout_directory_it_cannot_read(tmp_path, capsys, monkeypatch):
    """Another user's layout directory in a shared disk_path: gc says it kept it, no
    traceback. (The fault is injected: this suite runs as root.)"""
    from hybridkv.core import trim

    layout_dir = _one_layout(tmp_path)

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(trim, "scan_layout_dir", refuse)
    rc, out = run_cli(capsys, "gc", str(tmp_path), "--layout", layout_dir.name[:6])
    assert rc == 0 and f"keptlayoutdirectory{layout_dir}" in "".join(out.split()), out


def test_inspect_dot_from_inside_a_layout_directory(tmp_path, capsys, monkeypatch):
    layout_dir = _one_layout(tmp_path)
    monkeypatch.chdir(layout_dir)
    rc, data = inspect_json(capsys, ".")
    assert rc == 0 and [lay["fingerprint"] for lay in data["layouts"]] == [layout_dir.name]
    assert data["entries"] == 1, data


def test_a_layout_directory_reached_through_a_link_named_by_its_fingerprint(tmp_path, capsys):
    layout_dir = _one_layout(tmp_path / "real", bytes(range(16)))
    moved = layout_dir.rename(tmp_path / "real" / "elsewhere")
    link = tmp_path / layout_dir.name
    link.symlink_to(moved)
    rc, data = inspect_json(capsys, str(link))
    assert rc == 0 and [lay["fingerprint"] for lay in data["layouts"]] == [layout_dir.name]


def test_inspect_of_a_path_it_cannot_search_says_so(tmp_path, capsys, monkeypatch):
    """A parent this user may not search: a clear error, exit 2, no traceback. (The
    fault is injected: this suite runs as root.)"""

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_dir", refuse)
    rc, out = run_cli(capsys, "inspect", str(tmp_path / "sub"))
    assert rc == 2, out


def test_a_duration_too_long_for_a_number_is_a_usage_error():
    from hybridkv.core.trim import parse_duration

    assert parse_duration("90m") == 5400
    with pytest.raises(ValueError, match="duration"):
        parse_duration("9" * 400 + "s")
