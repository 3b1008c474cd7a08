"""Tiers that others can write to, and the warning at start when they run without
`integrity_key`.

An entry's checksum (docs/format.md) only catches accidents: whoever can write a Redis
server or a disk directory can write a well-formed entry under any key, and an engine
without `integrity_key` restores it as the KV of a prompt it never saw: wrong answers,
with no error. With the key, every entry carries a keyed MAC, and an entry written
without it is a counted miss. A private directory (this user's own, writable by no one
else) needs no key; a Redis server always may be written by its other clients.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hybridkv.core.config import HybridKVConfig, mask_url

log = logging.getLogger(__name__)


def _disk_writers(path: str, mode: int) -> str | None:
    """Why users other than this one may write entries under `path`, or None."""
    if mode & 0o022:
        return f"disk_mode {mode:#o} lets others write its files"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None  # the tier makes it, with disk_mode's bits
    if st.st_uid != os.geteuid():
        return "the directory belongs to another user"
    if st.st_mode & 0o022:
        return f"the directory is group- or world-writable ({st.st_mode & 0o777:#o})"
    return None


def unprotected_tiers(config: HybridKVConfig) -> list[str]:
    """The tiers others may write entries to, each with why; empty with an integrity key."""
    if config.integrity_key is not None:
        return []
    found = []
    if config.disk is not None and (why := _disk_writers(config.disk.path, config.disk.mode)):
        found.append(f"disk tier {config.disk.path!r} ({why})")
    if config.redis is not None:
        found.append(f"redis tier {mask_url(config.redis.url)} (any client of it may write)")
    return found


def secrets_in(raw: Mapping[str, Any], path: str = "") -> list[str]:
    """The keys of `raw` (kv_connector_extra_config) that hold a secret: `integrity_key`,
    or a URL with a password, at any depth (a `tiers` list too)."""
    found = []
    items = raw.items() if isinstance(raw, Mapping) else enumerate(raw)
    for key, value in items:
        name = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        secret_url = isinstance(value, str) and "://" in value and mask_url(value) != value
        if secret_url or (key == "integrity_key" and value is not None):
            found.append(name)
        elif isinstance(value, Mapping | list | tuple):
            found += secrets_in(value, name)
    return found


def warn_logged_secrets(raw: Mapping[str, Any]) -> None:
    """vLLM logs `kv_connector_extra_config` verbatim at start (its `non-default args`
    line masks only its own secrets): a secret given there is in the log already. Say so
    once, and where secrets belong."""
    if keys := secrets_in(raw):
        log.warning(
            "hybridkv: %s in kv_connector_extra_config, which vLLM writes to its log at "
            "start: give secrets as HYBRIDKV_INTEGRITY_KEY / HYBRIDKV_REDIS_URL or in "
            "config_file (docs/config.md)",
            ", ".join(keys),
        )


def warn_unprotected_tiers(config: HybridKVConfig) -> None:
    """Log, once at start, each tier whose entries someone else could have forged."""
    for tier in unprotected_tiers(config):
        log.warning(
            "hybridkv: the %s runs without integrity_key: whoever can write there can make "
            "this engine restore KV they made up (wrong output, no error). Set integrity_key, "
            "the same secret on every engine sharing the tier (docs/config.md)",
            tier,
        )
