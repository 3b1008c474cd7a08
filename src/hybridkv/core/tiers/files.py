"""Opening and creating files in a directory that other processes (or users) may write to.

A shared `disk_path` is untrusted: anything can sit under an entry's name. A read must
never follow a symbolic link, block on a FIFO or read a directory or device, so it opens
with O_NOFOLLOW | O_NONBLOCK and checks the open file is a regular one. A write creates
its file exclusively (O_EXCL, no link followed) under a random name, with exactly the
configured permissions whatever the process umask.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegularFile(OSError):
    """The name holds a symbolic link, directory, FIFO, socket or device."""


def dir_mode(file_mode: int) -> int:
    """Directory permissions matching file permissions: search (x) wherever read or write
    is allowed (0o600 -> 0o700, 0o660 -> 0o770, 0o644 -> 0o755)."""
    return file_mode | (file_mode & 0o444) >> 2 | (file_mode & 0o222) >> 1


@contextmanager
def real_parent(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """A descriptor of `path`'s directory, opened without following a link, and `path`'s
    name in it: whoever may write the directory above cannot redirect a read, touch or
    unlink there by putting a link in the directory's place. NotRegularFile if a link
    (or anything but a directory) holds the directory's name."""
    path = Path(path)
    try:
        dir_fd = os.open(path.parent, DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotRegularFile(e.errno, "its directory is not a real one", str(path)) from e
        raise
    try:
        yield dir_fd, path.name
    finally:
        os.close(dir_fd)


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at `path` and its stat; raises
    NotRegularFile for anything else (a link is never followed, nor in place of its
    directory: `real_parent`), OSError if it cannot."""
    try:
        with real_parent(path) as (dir_fd, name):
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW refused a link
            raise NotRegularFile(e.errno, "a symbolic link", str(path)) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(0, f"not a regular file (mode {st.st_mode:o})", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a small regular file (at most `limit`); ValueError if it is larger."""
    fd, st = open_regular(path)
    with open(fd, "rb", buffering=0) as f:
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than {limit}")
        return f.read(limit)


def create_exclusive(name: str, mode: int, dir_fd: int | None = None) -> int:
    """A write descriptor of a new file `name` (in `dir_fd` when given) with permissions
    exactly `mode`; FileExistsError if anything, even a dangling link, holds the name."""
    fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # the umask must not narrow a shared directory's mode
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(path: Path, mode: int) -> None:
    """Create directory `path` with permissions exactly `mode`; one that exists is left
    as it is (it may belong to someone else)."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    os.chmod(path, mode)
