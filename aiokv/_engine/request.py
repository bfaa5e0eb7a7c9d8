"""A submitted request as the engine tracks it.

The batch pipeline fills the data fields (hashes, keys, positions, codes, waits). The lifecycle
fields (``state``, ``transfer_planned``, ``running_calls``, ``cancel_requested``, ``timed_out``,
``refused``, ``error``, ``deadline_handle``) are written only by
:class:`~aiokv._engine.tracker.RequestTracker`; everyone else reads them through ``finished`` /
``abandoned``. Users see :class:`~aiokv.futures.TransferFuture` and results only.

Thousands of requests can be in flight, and CPython's full garbage collection walks every tracked
object: so a request holds its per-group data in tuples of arrays (untracked by the first collection
they survive; its keys are object arrays, never tracked) rather than lists, and its future asks the
request itself to cancel (no closure or bound method of its own). Per request in flight the
collector then tracks the request and its future (two objects), 3 objects instead of 15; a settled
future lets go of its request.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._arrays import IntArray
from ..futures import TransferFuture
from ..keys import TokenIds
from ..stats import Kind
from .batch import KeyArray, Keys, Wait


class State(enum.Enum):
    QUEUED = "queued"  # no backend call runs on its memory: queued, preparing, or calls waiting for a thread
    TRANSFERRING = "transferring"  # a backend call started on its memory has not returned yet
    DONE = "done"  # its future is settled


class Canceller(Protocol):
    """What a request's cancellation asks (the tracker): typed here so that this module needs nothing
    of the tracker's, which imports this one."""

    def cancel(self, request: Request, /) -> bool: ...


@dataclass(eq=False, slots=True)
class Request:
    id: int
    kind: Kind
    num_chunks: int
    tracker: Canceller = field(repr=False)  # what a cancellation of its future asks
    submitted: float
    future: TransferFuture[Any] = field(init=False, repr=False)  # set at once: it cancels through self
    tokens: TokenIds | None = None  # until hashed
    hashes: Keys | None = None  # until its keys are built
    blocks: tuple[IntArray, ...] = ()  # per group: (num_chunks, blocks per chunk)
    keys: tuple[KeyArray, ...] = ()  # per group
    positions: tuple[IntArray, ...] = ()  # per group: index of each key in its batch
    codes: tuple[IntArray, ...] = ()  # per group: outcome of each chunk
    waits: tuple[Wait, ...] = ()
    # -- lifecycle: written by the tracker only --
    state: State = State.QUEUED
    transfer_planned: bool = False  # backend calls were planned for it (errors then wait for settle)
    running_calls: int = 0  # backend calls on its memory started and not returned (TRANSFERRING iff > 0)
    cancel_requested: bool = False
    timed_out: bool = False
    refused: bool = False  # the circuit breaker refused one of its calls: answered "unavailable" at settle
    error: BaseException | None = None
    deadline_handle: asyncio.TimerHandle | None = None

    def drop_data(self) -> None:
        """Settled, with no call of it left: let go of its per-chunk data."""
        self.tokens = self.hashes = None
        self.blocks = self.keys = self.positions = self.codes = ()
        self.waits = ()

    def cancel(self) -> bool:
        """What its future's ``cancel()`` asks: the tracker decides (the one writer of the lifecycle)."""
        return self.tracker.cancel(self)

    @property
    def finished(self) -> bool:
        return self.state is State.DONE

    @property
    def abandoned(self) -> bool:
        """Finished, or asked to stop: nothing more should be started on its behalf."""
        return self.state is State.DONE or self.cancel_requested or self.timed_out
