"""Awaitable handles on submitted transfers.

A :class:`TransferFuture` is done only when no backend can touch the request's memory any more; that
is the moment an engine may reuse the blocks. Awaiting it is shielded: a caller's timeout (e.g.
``asyncio.wait_for``) stops the waiting, not the transfer, and the future stays not-done until the
backend call has returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Cancellable(Protocol):
    """What a future asks to cancel its transfer: the request itself (no hook object of its own, one
    fewer object for the garbage collector per request in flight)."""

    def cancel(self) -> bool: ...


class TransferFuture(Generic[T]):
    """Handle on one store or load; created by the worker, never by users."""

    __slots__ = ("_future", "_owner", "kind", "request_id")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, request_id: int, kind: str, owner: Cancellable
    ) -> None:
        self.request_id = request_id
        self.kind = kind
        self._future: asyncio.Future[T] = loop.create_future()
        self._owner: Cancellable | None = owner  # dropped once settled: the request's data can go

    def done(self) -> bool:
        """True once finished, failed or cancelled, and the backend no longer touches its memory."""
        return self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def result(self) -> T:
        """The result; raises its error, ``CancelledError``, or ``InvalidStateError`` if not done."""
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def cancel(self) -> bool:
        """Ask for cancellation; False if already done.

        A request that has not reached the backend is cancelled at once. One inside a backend call is
        cancelled when the call returns: ``done()`` stays False until then.
        """
        owner = self._owner  # None once settled
        return owner is not None and owner.cancel()

    def add_done_callback(self, callback: Callable[[TransferFuture[T]], object]) -> None:
        self._future.add_done_callback(lambda _: callback(self))

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.shield(self._future).__await__()

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        elif self._future.cancelled():
            state = "cancelled"
        elif self._future.exception() is not None:
            state = f"failed: {self._future.exception()!r}"
        else:
            state = f"done: {self._future.result()!r}"
        return f"<TransferFuture {self.kind} #{self.request_id} {state}>"

    # -- for the worker -------------------------------------------------------------------------

    def _set_result(self, value: T) -> None:
        self._owner = None
        if not self._future.done():
            self._future.set_result(value)

    def _set_exception(self, exc: BaseException) -> None:
        self._owner = None
        if not self._future.done():
            self._future.set_exception(exc)

    def _set_cancelled(self) -> None:
        self._owner = None
        if not self._future.done():
            self._future.cancel()
