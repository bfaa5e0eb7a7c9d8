"""The worker's lifecycle: its states, the moves allowed between them, and how a shutdown is awaited
to its end. :class:`~aiokv.worker.KVWorker` is the only user; ``WorkerState`` is public through it."""

from __future__ import annotations

import asyncio
import enum


class WorkerState(enum.Enum):
    NEW = "new"  # constructed; start() not called
    RUNNING = "running"  # accepting requests
    CLOSING = "closing"  # close(): no new requests; finishing everything submitted
    TERMINATING = "terminating"  # terminate(): queued work failed; waiting for calls in flight
    CLOSED = "closed"  # backend released, threads stopped


# The one guard of the lifecycle: every change of state goes through KVWorker._move.
NEXT_STATES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.NEW: frozenset({WorkerState.RUNNING, WorkerState.CLOSED}),  # CLOSED: failed start, or close()
    WorkerState.RUNNING: frozenset({WorkerState.CLOSING, WorkerState.TERMINATING}),
    WorkerState.CLOSING: frozenset({WorkerState.TERMINATING, WorkerState.CLOSED}),
    WorkerState.TERMINATING: frozenset({WorkerState.CLOSED}),
    WorkerState.CLOSED: frozenset(),
}


async def to_the_end(task: asyncio.Task[None]) -> None:
    """Await ``task`` to its end, even through cancellations of the caller (the memory contract: a
    shutdown interrupted half-way would leave calls on caller memory and buffers registered)."""
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
    task.result()
