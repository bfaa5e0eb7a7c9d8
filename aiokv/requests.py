"""A submitted request as the worker tracks it, and the per-chunk outcome codes it carries.

Internal: users see :class:`~aiokv.futures.TransferFuture` and the result types only.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._arrays import IntArray
from .futures import TransferFuture
from .keys import TokenIds

if TYPE_CHECKING:
    from .batch import Cycle

# Per (chunk, group) outcome codes besides a backend's own (>= 0 success, < 0 failure).
WRITTEN = 0  # this request wrote the chunk
PRESENT = 1  # already stored, or written by another request
PENDING = -(1 << 40)  # not decided yet
NOT_ATTEMPTED = -(1 << 41)  # a load chunk after the first missing one
WRITER_CANCELLED = -10  # the request that was to write a shared chunk went away first
BACKEND_EXCEPTION = -11  # the batch call holding the chunk raised

INTERNAL_CODES = frozenset({PENDING, NOT_ATTEMPTED})


class Kind(enum.Enum):
    STORE = "store"
    LOAD = "load"
    LOOKUP = "lookup"


class State(enum.Enum):
    QUEUED = "queued"  # queued, or in a batch before any backend call on its memory
    TRANSFERRING = "transferring"  # a backend call may be reading or writing its memory
    DONE = "done"


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
    state: State = State.QUEUED
    cancel_requested: bool = False
    timed_out: bool = False
    error: BaseException | None = None
    deadline_handle: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return self.state is State.DONE

    @property
    def abandoned(self) -> bool:
        """Finished, or asked to stop: nothing more should be started on its behalf."""
        return self.state is State.DONE or self.cancel_requested or self.timed_out
