"""Every status code aiokv speaks, in one ``IntEnum``: the store's and aiokv's own.

A backend answers each key of a batch call with a code: ``>= 0`` success (for a get, the bytes read),
``< 0`` an error. The negative codes are Mooncake's where Mooncake has one, so the same numbers mean the
same thing whichever backend answered. aiokv adds three public codes of its own for chunks whose outcome
another request decided, one for a value that failed verification (``VERIFY_FAILED``), and two
internal markers that never leave the worker.

Public results (``StoreResult.errors`` / ``LoadResult.errors``) and ``stats()["backend_errors"]`` hold
only :data:`PUBLIC_ERROR_CODES` and codes a backend answered.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    OK = 0
    # -- Mooncake's codes (mooncake-store ErrorCode); MemoryBackend answers the same ones ---------
    INTERNAL = -1  # INTERNAL_ERROR: the client could not ask the master
    NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the store is full
    INVALID = -600  # INVALID_PARAMS: a bad argument, or a region outside registered memory
    NOT_FOUND = -704  # OBJECT_NOT_FOUND: the key is absent
    ALREADY_EXISTS = -705  # OBJECT_ALREADY_EXISTS
    LEASE_HELD = -706  # OBJECT_HAS_LEASE: a remove right after a get (use force=True)
    TRANSFER_FAILED = -800  # TRANSFER_FAIL: a size mismatch or a failed transfer
    UNAVAILABLE = -900  # RPC_FAIL: the store cannot be reached
    # -- aiokv's own public codes: a store chunk another request was writing ------------------------
    WRITER_CANCELLED = -10  # the request that was to write the chunk went away before writing it
    BACKEND_EXCEPTION = -11  # the batch call writing the chunk raised instead of answering
    WRITE_IN_PROGRESS = -12  # the put answered success, but another writer's bytes never became readable
    # -- aiokv's own public code: a value read whole that failed its check (aiokv.VerifiedBackend) ---
    VERIFY_FAILED = -13  # its checksum, key or fingerprint did not match: the chunk is recomputed
    # -- aiokv's internal markers: never in a result ------------------------------------------------
    PRESENT = 1  # a store chunk already in the store, or written by another request
    PENDING = -(1 << 40)  # not decided yet
    NOT_ATTEMPTED = -(1 << 41)  # a load chunk after the first missing one


# A store chunk this request wrote: success, as the backend's own 0.
WRITTEN = Code.OK

INTERNAL_CODES = frozenset({Code.PENDING, Code.NOT_ATTEMPTED})
PUBLIC_ERROR_CODES = frozenset(code for code in Code if code < 0 and code not in INTERNAL_CODES)


def code_name(code: int) -> str:
    """The name of a known code (``"NOT_FOUND"``), else the number as text."""
    try:
        return Code(code).name
    except ValueError:
        return str(code)
