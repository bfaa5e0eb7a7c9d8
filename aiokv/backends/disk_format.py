"""The files of :class:`~aiokv.backends.disk.DiskBackend`: one file per value, and how to name them.

A file is a header block, then the value, each padded with zeros to a multiple of :data:`ALIGN`, so
the value starts and ends on a block boundary (what ``O_DIRECT`` needs) and a file's size follows from
its header alone. Header (little-endian)::

    magic         4s   b"AKVD"
    version       u2   1
    flags         u2   0
    key_length    u4   bytes of the key (UTF-8)
    header_sum    u4   xxh32 of these 32 bytes (this field zero) followed by the key
    value_length  u8   bytes of the value
    value_sum     u8   xxh3-64 of the value
    key           key_length bytes

Names: ``<h[:2]>/<h>-<generation>.kv``, where ``h`` is the xxh3-128 hex digest of the key and the
generation (16 hex digits) a counter of the directory's writes: each value has a path of its own, so a
file can be deleted by name whatever later writes of the same key do. The key itself is in the header:
the index is rebuilt from headers alone. Values are written to ``.aiokv-tmp/<generation>.part`` and
renamed into place, so a file under its final name was written whole (or, without fsync and after a
power loss, may hold what the disk never received: its checksum then fails on read).
"""

from __future__ import annotations

import os
import re
import struct
from typing import NamedTuple

import xxhash

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory on every common device and fs
MAGIC = b"AKVD"
VERSION = 1
_FIXED = struct.Struct("<4sHHIIQQ")
FIXED_BYTES = _FIXED.size  # 32
_SUM_FIELD = slice(12, 16)
TEMP_DIR = ".aiokv-tmp"
TEMP_SUFFIX = ".part"
LOCK_FILE = ".aiokv-lock"
NAME = re.compile(r"([0-9a-f]{32})-([0-9a-f]{16})\.kv")
SHARDS = tuple(f"{i:02x}" for i in range(256))  # a flat directory of millions of files is slow to list
_ZEROS = bytes(ALIGN)


class Header(NamedTuple):
    key: bytes
    value_bytes: int
    value_sum: int


def aligned(size: int) -> int:
    """``size`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-size // ALIGN) * ALIGN


def data_offset(key_bytes: int) -> int:
    """Where the value starts in a file whose key has ``key_bytes`` bytes."""
    return aligned(FIXED_BYTES + key_bytes)


def file_bytes(key_bytes: int, value_bytes: int) -> int:
    """The size of a whole file: what it takes on disk and counts against the capacity."""
    return data_offset(key_bytes) + aligned(value_bytes)


def encode_key(key: str) -> bytes:
    # surrogatepass: any str a caller can pass round-trips, none raises here.
    return key.encode("utf-8", "surrogatepass")


def decode_key(key: bytes) -> str:
    return key.decode("utf-8", "surrogatepass")


def key_digest(key: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(key)


def file_name(key: bytes, generation: int) -> str:
    """The path of a value relative to the directory."""
    digest = key_digest(key)
    return os.path.join(digest[:2], f"{digest}-{generation:016x}.kv")


def pack_header(target: memoryview, key: bytes, value_bytes: int, value_sum: int) -> int:
    """Write the header block of a value into ``target`` (its first :func:`data_offset` bytes, the
    padding zeroed); answer its length."""
    fixed = bytearray(_FIXED.pack(MAGIC, VERSION, 0, len(key), 0, value_bytes, value_sum))
    fixed[_SUM_FIELD] = xxhash.xxh32_intdigest(bytes(fixed) + key).to_bytes(4, "little")
    end = data_offset(len(key))
    target[:FIXED_BYTES] = fixed
    target[FIXED_BYTES : FIXED_BYTES + len(key)] = key
    for start in range(FIXED_BYTES + len(key), end, ALIGN):
        stop = min(end, start + ALIGN)
        target[start:stop] = _ZEROS[: stop - start]
    return end


def parse_header(block: bytes | memoryview) -> Header | None:
    """The header at the start of ``block``, or None when it is not a whole, intact header."""
    if len(block) < FIXED_BYTES:
        return None
    magic, version, flags, key_length, header_sum, value_bytes, value_sum = _FIXED.unpack_from(block)
    if magic != MAGIC or version != VERSION or flags or len(block) < FIXED_BYTES + key_length:
        return None
    fixed = bytearray(block[:FIXED_BYTES])
    fixed[_SUM_FIELD] = bytes(4)
    key = bytes(block[FIXED_BYTES : FIXED_BYTES + key_length])
    if xxhash.xxh32_intdigest(bytes(fixed) + key) != header_sum:
        return None
    return Header(key, value_bytes, value_sum)


class OtherVersion(Exception):
    """A value file of another format version (a newer aiokv's): neither indexed nor deleted."""


class Found(NamedTuple):
    """A file the index keeps after :func:`inspect`."""

    key: str
    generation: int
    value_bytes: int
    file_bytes: int
    mtime_ns: int


def inspect(path: str, digest: str, generation: int) -> Found | None:
    """Read the header of the file at ``path`` (named after ``digest`` and ``generation``): what the
    index needs, or None when the file is not a whole value (bad header, a size its header disagrees
    with, a key another name's). Reads the header only, never the value. Raises :class:`OtherVersion`
    for a file of another format version."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        block = os.pread(fd, ALIGN, 0)
        if len(block) >= FIXED_BYTES:
            key_length = _FIXED.unpack_from(block)[3]
            if FIXED_BYTES + key_length > len(block) and info.st_size >= data_offset(key_length):
                block = os.pread(fd, FIXED_BYTES + key_length, 0)
    finally:
        os.close(fd)
    if block[:4] == MAGIC and len(block) >= FIXED_BYTES and _FIXED.unpack_from(block)[1] != VERSION:
        raise OtherVersion(path)
    header = parse_header(block)
    if header is None or key_digest(header.key) != digest:
        return None
    size = file_bytes(len(header.key), header.value_bytes)
    if info.st_size != size:
        return None
    return Found(decode_key(header.key), generation, header.value_bytes, size, info.st_mtime_ns)
