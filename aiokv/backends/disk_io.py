"""The system calls of :class:`~aiokv.backends.disk.DiskBackend`: whole ``pwritev``/``preadv`` over
many buffers (both release the GIL), page-aligned buffers for ``O_DIRECT``, the probe that finds
whether a directory's file system takes ``O_DIRECT`` at all, and opening a directory (its lock, its
subdirectories, and a clear exception when it cannot be used).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..errors import BackendError
from .disk_format import ALIGN, LOCK_FILE, SHARDS

logger = logging.getLogger("aiokv.backends.disk")  # one logger for everything DiskBackend says

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
# Where the file system or the caller's memory refuses O_DIRECT (EINVAL) and where the disk is full.
NO_DIRECT_ERRNOS = frozenset({errno.EINVAL, errno.EOPNOTSUPP})
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
STAGE_BYTES = 8 << 20  # a thread's aligned staging buffer: values larger than this move in pieces


class AlignedBuffer:
    """Anonymous memory, page-aligned (``O_DIRECT`` reads and writes through it) and zero-filled."""

    __slots__ = ("_map", "view", "array")

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, max(ALIGN, size))
        self.view = memoryview(self._map)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.view)


class Scratch(threading.local):
    """Each thread's aligned buffers, allocated on first use and kept: the worker's transfer threads
    live as long as the worker, and faulting fresh pages in per call would cost more than the copy."""

    def __init__(self) -> None:
        self.buffers: dict[str, AlignedBuffer] = {}

    def get(self, name: str, size: int) -> AlignedBuffer:
        buffer = self.buffers.get(name)
        if buffer is None or len(buffer) < size:
            buffer = self.buffers[name] = AlignedBuffer(aligned_up(size))
        return buffer


def aligned_up(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def write_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Write ``views`` back to back at ``offset``, resuming after short writes; answer the bytes
    written. A write that makes no progress raises ``OSError``."""
    pending = list(views)
    first = 0
    total = 0
    while first < len(pending):
        done = os.pwritev(fd, pending[first : first + IOV_MAX], offset)
        if done <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        total += done
        first = _advance(pending, first, done)
    return total


def read_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill ``views`` back to back from ``offset``, resuming after short reads, until the end of the
    file; answer the bytes read (fewer than asked: the file ended)."""
    pending = list(views)
    first = 0
    total = 0
    while first < len(pending):
        done = os.preadv(fd, pending[first : first + IOV_MAX], offset)
        if done <= 0:
            break
        offset += done
        total += done
        first = _advance(pending, first, done)
    return total


def _advance(pending: list[memoryview], first: int, done: int) -> int:
    """Drop the first ``done`` bytes of ``pending[first:]``; answer the index of the first left."""
    while done and first < len(pending):
        size = len(pending[first])
        if done < size:
            pending[first] = pending[first][done:]
            return first
        done -= size
        first += 1
    while first < len(pending) and not len(pending[first]):
        first += 1
    return first


def probe_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be written and read with ``O_DIRECT`` (False on a file system
    that refuses it, e.g. tmpfs before Linux 6.6). Other errors propagate."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f"probe-{os.getpid()}-{threading.get_ident()}.part")
    buffer = AlignedBuffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno in NO_DIRECT_ERRNOS:
            return False
        raise
    try:
        os.pwritev(fd, [buffer.view], 0)
        return os.preadv(fd, [buffer.view], 0) == ALIGN
    except OSError as exc:
        if exc.errno in NO_DIRECT_ERRNOS:
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(path)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the space stays used on disk; the index no longer counts it
        logger.warning("aiokv: DiskBackend could not delete %s: %s", path, exc)


def fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_directory(directory: str) -> int:
    """Create ``directory`` if missing and take its lock; the lock file's descriptor. Raises
    ``ValueError`` when the path is not a directory, ``PermissionError`` when it cannot be written,
    ``BackendError`` when another DiskBackend holds it."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"DiskBackend needs a directory, but {directory} is not one")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise open_error(directory, exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BackendError(f"{directory} is in use by another DiskBackend (it holds {LOCK_FILE})") from None
    except OSError as exc:
        os.close(fd)
        raise open_error(directory, exc) from exc
    return fd


def make_subdirectories(directory: str, temp_dir: str) -> None:
    try:
        os.makedirs(temp_dir, exist_ok=True)
        for shard in SHARDS:
            os.makedirs(os.path.join(directory, shard), exist_ok=True)
    except OSError as exc:
        raise open_error(directory, exc) from exc


def choose_direct(directory: str, temp_dir: str, wanted: bool | None) -> bool:
    if wanted is False:
        return False
    try:
        supported = probe_direct(temp_dir)
    except OSError as exc:
        raise open_error(directory, exc) from exc
    if wanted and not supported:
        raise ValueError(f"the file system of {directory} does not take O_DIRECT (direct_io=True)")
    if not supported:
        logger.info("aiokv: DiskBackend %s: the file system refuses O_DIRECT; using buffered I/O", directory)
    return supported


def open_error(directory: str, exc: OSError) -> Exception:
    """The clear exception for an ``OSError`` met while opening ``directory``."""
    if exc.errno in DENIED_ERRNOS:
        return PermissionError(exc.errno, f"DiskBackend cannot write to {directory}: {exc.strerror}")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return ValueError(f"DiskBackend needs a directory, but {directory} cannot be one: {exc}")
    return exc
