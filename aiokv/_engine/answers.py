"""A backend call's answer (its result, or the exception it raised) into per-key codes, counted in the
stats and logged by code name; the aiokv error a failed call hands on; and the store-pressure backoff
an answer of "full" (-200) starts (:class:`PressureBackoff`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sized
from typing import Protocol

import numpy as np

from .._arrays import IntArray
from ..codes import WRITTEN, Code, code_name
from ..errors import AiokvError, BackendError, BackendUnavailableError, WorkerClosedError
from ..stats import Op, WorkerStats

logger = logging.getLogger("aiokv")


class StoreRoom(Protocol):
    """What hears whether the store found room for a put call (the lookups' lease ledger)."""

    def store_full(self) -> None: ...

    def store_took(self) -> None: ...


class PressureBackoff:
    """After the store answers "full" (-200), stores pause for a while (their missing chunks fail
    ``NO_SPACE`` without a call) instead of hammering a full store. ``room`` hears every put call's
    verdict: "full", or taken whole."""

    def __init__(self, seconds: float, stats: WorkerStats, room: StoreRoom | None = None) -> None:
        self._seconds = seconds
        self._stats = stats
        self._until = 0.0
        self._room = room

    @property
    def enabled(self) -> bool:
        return self._seconds > 0

    def active(self) -> bool:
        return asyncio.get_running_loop().time() < self._until

    def enter(self) -> None:
        now = asyncio.get_running_loop().time()
        if now >= self._until:
            self._stats.pressure_backoffs += 1
            logger.warning("aiokv: store full (-200); backing off stores for %.2f s", self._seconds)
        self._until = now + self._seconds

    def full(self) -> None:
        """A put call answered "no space" for some key."""
        if self._room is not None:
            self._room.store_full()
        if self.enabled:
            self.enter()

    def took(self) -> None:
        """A put call wrote every key."""
        if self._room is not None:
            self._room.store_took()


def answer_codes(
    op: Op,
    keys: Sized,
    sizes: IntArray,
    answer: object,
    stats: WorkerStats,
    backoff: PressureBackoff,
) -> tuple[IntArray, BaseException | None]:
    """Per-key codes of one batch put/get (``answer``: its result, or the Exception it raised), and
    the error to hand on when the call failed as a whole."""
    if isinstance(answer, Exception) or len(answer) != len(keys):  # type: ignore[arg-type]
        exc = (
            answer
            if isinstance(answer, Exception)
            else BackendError(f"batch_{op.value} answered {len(answer)} codes for {len(keys)} keys")  # type: ignore[arg-type]
        )
        stats.backend_exceptions[op] += 1
        logger.warning("aiokv: batch_%s of %d keys failed: %s", op.value, len(keys), exc)
        return _all(len(keys), Code.BACKEND_EXCEPTION), batch_error(f"batch_{op.value}", exc)
    try:
        codes = np.asarray(answer, dtype=np.int64)
        if codes.shape != (len(keys),):
            raise ValueError(f"shape {codes.shape}")
    except (TypeError, ValueError, OverflowError) as exc:
        stats.backend_exceptions[op] += 1
        error = BackendError(f"batch_{op.value} answered something other than one int code per key: {exc}")
        return _all(len(keys), Code.BACKEND_EXCEPTION), error
    # The worker's sizes are often one row broadcast over every key: sum it once.
    broadcast = sizes.strides[0] == 0
    if broadcast and codes.size:
        # The usual answer (every key written, or read in full) in three NumPy calls instead of eight:
        # the loop handles one answer per call, dozens per batch.
        row_total = int(sizes[0].sum())
        if op is Op.PUT and int(codes.min()) >= 0:
            stats.bytes[op] += row_total * codes.size
            backoff.took()
            return _all(codes.size, WRITTEN), None
        if op is Op.GET and bool((codes == row_total).all()):
            stats.bytes[op] += row_total * codes.size
            return codes, None
    expected = np.full(len(sizes), int(sizes[0].sum())) if broadcast else sizes.sum(axis=1)
    ok = codes >= 0
    if op is Op.GET:
        # A read reporting another byte count did not fill the blocks as asked.
        codes = np.where(ok & (codes != expected), Code.TRANSFER_FAILED, codes)
        ok = codes >= 0
    else:
        codes = np.where(ok, WRITTEN, codes)
        if (codes == Code.NO_SPACE).any():
            backoff.full()
        elif ok.all():
            backoff.took()
    stats.bytes[op] += int(expected[ok].sum())
    if not ok.all():
        _count_failures(op, codes[~ok], len(keys), stats)
    return codes, None


def _count_failures(op: Op, failed: IntArray, keys: int, stats: WorkerStats) -> None:
    stats.backend_errors.update(failed.tolist())
    if logger.isEnabledFor(logging.WARNING):
        # Counts by code, never the keys: a batch can hold thousands.
        values, counts = np.unique(failed, return_counts=True)
        pairs = zip(values.tolist(), counts.tolist(), strict=True)
        by_code = ", ".join(f"{code_name(v)} ({v}): {n}" for v, n in pairs)
        logger.warning("aiokv: batch_%s: %d of %d keys failed: %s", op.value, failed.size, keys, by_code)


def _all(count: int, code: Code) -> IntArray:
    return np.full(count, code, dtype=np.int64)


def batch_error(call: str, exc: BaseException) -> AiokvError:
    """An aiokv error for a failed backend call, keeping the cause and whether the store is gone."""
    if isinstance(exc, WorkerClosedError):  # terminate() dropped the call before it started
        return WorkerClosedError(f"{call} was not run: {exc}")
    error: BackendError
    if isinstance(exc, BackendUnavailableError):
        error = BackendUnavailableError(f"{call} failed: {exc}", code=exc.code, address=exc.address)
    else:
        error = BackendError(f"{call} failed: {exc}", code=getattr(exc, "code", None))
    error.__cause__ = exc
    return error
