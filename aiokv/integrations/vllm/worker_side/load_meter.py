"""The worker's measurements for the load policy (:mod:`..scheduler_side.load_policy`): how fast
loads land and how fast the engine computes.

A load is timed from its submission until every group's future is done, with the bytes it loaded and
the bytes of this worker's loads still in flight when it was submitted (it queues behind them). A
forward is timed from the moment vLLM binds the step's metadata (just before the forward) to
``wait_for_save`` (just after it); a synchronous load, started before the forward, moves the start to
its end. On CUDA the forward is asynchronous: it is timed with CUDA events, read once they completed.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

from ....results import LoadResult
from ..common.wire import LoadSample, Measurements


class LoadMeter:
    """One worker process's measurements since the last report. ``source``: the store's name;
    ``chunk_bytes``: per KV cache group, the bytes of one chunk on this rank."""

    def __init__(self, source: str, chunk_bytes: Sequence[int], *, on_cuda: bool = False) -> None:
        self.source = source
        self.chunk_bytes = tuple(chunk_bytes)
        self._on_cuda = on_cuda
        self._lock = threading.Lock()  # loads finish on aiokv's threads
        self._loads: list[LoadSample] = []
        self._in_flight: dict[int, int] = {}  # load number -> bytes it asked for
        self._number = 0
        self._steps: list[tuple[int, float]] = []
        self._began: float | None = None
        self._events: list[tuple[int, Any, Any]] = []  # CUDA: (tokens, start event, end event)
        self._start_event: Any = None

    # -- loads ----------------------------------------------------------------------------------

    def load_submitted(
        self,
        futures: Sequence[concurrent.futures.Future[LoadResult]],
        groups: Sequence[int],
        requested_bytes: int,
    ) -> None:
        """One request's load: a future per group in ``groups`` (those it moves chunks of),
        ``requested_bytes`` in all. The sample is taken once every future is done."""
        if not futures:
            return
        started = time.monotonic()
        with self._lock:
            self._number += 1
            number = self._number
            ahead = sum(self._in_flight.values())
            self._in_flight[number] = requested_bytes
        remaining = [len(futures)]

        def one_done(_: concurrent.futures.Future[LoadResult]) -> None:
            with self._lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
                self._in_flight.pop(number, None)
            seconds = time.monotonic() - started
            loaded = 0
            for group, future in zip(groups, futures, strict=True):
                if not future.cancelled() and future.exception() is None:
                    loaded += future.result().loaded_chunks * self.chunk_bytes[group]
            if loaded:  # a load that moved nothing measured an error, not the store's speed
                with self._lock:
                    self._loads.append(LoadSample(self.source, loaded, ahead, seconds))

        for future in futures:
            future.add_done_callback(one_done)

    # -- forwards -------------------------------------------------------------------------------

    def forward_begins(self) -> None:
        if self._on_cuda:
            import torch

            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._began = time.monotonic()

    def sync_loads_done(self) -> None:
        """A synchronous load ran before the forward: the forward begins now."""
        self.forward_begins()

    def exclude(self, seconds: float) -> None:
        """The forward waited ``seconds`` for a layer group's load: not the engine's compute time (on
        CUDA the forward's events still span the wait)."""
        if self._began is not None:
            self._began += seconds

    def forward_ended(self, tokens: int) -> None:
        began, self._began = self._began, None
        if began is None or tokens <= 0:
            return
        if self._on_cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((tokens, self._start_event, end))
            return
        self._steps.append((tokens, time.monotonic() - began))

    def _completed_events(self) -> None:
        pending = []
        for tokens, start, end in self._events:
            if end.query():
                self._steps.append((tokens, start.elapsed_time(end) / 1000.0))
            else:
                pending.append((tokens, start, end))
        self._events = pending

    # -- the report -----------------------------------------------------------------------------

    def take(self) -> Measurements | None:
        """What was measured since the last call (None if nothing)."""
        self._completed_events()
        with self._lock:
            loads, self._loads = self._loads, []
        steps, self._steps = self._steps, []
        measured = Measurements(loads, steps)
        return measured if measured else None
