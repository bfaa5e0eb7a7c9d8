"""Executor lanes: the threads backend calls run on.

Two lanes, so that lookups and the next batch's checks never queue behind long or hung transfers:
``TRANSFER`` (``executor_threads`` threads: batch puts and gets, register/unregister) and ``CONTROL``
(one thread: existence checks and address computation).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import WorkerClosedError

T = TypeVar("T")


class Lane(enum.Enum):
    CONTROL = "control"
    TRANSFER = "transfer"


class Lanes:
    def __init__(self, transfer_threads: int) -> None:
        self._executors = {
            Lane.TRANSFER: ThreadPoolExecutor(transfer_threads, thread_name_prefix="aiokv"),
            Lane.CONTROL: ThreadPoolExecutor(1, thread_name_prefix="aiokv-control"),
        }
        self._terminated = False

    @property
    def terminated(self) -> bool:
        return self._terminated

    async def run(self, lane: Lane, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``lane``; after :meth:`terminate`, raises ``WorkerClosedError`` instead."""
        if self._terminated:
            raise WorkerClosedError("the worker was terminated")
        future = asyncio.get_running_loop().run_in_executor(self._executors[lane], fn, *args)
        try:
            return await future
        except asyncio.CancelledError:
            # terminate() drops the calls still queued in the executor (cancel_futures): they never
            # ran, so they fail like a call that raised, instead of cancelling the batch awaiting them
            # (which would leave its requests unfinished forever).
            task = asyncio.current_task()
            if self._terminated and future.cancelled() and (task is None or not task.cancelling()):
                raise WorkerClosedError("the worker was terminated before the call ran") from None
            raise

    def terminate(self) -> None:
        """Take no more calls and drop those not started; running ones finish."""
        self._terminated = True
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)

    async def shutdown(self) -> None:
        """Wait for every thread to end (on a helper thread: the loop keeps running)."""
        for executor in self._executors.values():
            await asyncio.to_thread(executor.shutdown, wait=True)

    def shutdown_now(self) -> None:
        """Blocking shutdown, for a start that failed before anything ran on the lanes."""
        for executor in self._executors.values():
            executor.shutdown(wait=True)
