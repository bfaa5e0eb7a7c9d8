"""Links between ``concurrent.futures`` futures: the host tier's two sides, a chunk's layer groups."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def copy_outcome(
    source: concurrent.futures.Future[Any],
    target: concurrent.futures.Future[Any],
    transform: Callable[[Any], Any] = lambda result: result,
) -> None:
    """Settle ``target`` as ``source`` settled (its result through ``transform``), unless it is done."""
    if target.done():
        return
    if source.cancelled():
        target.set_exception(concurrent.futures.CancelledError())
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(transform(source.result()))


def when_all(
    parts: Sequence[concurrent.futures.Future[Any]], finish: Callable[[], T]
) -> concurrent.futures.Future[T]:
    """A future settled by ``finish()`` once every part is done (its exception if it raises)."""
    outer: concurrent.futures.Future[T] = concurrent.futures.Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def settle() -> None:
        try:
            outer.set_result(finish())
        except BaseException as exc:
            outer.set_exception(exc)

    def one_done(_: concurrent.futures.Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            settle()

    if not parts:
        settle()
    for part in parts:
        part.add_done_callback(one_done)
    return outer
