"""Links between ``concurrent.futures`` futures, for the host tier's two sides."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


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
