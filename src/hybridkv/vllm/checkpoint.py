"""Cheap fingerprints of checkpoint files (model weights, LoRA adapters).

The disk tier outlives the engine, so a checkpoint rewritten under the same name or path
must not be served KV computed with the old one. Hashing the weights would take seconds to
minutes; instead the name, size and modification time of every top-level weight and JSON
file are hashed (`os.stat` follows the hub cache's symlinks to its blobs). A rewrite
changes them; copying or re-downloading a checkpoint only costs misses.
"""

from __future__ import annotations

import json
from pathlib import Path

import blake3

_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json"})


def _local_root(name_or_path: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The checkpoint's directory (or single file) on this machine, if there is one."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    from huggingface_hub import snapshot_download

    try:  # a hub id: its cached snapshot, resolved without network
        return Path(
            snapshot_download(
                name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=True
            )
        )
    except (OSError, ValueError):  # not cached, or not a hub id
        return None


def checkpoint_fingerprint(
    name_or_path: str, revision: str | None = None, cache_dir: str | None = None
) -> str:
    """Hex digest of the checkpoint's top-level weight and JSON files; "" when no local
    copy is found (then its name and revision are all that identify it)."""
    root = _local_root(name_or_path, revision, cache_dir)
    if root is None:
        return ""
    files = [root] if root.is_file() else sorted(root.iterdir())
    h = blake3.blake3()
    for f in files:
        if f.suffix in _SUFFIXES and f.is_file():
            st = f.stat()
            h.update(json.dumps([f.name, st.st_size, st.st_mtime_ns]).encode() + b"\n")
    return h.hexdigest(length=16)
