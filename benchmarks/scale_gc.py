"""What the garbage collector walks for requests in flight: for the scale benchmark.

CPython 3.11's full collection is not incremental: it walks every tracked object in one go, on
whichever thread allocates, holding the GIL, so its length is a loop stall no slicing bounds. This
measures it where it is largest for the worker: ``requests`` stores queued (submitted in one go, the
loop not yet turned), and the same requests settled with their results still held by their futures.
Objects that existed before are frozen out (``gc.freeze``), so both figures are the requests' own.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CollectorFigures:
    requests: int
    queued_objects_per_request: float
    queued_full_collection_ms: float  # CPU of one full collection with the requests queued
    settled_objects_per_request: float
    settled_full_collection_ms: float


def _collect() -> tuple[int, float]:
    """Tracked objects (outside the frozen generation) after a full collection, and its CPU ms."""
    started = time.thread_time()
    gc.collect()
    spent = (time.thread_time() - started) * 1e3
    return len(gc.get_objects()), spent


async def collector_figures(
    submit: Callable[[], Sequence[Awaitable[Any]]], requests: int
) -> CollectorFigures:
    """``submit()`` queues ``requests`` requests and returns their futures, which are then awaited.
    Collections run while no backend call does (queued: none started; settled: all returned), so
    no thread builds a tuple ``gc.get_objects`` could catch half made."""
    gc.collect()
    gc.freeze()
    try:
        futures = submit()
        queued, queued_ms = _collect()
        gc.collect()  # once more: the figure is a collection's, not the first one's untracking
        queued_ms = min(queued_ms, _collect()[1])
        for future in futures:
            await future
        settled, settled_ms = _collect()
    finally:
        gc.unfreeze()
    return CollectorFigures(
        requests=requests,
        queued_objects_per_request=queued / requests,
        queued_full_collection_ms=queued_ms,
        settled_objects_per_request=settled / requests,
        settled_full_collection_ms=settled_ms,
    )
