"""Entry files: a 64-byte self-describing header, the canonical payload, and with an
integrity key a MAC trailer; on disk, and as values of the Redis tier.

The format is documented in docs/format.md. Reading checks every header field, the
payload size the caller expects (before anything is allocated), a checksum over header
and payload and, when keyed, a MAC, before any byte can reach a KV cache. A mismatch
raises `EntryFileError` naming the reason; `damaged` tells a tier whether no reader at
all can use the entry (deleted) or another writer's reader may (left alone).

Files and in-memory values (`encode_entry`, `decode_entry`) go through the same code:
one format, one set of checks.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hmac
import mmap
import os
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import BinaryIO, Protocol

import blake3
import torch
import xxhash

from hybridkv.core.keys import KEY_BYTES, split_group_key
from hybridkv.core.tiers.files import NotRegularFile, open_regular

# The magic never changes and the version follows it in every format to come: a file
# with another magic is no hybridkv entry, one with another version may be a newer one.
MAGIC = b"HYBRIDKV"
FILE_VERSION = 1
_PREFIX = struct.Struct("<8sH")
# magic, file version, header bytes, group id, flags, layout fingerprint, chunk key,
# payload bytes, checksum: little-endian, 64 bytes.
_HEADER = struct.Struct(f"<8sHHHH16s{KEY_BYTES}sQQ")
HEADER_BYTES = _HEADER.size
_CHECKSUMMED = HEADER_BYTES - 8  # the checksum covers every header byte before it
FLAG_MAC = 1  # a keyed blake3 MAC of header and payload follows the payload
MAC_BYTES = 32
_MAC_CONTEXT = "hybridkv 2025 entry file MAC key v1"
# Reads go in pieces that stay in the CPU cache until hashed (bench/copy_path.py).
_READ_PIECE = 256 << 10
# Direct reads (O_DIRECT) move whole aligned blocks into a page-aligned buffer per thread.
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096  # the largest logical block size of common devices
_DIRECT_BUFFER = 1 << 20
_direct_buffers = threading.local()
# Files another reader may still use: another format version, another integrity key (or
# none), or no regular file at all. They are misses, never deleted.
KEPT_REASONS = frozenset({"version", "keyed", "unkeyed", "mac", "not_regular"})


class EntryFileError(Exception):
    """A file that must not be used; `reason` is one word for counting and logs."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        # (st_dev, st_ino) of the file read, so that only that file is ever deleted.
        self.file_id: tuple[int, int] | None = None

    @property
    def damaged(self) -> bool:
        """No reader of any hybridkv version or key can use the file."""
        return self.reason not in KEPT_REASONS


def derive_mac_key(integrity_key: str) -> bytes:
    """The 32-byte MAC key of an `integrity_key` setting (blake3 key derivation)."""
    h = blake3.blake3(derive_key_context=_MAC_CONTEXT)
    h.update(integrity_key.encode())
    return h.digest()


def file_bytes(payload_bytes: int, keyed: bool) -> int:
    """The size of an entry file holding `payload_bytes`."""
    return HEADER_BYTES + payload_bytes + (MAC_BYTES if keyed else 0)


def _checksum(head: bytes, payload: memoryview) -> int:
    h = xxhash.xxh3_64(head[:_CHECKSUMMED])
    h.update(payload)
    return h.intdigest()


def encode_entry(
    fingerprint: bytes,
    key: bytes,
    entry: torch.Tensor,
    mac_key: bytes | None = None,
) -> list[bytes | memoryview]:
    """An entry's file as pieces, in order: header, payload (a view of `entry`, not a
    copy) and, under `mac_key`, the MAC trailer."""
    chunk_key, group = split_group_key(key)
    payload = memoryview(entry.numpy()).cast("B")
    flags = FLAG_MAC if mac_key is not None else 0
    head = _HEADER.pack(
        MAGIC, FILE_VERSION, HEADER_BYTES, group, flags, fingerprint, chunk_key, len(payload), 0
    )
    head = head[:_CHECKSUMMED] + _checksum(head, payload).to_bytes(8, "little")
    pieces: list[bytes | memoryview] = [head, payload]
    if mac_key is not None:
        mac = blake3.blake3(head, key=mac_key)
        mac.update(payload)
        pieces.append(mac.digest())
    return pieces


def write_entry(
    f: BinaryIO,
    fingerprint: bytes,
    key: bytes,
    entry: torch.Tensor,
    mac_key: bytes | None = None,
) -> int:
    """Write one entry to `f` (with a MAC trailer under `mac_key`); returns the file's size."""
    pieces = encode_entry(fingerprint, key, entry, mac_key)
    for piece in pieces:
        f.write(piece)
    return sum(memoryview(p).nbytes for p in pieces)


def claimed_bytes(head: bytes) -> int | None:
    """The whole size (header, payload, MAC) a header claims, unverified: how much of an
    entry split into parts is still to come. None: no header of this format version."""
    if len(head) < HEADER_BYTES:
        return None
    magic, version, _, _, flags, _, _, n, _ = _HEADER.unpack_from(head)
    if magic != MAGIC or version != FILE_VERSION:
        return None
    return file_bytes(n, bool(flags & FLAG_MAC))


def new_entry(nbytes: int) -> torch.Tensor:
    """A fresh host entry (the default place a read lands)."""
    return torch.empty(nbytes, dtype=torch.int8)


def read_entry(
    path: str | os.PathLike,
    fingerprint: bytes,
    key: bytes,
    *,
    payload_bytes: int | None = None,
    alloc: Callable[[int], torch.Tensor] = new_entry,
    mac_key: bytes | None = None,
    direct: bool = False,
    keep: bool = True,
) -> torch.Tensor:
    """Read and verify one entry into `alloc(payload bytes)`.

    `payload_bytes`: the size an entry of this key has (None: whatever the header says,
    still checked against the file's size). `mac_key`: read only files with a MAC under
    this key (None: only files without one). `direct`: read past the page cache
    (O_DIRECT; through it where the filesystem refuses). `keep` False: only verify, the
    payload passing through one piece's buffer (returned, holding its last piece), so
    that a header claiming any size the file has (sparse: no disk) costs no memory.
    Raises EntryFileError, or OSError (missing, I/O). A symbolic link is never followed;
    a FIFO never blocks.
    """
    try:
        fd, st = open_regular(path)
    except NotRegularFile as e:
        raise EntryFileError("not_regular", str(e)) from e
    with open(fd, "rb", buffering=0) as f:
        source = _DirectFile(fd) if direct and _set_direct(fd, True) else f
        try:
            return _read(source, st.st_size, fingerprint, key, payload_bytes, alloc, mac_key, keep)
        except EntryFileError as e:
            e.file_id = (st.st_dev, st.st_ino)
            raise


def supports_direct_reads(path: str | os.PathLike) -> bool:
    """Whether the filesystem holding the regular file `path` serves O_DIRECT reads."""
    try:
        fd, _ = open_regular(path)
    except OSError:
        return False
    try:
        if not _set_direct(fd, True):
            return False
        _DirectFile(fd).fill(0, fallback=False)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; False where the filesystem (or OS) refuses."""
    if not _O_DIRECT:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError:
        return False
    return True


class _Readable(Protocol):
    def read(self, n: int, /) -> bytes: ...
    def readinto(self, view: memoryview, /) -> int | None: ...


class _ReadsByInto(ABC):
    """`read` for a source that has `readinto`."""

    @abstractmethod
    def readinto(self, view: memoryview, /) -> int: ...

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        got = 0
        while got < n and (r := self.readinto(memoryview(out)[got:])):
            got += r
        return bytes(out[:got])


class _DirectFile(_ReadsByInto):
    """An entry file opened with O_DIRECT, read like a file.

    Past the page cache, a read spends no host CPU on page-cache pages or readahead and
    leaves no second copy of entries the CPU tier holds: restores finished sooner while
    the engine's forward used the cores, and slower on an idle host, whose readahead
    keeps the device busier (docs/benchmarks.md, so it is an option, off by default). The
    device moves whole aligned blocks into this thread's page-aligned buffer, and the
    bytes are copied out from there without the GIL (ctypes): the payload starts 64
    bytes into the file, so it cannot land in its destination directly. Should the
    filesystem refuse a direct read (it took O_DIRECT at open but wants coarser
    alignment), the rest of the file is read through the page cache.
    """

    def __init__(self, fd: int):
        self._fd = fd
        if not hasattr(_direct_buffers, "buf"):
            _direct_buffers.buf = mmap.mmap(-1, _DIRECT_BUFFER)
            _direct_buffers.addr = ctypes.addressof(ctypes.c_char.from_buffer(_direct_buffers.buf))
        self._buf: mmap.mmap = _direct_buffers.buf
        self._addr: int = _direct_buffers.addr
        self._start = self._end = self._pos = 0  # the buffer holds file bytes [start, end)

    def fill(self, start: int, fallback: bool = True) -> None:
        """Read the buffer's worth of the file from `start` (aligned)."""
        try:
            got = os.preadv(self._fd, [self._buf], start)
        except OSError as e:
            if not fallback or e.errno != errno.EINVAL or not _set_direct(self._fd, False):
                raise
            got = os.preadv(self._fd, [self._buf], start)
        self._start, self._end = start, start + got

    def readinto(self, view: memoryview, /) -> int:
        if not len(view):
            return 0
        if not self._start <= self._pos < self._end:
            self.fill(self._pos - self._pos % _DIRECT_ALIGN)
            if self._pos >= self._end:
                return 0
        n = min(len(view), self._end - self._pos)
        dest = ctypes.addressof(ctypes.c_char.from_buffer(view))
        ctypes.memmove(dest, self._addr + self._pos - self._start, n)
        self._pos += n
        return n


class _Buffers(_ReadsByInto):
    """An entry held in memory (one value, or the parts it was split into, in order),
    read like a file: what `_read` needs of one."""

    def __init__(self, parts: Sequence[bytes | memoryview]):
        self._parts = [memoryview(p).cast("B") for p in parts]
        self.size = sum(p.nbytes for p in self._parts)
        self._part = self._pos = 0

    def readinto(self, view: memoryview) -> int:
        """Copy up to `len(view)` bytes, never past the end of a part (a short read)."""
        while self._part < len(self._parts):
            src = self._parts[self._part][self._pos : self._pos + len(view)]
            if src.nbytes:
                view[: src.nbytes] = src
                self._pos += src.nbytes
                return src.nbytes
            self._part, self._pos = self._part + 1, 0
        return 0


def decode_entry(
    parts: Sequence[bytes | memoryview],
    fingerprint: bytes,
    key: bytes,
    *,
    payload_bytes: int | None = None,
    alloc: Callable[[int], torch.Tensor] = new_entry,
    mac_key: bytes | None = None,
) -> torch.Tensor:
    """Verify one entry held in memory (an entry file's bytes, whole or as the parts it
    was split into, in order) and copy its payload into `alloc(payload bytes)`.

    Checks and arguments as `read_entry`; raises EntryFileError."""
    buffers = _Buffers(parts)
    return _read(buffers, buffers.size, fingerprint, key, payload_bytes, alloc, mac_key)


def _read(
    f: _Readable,
    size: int,
    fingerprint: bytes,
    key: bytes,
    payload_bytes: int | None,
    alloc: Callable[[int], torch.Tensor],
    mac_key: bytes | None,
    keep: bool = True,
) -> torch.Tensor:
    head = f.read(HEADER_BYTES)
    if len(head) < _PREFIX.size:
        raise EntryFileError("truncated", f"{len(head)}-byte file")
    magic, version = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise EntryFileError("magic", f"not a hybridkv entry ({magic!r})")
    if version != FILE_VERSION:
        raise EntryFileError("version", f"file version {version}, not {FILE_VERSION}")
    if len(head) < HEADER_BYTES:
        raise EntryFileError("truncated", f"{len(head)}-byte header")
    _, _, header_bytes, group, flags, file_fp, chunk_key, n, checksum = _HEADER.unpack(head)
    if header_bytes != HEADER_BYTES or flags & ~FLAG_MAC:
        raise EntryFileError("header", f"header {header_bytes} B, flags {flags:#x}")
    if file_fp != fingerprint:
        raise EntryFileError("layout", f"written for layout {file_fp.hex()}")
    if (chunk_key, group) != split_group_key(key):
        raise EntryFileError("key", "holds another entry than its name says")
    if payload_bytes is not None and n != payload_bytes:
        raise EntryFileError("size", f"{n}-byte payload, the layout's entries hold {payload_bytes}")
    keyed = bool(flags & FLAG_MAC)
    if size != file_bytes(n, keyed):
        raise EntryFileError("truncated", f"{size} bytes on disk, header says {n} + header")
    if keyed != (mac_key is not None):
        raise EntryFileError(
            "keyed" if keyed else "unkeyed",
            "written with an integrity key" if keyed else "written without an integrity key",
        )
    out = alloc(n) if keep else new_entry(min(n, _READ_PIECE))
    view = memoryview(out.numpy()).cast("B")
    h = xxhash.xxh3_64(head[:_CHECKSUMMED])
    mac = blake3.blake3(head, key=mac_key) if mac_key is not None else None
    got = 0
    while got < n:
        at = got if keep else 0
        r = f.readinto(view[at : at + min(_READ_PIECE, n - got)])
        if not r:
            raise EntryFileError("truncated", f"file ended after {got} of {n} bytes")
        h.update(view[at : at + r])  # while the piece is still in cache
        if mac is not None:
            mac.update(view[at : at + r])
        got += r
    if h.intdigest() != checksum:
        raise EntryFileError("checksum", "payload or header changed since written")
    if mac is not None:
        trailer = f.read(MAC_BYTES)
        if len(trailer) < MAC_BYTES:
            raise EntryFileError("truncated", "file ended in its MAC")
        if not hmac.compare_digest(trailer, mac.digest()):
            raise EntryFileError("mac", "written under another integrity key, or forged")
    return out
