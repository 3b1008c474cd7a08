"""Bytes/s of Redis tier loads against a raw redis-py pipelined GET of the same bytes
(issue 13: goal at least 0.8x).

Starts its own `redis-server` on a loopback port, stores `--batch` entries of each size
through `RedisTier`, then times, interleaved in the same run (common.interleaved):
`RedisTier.get_many` of the batch (one pipeline of MGETs, every entry's header, checksum
and size checked, payload copied into a host-pool slot as the engine's loads are), and a
raw pipeline of GETs of the same values (bytes that stay in redis-py's buffers, checked
by nothing). Sizes are those of
the small qwen3-next model's entries; `split` rows cut each entry into 1 MiB parts.

    .venv/bin/python bench/redis_load.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import redis
import torch
from common import interleaved

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from redis_servers import redis_server  # noqa: E402

from hybridkv.core.host_pool import HostPool  # noqa: E402
from hybridkv.core.keys import KEY_BYTES, group_key  # noqa: E402
from hybridkv.core.tiers.redis import RedisTier  # noqa: E402

FP = bytes(range(16))
MIB = 1 << 20


def case(url: str, nbytes: int, batch: int, max_entry_bytes: int, repeats: int) -> dict:
    prefix = f"bench{nbytes}-{max_entry_bytes}"
    tier = RedisTier(
        url,
        FP,
        key_prefix=prefix,
        entry_bytes=[nbytes],
        max_entry_bytes=max_entry_bytes,
        alloc=HostPool(pin=False).empty,
    )
    keys = [group_key(i.to_bytes(KEY_BYTES, "big"), 0) for i in range(batch)]
    for i, k in enumerate(keys):
        assert tier.put(k, torch.full((nbytes,), i % 100, dtype=torch.int8))
    tier.flush()
    parts = tier._predicted_parts(keys[0])
    names = [n for k in keys for n in tier.names(k, parts)]
    raw = redis.Redis.from_url(url)

    def tier_load() -> None:
        assert all(e is not None for e in tier.get_many(keys))

    def raw_load() -> None:
        pipe = raw.pipeline(transaction=False)
        for n in names:
            pipe.get(n)
        assert all(v is not None for v in pipe.execute())

    t = interleaved({"tier": tier_load, "raw": raw_load}, repeats)
    tier.close()
    raw.close()
    payload = nbytes * batch
    return {
        "entry_bytes": nbytes,
        "batch": batch,
        "parts": parts,
        "raw_gb_s": payload / t["raw"] / 1e9,
        "tier_gb_s": payload / t["tier"] / 1e9,
        "ratio": t["raw"] / t["tier"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    with redis_server("--maxmemory-policy", "allkeys-lru") as server:
        for nbytes, max_entry_bytes in [
            (256 << 10, 8 * MIB),
            (1 * MIB, 8 * MIB),
            (4 * MIB, 8 * MIB),
            (4 * MIB, 1 * MIB),
        ]:
            rows.append(case(server.url, nbytes, args.batch, max_entry_bytes, args.repeats))
    print(f"{'entry':>8} {'parts':>5} {'batch':>5} {'raw GB/s':>9} {'tier GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['entry_bytes'] >> 10:>5}KiB {r['parts']:>5} {r['batch']:>5} "
            f"{r['raw_gb_s']:>9.2f} {r['tier_gb_s']:>9.2f} {r['ratio']:>6.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
