"""The header a verified value carries after its bytes, and what a read header can be found to break.

Layout (64 bytes, little-endian), appended as one more region after a key's regions::

    magic    4s   b"AKV1"
    version  u2   1
    reserved u2   0
    length   u8   bytes of the value before the header
    checksum u8   xxh3-64 of those bytes (streamed over the key's regions, so any split of the same
                  bytes into regions gives the same checksum)
    key      16s  xxh3-128 of the key (UTF-8): a well-formed value found under another key fails
    print    16s  xxh3-128 of the fingerprint: what the bytes mean (dtype, geometry, layout, model, ISA)
    padding  8x

Neither digest is a defence against an attacker who can write the store (xxh3 is not cryptographic);
they catch corruption, store bugs and incompatible writers.
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt
import xxhash

HEADER_BYTES = 64
MAGIC = b"AKV1"
VERSION = 1

HEADER_DTYPE = np.dtype(
    {
        "names": ["magic", "version", "reserved", "length", "checksum", "key", "fingerprint"],
        "formats": ["S4", "<u2", "<u2", "<u8", "<u8", "S16", "S16"],
        "offsets": [0, 4, 6, 8, 16, 24, 40],
        "itemsize": HEADER_BYTES,
    }
)
Headers = npt.NDArray[np.void]


class Mismatch(enum.StrEnum):
    """Why a value read failed verification (the first check it failed, in this order)."""

    FORMAT = "format"  # no header of this version where the header should be: not a verified value
    LENGTH = "length"  # the header describes a value of another size
    IDENTITY = "identity"  # a well-formed value of another key
    FINGERPRINT = "fingerprint"  # written by an engine whose KV means something else
    CHECKSUM = "checksum"  # the bytes changed after they were written


def digest(data: bytes) -> bytes:
    """The 16-byte digest of the key and fingerprint fields."""
    return xxhash.xxh3_128_digest(data)


def key_digests(keys: list[str]) -> npt.NDArray[np.bytes_]:
    """Per key, its 16-byte digest (UTF-8), as an ``S16`` array."""
    return np.array([xxhash.xxh3_128_digest(key.encode()) for key in keys], dtype="S16")


def fill(
    headers: Headers,
    lengths: npt.NDArray[np.int64],
    checksums: list[int],
    keys: list[str],
    fingerprint: bytes,
) -> None:
    """Write one header per key into ``headers`` (a view of registered memory)."""
    headers["magic"] = MAGIC
    headers["version"] = VERSION
    headers["reserved"] = 0
    headers["length"] = lengths
    headers["checksum"] = np.asarray(checksums, dtype=np.uint64)
    headers["key"] = key_digests(keys)
    headers["fingerprint"] = fingerprint


MISMATCHES = tuple(Mismatch)  # :func:`mismatches` answers indexes into this (-1: none)
NO_MISMATCH = -1


def mismatches(
    headers: Headers, lengths: npt.NDArray[np.int64], keys: list[str], fingerprint: bytes
) -> npt.NDArray[np.int8]:
    """Per header, the first check of its framing it fails, as an index into :data:`MISMATCHES`, or
    :data:`NO_MISMATCH` (the checksum is checked apart, as it needs the bytes). Vectorised: no Python
    work per key beyond its key's digest."""
    failed = [  # in the order of MISMATCHES
        (headers["magic"] != MAGIC) | (headers["version"] != VERSION),
        headers["length"] != lengths.astype(np.uint64),
        headers["key"] != key_digests(keys),
        headers["fingerprint"] != fingerprint,
    ]
    return np.select(failed, list(range(len(failed))), default=NO_MISMATCH).astype(np.int8)
