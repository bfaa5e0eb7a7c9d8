"""The worker's lifecycle: its states, the moves allowed between them, and how a shutdown is awaited
to its end. :class:`~aiokv.worker.KVWorker` is the only user; ``WorkerState`` is public as
``aiokv.WorkerState``."""

from __future__ import annotations

import asyncio
import enum

from .errors import WorkerClosedError


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


def calling_loop(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
    """``loop`` (the worker's), which must be the one running this call: a worker serves only the loop
    it was started on (a request put on another loop's queue would stay pending forever)."""
    try:
        current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    if current is loop:
        return loop
    if loop.is_closed():
        raise WorkerClosedError(
            "the worker's event loop is closed: a KVWorker serves only the event loop it was started "
            "on (one asyncio.run()); create a new KVWorker for this loop"
        )
    raise RuntimeError(
        "a KVWorker must be called on the event loop it was started on"
        + (" (no event loop runs in this thread)" if current is None else ", not from another one")
    )
