"""The record of one backend call a :class:`~aiokv.testing.FaultInjectingBackend` saw."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import Regions

__all__ = ["Call"]


@dataclass(frozen=True, slots=True)
class Call:
    """One call the wrapper saw, recorded when it returned or raised.

    ``keys``, ``region_counts`` and ``nbytes`` describe the call as made (per key: regions and total
    bytes); ``sent`` the keys passed on to the inner backend (none when an injected exception came
    first); ``faulted`` the keys answered by an injected code; ``result`` what the caller got (1/0
    for ``exists``; ``None`` when the call raised, and for ``register``); ``error`` what it raised;
    ``thread`` the name of the thread that made it. ``addrs`` and ``sizes`` are int64 copies of the
    call's region tables (one row per key; ``[[addr]]`` and ``[[size]]`` for ``register``), ``None``
    for calls without regions or with malformed ones.
    """

    op: str
    keys: tuple[str, ...]
    region_counts: tuple[int, ...]
    nbytes: tuple[int, ...]
    sent: tuple[str, ...] = ()
    faulted: tuple[str, ...] = ()
    result: tuple[int, ...] | None = None
    error: BaseException | None = None
    thread: str = ""
    addrs: np.ndarray | None = field(default=None, compare=False, repr=False)
    sizes: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)


def thread_name() -> str:
    return threading.current_thread().name


def region_stats(sizes: Regions | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per key: number of regions and total bytes (empty when the arguments are malformed)."""
    if sizes is None:
        return (), ()
    try:
        if isinstance(sizes, np.ndarray) and sizes.ndim == 2:
            totals = sizes.sum(axis=1, dtype=np.int64).tolist()
            return (int(sizes.shape[1]),) * int(sizes.shape[0]), tuple(int(t) for t in totals)
        return tuple(len(row) for row in sizes), tuple(int(sum(row)) for row in sizes)
    except (TypeError, ValueError, OverflowError):
        return (), ()


def region_copy(regions: Regions | None) -> np.ndarray | None:
    """An int64 copy of a call's addresses or sizes (None when absent or not a rectangular table)."""
    if regions is None:
        return None
    try:
        copy = np.array(regions, dtype=np.int64, copy=True)
    except (TypeError, ValueError, OverflowError):
        return None
    return copy if copy.ndim == 2 else None
