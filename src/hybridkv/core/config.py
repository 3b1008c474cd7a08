"""User configuration: the `kv_connector_extra_config` dict, checked once at start.

Every error names the offending key, so a bad deployment fails at engine start rather
than silently running without a cache.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KI": 1024,
    "KIB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MI": 1024**2,
    "MIB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GI": 1024**3,
    "GIB": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TI": 1024**4,
    "TIB": 1024**4,
}


class ConfigError(ValueError):
    """A bad hybridkv setting; the message starts with the key at fault."""


def parse_size(value: Any, key: str = "size") -> int:
    """Parse a byte count: an int, or a string such as "512MiB", "2GB", "1.5 GiB"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        raise ConfigError(f"{key}: expected a size like '512MiB' or an integer, got {value!r}")
    if n < 0:
        raise ConfigError(f"{key}: size must not be negative, got {value!r}")
    return n


CHECKPOINT_POLICIES = ("prompt_and_end", "every_chunk")


@dataclass(frozen=True)
class HybridKVConfig:
    """Settings read from `kv_connector_extra_config`."""

    cpu_bytes: int = 2 * 1024**3
    # Tokens per stored chunk; None picks the smallest size every group's block tiles.
    chunk_tokens: int | None = None
    # Which recurrent-state boundaries are kept: see core/policy.py.
    checkpoint_policy: str = "prompt_and_end"
    # Names the weights in every key. Defaults to the engine's model path; set it when
    # replicas load the same weights from different paths.
    model_id: str | None = None
    # Local-disk tier under the CPU tier (off unless set); persists across restarts.
    disk_path: str | None = None
    disk_bytes: int = 16 * 1024**3
    # fsync each file before its rename: durability across power loss, not correctness
    # (a torn file fails its checksum and is a miss).
    disk_fsync: bool = False
    # Bytes waiting to be written before further disk stores are dropped (and counted).
    disk_queue_bytes: int = 256 * 1024**2
    # Permissions of the disk tier's files (directories get the matching search bits):
    # private by default; e.g. 0o660 for engines of one group sharing disk_path.
    disk_mode: int = 0o600
    # Secret that MACs every disk entry, so that whoever can write to a shared disk_path
    # cannot inject KV: entries without this MAC are misses. Kept out of the repr.
    integrity_key: str | None = field(default=None, repr=False)
    # Weight of prefill saved per byte against recency when CPU memory evicts recurrent
    # boundaries (core/eviction.py); 0 is LRU over whole boundaries.
    eviction_alpha: float = 1.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> HybridKVConfig:
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"{unknown[0]}: unknown hybridkv setting in kv_connector_extra_config "
                f"(known: {', '.join(sorted(known))})"
            )
        kwargs: dict[str, Any] = {}
        if "cpu_bytes" in raw:
            kwargs["cpu_bytes"] = parse_size(raw["cpu_bytes"], "cpu_bytes")
        if raw.get("chunk_tokens") is not None:
            ct = raw["chunk_tokens"]
            if isinstance(ct, bool) or not isinstance(ct, int) or ct <= 0:
                raise ConfigError(f"chunk_tokens: expected a positive integer, got {ct!r}")
            kwargs["chunk_tokens"] = ct
        if "checkpoint_policy" in raw:
            pol = raw["checkpoint_policy"]
            if pol not in CHECKPOINT_POLICIES:
                raise ConfigError(
                    f"checkpoint_policy: expected one of {CHECKPOINT_POLICIES}, got {pol!r}"
                )
            kwargs["checkpoint_policy"] = pol
        if "model_id" in raw:
            mid = raw["model_id"]
            if not isinstance(mid, str) or not mid:
                raise ConfigError(f"model_id: expected a non-empty string, got {mid!r}")
            kwargs["model_id"] = mid
        if "eviction_alpha" in raw:
            alpha = raw["eviction_alpha"]
            if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha >= 0:
                raise ConfigError(f"eviction_alpha: expected a number >= 0, got {alpha!r}")
            kwargs["eviction_alpha"] = float(alpha)
        kwargs.update(_disk_settings(raw))
        return cls(**kwargs)


_DISK_KEYS = ("disk_bytes", "disk_fsync", "disk_queue_bytes", "disk_mode", "integrity_key")
_MODE_RE = re.compile(r"^(?:0o?)?([0-7]{1,4})$", re.IGNORECASE)


def parse_mode(value: Any, key: str = "disk_mode") -> int:
    """Parse file permissions: an int (0o660) or an octal string ("0660", "660", "0o660").
    The owner must be able to read and write; nothing beyond 0o777 (no setuid, sticky)."""
    m = _MODE_RE.match(value.strip()) if isinstance(value, str) else None
    if m:
        mode = int(m.group(1), 8)
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ConfigError(f"{key}: expected octal permissions like '0660', got {value!r}")
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise ConfigError(
            f"{key}: permissions must be within 0777 and let the owner read and write "
            f"(0600), got {value!r} ({mode:#o})"
        )
    return mode


def _disk_settings(raw: dict[str, Any]) -> dict[str, Any]:
    path = raw.get("disk_path")
    if path is None:
        given = [k for k in _DISK_KEYS if k in raw]
        if given:
            raise ConfigError(f"{given[0]}: has no effect without disk_path")
        return {}
    if not isinstance(path, str) or not path:
        raise ConfigError(f"disk_path: expected a directory path, got {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"disk_path: {path!r} exists and is not a directory")
    out: dict[str, Any] = {"disk_path": path}
    for key in ("disk_bytes", "disk_queue_bytes"):
        if key in raw:
            out[key] = parse_size(raw[key], key)
            if out[key] == 0:
                raise ConfigError(f"{key}: must be more than 0 bytes")
    if "disk_fsync" in raw:
        if not isinstance(raw["disk_fsync"], bool):
            raise ConfigError(f"disk_fsync: expected true or false, got {raw['disk_fsync']!r}")
        out["disk_fsync"] = raw["disk_fsync"]
    if "disk_mode" in raw:
        out["disk_mode"] = parse_mode(raw["disk_mode"])
    if raw.get("integrity_key") is not None:
        secret = raw["integrity_key"]
        if not isinstance(secret, str) or len(secret) < 16:
            # The value is a secret: never echo it.
            raise ConfigError("integrity_key: expected a secret string of 16 characters or more")
        out["integrity_key"] = secret
    return out
