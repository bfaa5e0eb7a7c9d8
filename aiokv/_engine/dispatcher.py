"""Queues into batches. Two queues: transfers (stores and loads) and lookups, so a lookup never waits
behind a batch; a lookup the pipeline answers at once (a short one, on an in-process backend) never
enters its queue. Tasks are held by role: the dispatcher task, the lookup task, the batch tasks. The
lookups submitted and not yet answered are counted in the loop's :class:`LoopSlices`, which
makes every batch of the loop slice finer meanwhile (see :mod:`.slices`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .request import Request
from .slices import LoopSlices, answering_lookups

if TYPE_CHECKING:
    from .pipeline import BatchPipeline

RunBatch = Callable[[list[Request]], Awaitable[None]]


class Dispatcher:
    def __init__(
        self, pipeline: BatchPipeline, max_concurrent_batches: int, max_batch_chunks: int | None = None
    ) -> None:
        self._run_transfers: RunBatch = pipeline.run_transfers
        self._run_lookups: RunBatch = pipeline.run_lookups
        self._answer_lookup_now = pipeline.answer_lookup_now
        self._settling = pipeline.settling
        self._max_batches = max_concurrent_batches
        self._max_batch_chunks = max_batch_chunks
        self._carried: Request | None = None  # drained past a full batch: the next batch's first
        self._transfers: asyncio.Queue[Request | None] = asyncio.Queue()
        self._lookups: asyncio.Queue[Request | None] = asyncio.Queue()
        self._dispatch_task: asyncio.Task[None] | None = None
        self._lookup_task: asyncio.Task[None] | None = None
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._slices = LoopSlices()  # the running loop's, from start()
        self._lookups_counted = 0  # this dispatcher's share of it: submitted, not yet answered
        self._lookups_ended = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._slices = LoopSlices.of_running_loop()
        self._dispatch_task = loop.create_task(self._dispatch_loop(), name="aiokv-dispatcher")
        self._lookup_task = loop.create_task(self._lookup_loop(), name="aiokv-lookups")

    def submit(self, request: Request) -> None:
        self._transfers.put_nowait(request)

    def submit_lookup(self, request: Request) -> None:
        if self._answer_lookup_now(request):
            return
        self._lookups.put_nowait(request)
        self._count_lookups(1)

    def stop(self) -> None:
        """Graceful: the loops end after everything queued so far has been batched."""
        self._transfers.put_nowait(None)
        self._lookups.put_nowait(None)

    def cancel_loops(self) -> None:
        """Immediate: stop batching. Running batches go on (their calls may touch memory)."""
        for task in (self._dispatch_task, self._lookup_task):
            if task is not None:
                task.cancel()

    def _tasks(self) -> list[asyncio.Task[None]]:
        loops = [t for t in (self._dispatch_task, self._lookup_task) if t is not None and not t.done()]
        return loops + [t for t in self._batch_tasks if not t.done()]

    async def wait(self) -> None:
        """Until every task has ended (loops and batches, including batches started meanwhile)."""
        # asyncio.wait, not gather: when a caller's timeout (close(timeout=...)) cancels this wait,
        # gather would cancel the batches too, while their backend calls still use the caller's memory.
        while tasks := self._tasks():
            done, _ = await asyncio.wait(tasks)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved, as gather(return_exceptions=True) did

    async def _dispatch_loop(self) -> None:
        """Each wake-up takes everything queued into one batch (while batch slots are busy, requests
        pile up into a bigger one)."""
        slots = asyncio.Semaphore(self._max_batches)
        stopping = False
        while not stopping:
            request, self._carried = self._carried, None
            if request is None:
                request = await self._transfers.get()
            await slots.acquire()
            await self._settling.ended()  # its callers resubmit as it settles them: take them all
            await _turns_until_callers_resubmit()
            batch, stopping, self._carried = _drain(self._transfers, request, self._max_batch_chunks)
            if not batch:
                slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run(batch), name="aiokv-batch")
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)
            task.add_done_callback(lambda _: slots.release())
            # Held by the batch task alone: settled requests go as soon as it ends, not at the next wake-up.
            del batch, request

    async def _run(self, batch: list[Request]) -> None:
        await self._run_transfers(batch)

    async def _lookup_loop(self) -> None:
        answering_lookups()
        stopping = False
        try:
            while not stopping:
                request = await self._lookups.get()
                taken = self._lookups.qsize() + 1
                batch, stopping, _ = _drain(self._lookups, request, None)
                if batch:
                    await self._run_lookups(batch)
                # Answered; their callers wake two turns of the loop later (the future, the shield
                # around it): the batches keep giving way until then.
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.call_soon, self._count_lookups, -taken + stopping)  # None: no lookup
        finally:  # ended (or cancelled by terminate()): nothing counted is left to answer here
            self._count_lookups(-self._lookups_counted)
            self._lookups_ended = True

    def _count_lookups(self, change: int) -> None:
        if self._lookups_ended:  # a late decrement after the loop's final one
            return
        self._lookups_counted += change
        self._slices.count_lookups(change)


async def _turns_until_callers_resubmit() -> None:
    """Two turns of the loop. Once no batch is settling, the callers of the last requests settled wake
    two turns later (the future, the shield around it) and most submit their next request then.
    Draining after those turns takes those requests into this batch instead of leaving them to the
    next one: with many callers, batches stay large (per-batch work is most of a small request's
    cost, so fuller batches serve more requests per second)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def _drain(
    queue: asyncio.Queue[Request | None], first: Request | None, max_chunks: int | None
) -> tuple[list[Request], bool, Request | None]:
    """Everything queued, from ``first`` on, up to ``max_chunks`` chunks (None: no bound; a request of
    more goes alone): the batch, whether the stop mark was taken, and the request drained past a full
    batch (the next batch's first)."""
    batch: list[Request] = []
    stopping = False
    chunks = 0
    item = first
    while True:
        if item is None:
            stopping = True  # stop() enqueues the stop mark after the last request
        elif not item.finished:
            if max_chunks is not None and batch and chunks + item.num_chunks > max_chunks:
                return batch, stopping, item
            batch.append(item)
            chunks += item.num_chunks
        if queue.empty():
            return batch, stopping, None
        item = queue.get_nowait()
