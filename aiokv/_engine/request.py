"""A submitted request as the engine tracks it.

The batch pipeline fills the data fields (hashes, keys, positions, codes, waits). The lifecycle
fields (``state``, ``transfer_planned``, ``running_calls``, ``cancel_requested``, ``timed_out``,
``refused``, ``error``, ``deadline_handle``) are written only by
:class:`~aiokv._engine.tracker.RequestTracker`; everyone else reads them through ``finished`` /
``abandoned``. Users see :class:`~aiokv.futures.TransferFuture` and results only.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._arrays import IntArray
from ..futures import TransferFuture
from ..keys import TokenIds
from ..stats import Kind
from .batch_keys import Cycle


class State(enum.Enum):
    QUEUED = "queued"  # no backend call runs on its memory: queued, preparing, or calls waiting for a thread
    TRANSFERRING = "transferring"  # a backend call started on its memory has not returned yet
    DONE = "done"  # its future is settled


@dataclass(slots=True)
class Wait:
    """Chunks of a store whose outcome another request of ``cycle`` decides (it writes them)."""

    cycle: Cycle
    group: int
    chunks: IntArray
    keys: Sequence[str]


@dataclass(eq=False, slots=True)
class Request:
    id: int
    kind: Kind
    num_chunks: int
    future: TransferFuture[Any]
    submitted: float
    tokens: TokenIds | None = None  # until hashed
    hashes: Sequence[str] | None = None
    blocks: list[IntArray] = field(default_factory=list)  # per group: (num_chunks, blocks per chunk)
    keys: list[list[str]] = field(default_factory=list)  # per group
    positions: list[IntArray] = field(default_factory=list)  # per group: index of each key in its batch
    codes: list[IntArray] = field(default_factory=list)  # per group: outcome of each chunk
    waits: list[Wait] = field(default_factory=list)
    # -- lifecycle: written by the tracker only --
    state: State = State.QUEUED
    transfer_planned: bool = False  # backend calls were planned for it (errors then wait for settle)
    running_calls: int = 0  # backend calls on its memory started and not returned (TRANSFERRING iff > 0)
    cancel_requested: bool = False
    timed_out: bool = False
    refused: bool = False  # the circuit breaker refused one of its calls: answered "unavailable" at settle
    error: BaseException | None = None
    deadline_handle: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return self.state is State.DONE

    @property
    def abandoned(self) -> bool:
        """Finished, or asked to stop: nothing more should be started on its behalf."""
        return self.state is State.DONE or self.cancel_requested or self.timed_out
