"""Running aiokv's event loop: uvloop when it is installed, the standard loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop factory if uvloop imports, else the standard one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Like :func:`asyncio.run`, on uvloop when available."""
    with asyncio.Runner(debug=debug, loop_factory=loop_factory()) as runner:
        return runner.run(main)
