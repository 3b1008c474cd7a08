"""On-disk entry files: a 64-byte self-describing header, then the canonical payload.

The format is documented in docs/format.md. Reading checks every header field and a
checksum over header and payload before any byte can reach a KV cache; a mismatch raises
`EntryFileError` naming the reason, which the disk tier counts and treats as a miss.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import BinaryIO

import torch
import xxhash

from hybridkv.core.keys import KEY_BYTES, split_group_key

MAGIC = b"HYBRIDKV"
FILE_VERSION = 1
# magic, file version, header bytes, group id, reserved, layout fingerprint, chunk key,
# payload bytes, checksum: little-endian, 64 bytes.
_HEADER = struct.Struct(f"<8sHHHH16s{KEY_BYTES}sQQ")
HEADER_BYTES = _HEADER.size
_CHECKSUMMED = HEADER_BYTES - 8  # the checksum covers every header byte before it
# Reads go in pieces that stay in the CPU cache until hashed (bench/copy_path.py).
_READ_PIECE = 256 << 10


class EntryFileError(Exception):
    """A file that must not be used; `reason` is one word for counting and logs."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _checksum(head: bytes, payload: memoryview) -> int:
    h = xxhash.xxh3_64(head[:_CHECKSUMMED])
    h.update(payload)
    return h.intdigest()


def write_entry(f: BinaryIO, fingerprint: bytes, key: bytes, entry: torch.Tensor) -> int:
    """Write header and payload of one entry to `f`; returns the file's size."""
    chunk_key, group = split_group_key(key)
    payload = memoryview(entry.numpy()).cast("B")
    head = _HEADER.pack(
        MAGIC, FILE_VERSION, HEADER_BYTES, group, 0, fingerprint, chunk_key, len(payload), 0
    )
    f.write(head[:_CHECKSUMMED] + _checksum(head, payload).to_bytes(8, "little"))
    f.write(payload)
    return HEADER_BYTES + len(payload)


def new_entry(nbytes: int) -> torch.Tensor:
    """A fresh host entry (the default place a read lands)."""
    return torch.empty(nbytes, dtype=torch.int8)


def read_entry(
    path: str | os.PathLike,
    fingerprint: bytes,
    key: bytes,
    alloc: Callable[[int], torch.Tensor] = new_entry,
) -> torch.Tensor:
    """Read and verify one entry into `alloc(payload bytes)`; raises EntryFileError (or
    OSError: missing, I/O)."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise EntryFileError("truncated", f"{len(head)}-byte header")
        magic, version, header_bytes, group, _, file_fp, chunk_key, n, checksum = _HEADER.unpack(
            head
        )
        if magic != MAGIC:
            raise EntryFileError("magic", f"not a hybridkv entry ({magic!r})")
        if version != FILE_VERSION or header_bytes != HEADER_BYTES:
            raise EntryFileError("version", f"file version {version}, header {header_bytes} B")
        if file_fp != fingerprint:
            raise EntryFileError("layout", f"written for layout {file_fp.hex()}")
        if (chunk_key, group) != split_group_key(key):
            raise EntryFileError("key", "holds another entry than its name says")
        size = os.fstat(f.fileno()).st_size
        if size != HEADER_BYTES + n:
            raise EntryFileError("truncated", f"{size} bytes on disk, header says {n} + header")
        out = alloc(n)
        view = memoryview(out.numpy()).cast("B")
        h = xxhash.xxh3_64(head[:_CHECKSUMMED])
        got = 0
        while got < n:
            r = f.readinto(view[got : got + _READ_PIECE])
            if not r:
                raise EntryFileError("truncated", f"file ended after {got} of {n} bytes")
            h.update(view[got : got + r])  # while the piece is still in cache
            got += r
        if h.intdigest() != checksum:
            raise EntryFileError("checksum", "payload or header changed since written")
        return out
