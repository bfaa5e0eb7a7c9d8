"""``KVWorker``: the user-facing worker. Validates and enqueues requests, runs the dispatcher, owns
the lifecycle, and turns per-chunk codes into results. The batch itself runs in :mod:`aiokv.batch`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ._arrays import IntArray, as_int64_array, as_positive_int
from .backends.base import Backend
from .batch import BatchRunner
from .errors import AiokvError, InvalidRequestError, TransferTimeoutError, WorkerClosedError
from .futures import TransferFuture
from .keys import HashedPrompt, KeyNamespace, TokenIds, chain_seed
from .layout import KVLayout
from .requests import INTERNAL_CODES, WRITTEN, Kind, Request, State
from .results import LoadResult, StoreResult
from .stats import WorkerStats

logger = logging.getLogger("aiokv")

T = TypeVar("T")
BlockIds = Sequence[Sequence[int]] | Sequence[IntArray] | IntArray

_LOOP_TASKS = ("aiokv-dispatcher", "aiokv-lookups")
# A binding converting this many (address, size) pairs holds the GIL ~1.5 ms (Mooncake, measured).
DEFAULT_REGIONS_PER_CALL = 16384


class KVWorker:
    """Moves chunks of one engine's KV cache between its blocks and a backend, from asyncio.

    ``layouts``: one :class:`KVLayout` per KV-cache group (or a single layout). ``namespace``: a
    :class:`KeyNamespace`, or just the model name. ``chunk_tokens``: tokens per stored chunk, a
    multiple of every group's ``block_size``.

    Use ``async with KVWorker(...) as worker:`` or ``await worker.start()`` / ``await worker.close()``.
    The backend belongs to the caller: the worker registers the layouts' memory with it on start,
    unregisters it on close, and closes the backend only with ``close_backend=True``.

    Tuning: ``max_regions_per_call`` bounds the (address, size) pairs of one backend call (what the
    binding converts while it holds the GIL; default: the backend's ``max_regions_per_call``
    attribute, else 16384); ``max_concurrent_batches`` how many batches overlap;
    ``executor_threads`` the threads running backend calls (more overlap more transfers, but every
    thread converting arguments contends with the loop for the GIL: 2 kept loop lag p99 about half of
    what 4 gave on 2 cores; existence checks and address computation have a thread of their own);
    ``pressure_backoff_s`` how long stores
    pause after the store answers "full" (-200).
    """

    def __init__(
        self,
        layouts: Sequence[KVLayout] | KVLayout,
        backend: Backend,
        *,
        namespace: KeyNamespace | str,
        chunk_tokens: int,
        max_regions_per_call: int | None = None,
        max_concurrent_batches: int = 2,
        executor_threads: int = 2,
        pressure_backoff_s: float = 1.0,
        close_backend: bool = False,
    ) -> None:
        if isinstance(layouts, KVLayout):
            layouts = [layouts]
        if not isinstance(layouts, Sequence):
            raise TypeError("layouts must be a KVLayout or a non-empty sequence of KVLayout")
        layouts = list(layouts)
        if not layouts or not all(isinstance(layout, KVLayout) for layout in layouts):
            raise TypeError("layouts must be a KVLayout or a non-empty sequence of KVLayout")
        for name in ("batch_exists", "batch_put", "batch_get", "register_buffer"):
            if not callable(getattr(backend, name, None)):
                raise TypeError(f"backend {type(backend).__name__} has no {name}() method")
        if isinstance(namespace, str):
            namespace = KeyNamespace(namespace)
        if not isinstance(namespace, KeyNamespace):
            raise TypeError("namespace must be a KeyNamespace or a model name")
        self.chunk_tokens = as_positive_int(chunk_tokens, "chunk_tokens")
        for group, layout in enumerate(layouts):
            if self.chunk_tokens % layout.block_size:
                raise InvalidRequestError(
                    f"chunk_tokens {self.chunk_tokens} is not a multiple of group {group}'s "
                    f"block_size {layout.block_size}"
                )
        if (
            isinstance(pressure_backoff_s, bool)
            or not isinstance(pressure_backoff_s, (int, float))
            or not 0 <= pressure_backoff_s < float("inf")
        ):
            raise InvalidRequestError(
                f"pressure_backoff_s must be a finite number >= 0, got {pressure_backoff_s!r}"
            )
        self.layouts = layouts
        self.backend = backend
        self.namespace = namespace
        self._max_batches = as_positive_int(max_concurrent_batches, "max_concurrent_batches")
        self._threads = as_positive_int(executor_threads, "executor_threads")
        if not isinstance(close_backend, bool):
            raise TypeError(f"close_backend must be a bool, not {type(close_backend).__name__}")
        self._close_backend = close_backend
        self._blocks_per_chunk = [self.chunk_tokens // layout.block_size for layout in layouts]
        self._ids = itertools.count(1)
        self._stats = WorkerStats()
        self._runner = BatchRunner(
            layouts=layouts,
            prefixes=[namespace.prefix(layout.fingerprint, g) for g, layout in enumerate(layouts)],
            chunk_tokens=self.chunk_tokens,
            seed=chain_seed(self.chunk_tokens),
            backend=backend,
            stats=self._stats,
            max_regions_per_call=as_positive_int(
                getattr(backend, "max_regions_per_call", DEFAULT_REGIONS_PER_CALL)
                if max_regions_per_call is None
                else max_regions_per_call,
                "max_regions_per_call",
            ),
            pressure_backoff_s=float(pressure_backoff_s),
            in_executor=self._in_executor,
            complete=self._complete,
            fail=self._fail,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        # Two lanes: backend transfers, and short control work (existence checks, address computation),
        # so lookups and the next batch's checks never queue behind long or hung transfers.
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._queue: asyncio.Queue[Request | None] = asyncio.Queue()
        self._lookup_queue: asyncio.Queue[Request | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._active: set[Request] = set()
        self._registered: list[int] = []
        self._accepting = False
        self._terminated = False
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> KVWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Register every layout's memory with the backend and start the dispatcher."""
        if self._loop is not None:
            raise AiokvError("KVWorker.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._executors = {
            "transfer": ThreadPoolExecutor(self._threads, thread_name_prefix="aiokv"),
            "control": ThreadPoolExecutor(1, thread_name_prefix="aiokv-control"),
        }
        try:
            for addr, size in merged_spans(self.layouts):
                await self._in_executor(self.backend.register_buffer, addr, size)
                self._registered.append(addr)
        except BaseException:
            self._closed = True
            await self._release_backend()
            for executor in self._executors.values():
                executor.shutdown(wait=True)
            raise
        self._spawn(self._dispatch_loop(), _LOOP_TASKS[0])
        self._spawn(self._lookup_loop(), _LOOP_TASKS[1])
        self._accepting = True

    async def close(self, timeout: float | None = None) -> None:
        """Graceful: take no more work, finish everything submitted, then release the backend.

        With ``timeout``, whatever is still pending after it is failed as by :meth:`terminate`.
        """
        if self._loop is None or self._closed:
            return
        if self._accepting:
            self._accepting = False
            self._queue.put_nowait(None)
            self._lookup_queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._wait_tasks(), timeout)
        except TimeoutError:
            logger.warning("aiokv: close() did not finish within %s s; terminating", timeout)
            self.terminate()
        await self.wait_closed()

    def terminate(self) -> None:
        """Immediate: fail every request that is not inside a backend call with ``WorkerClosedError``.

        A request inside a backend call finishes when that call returns, since its memory is in use
        until then; :meth:`wait_closed` waits for that and for every task and thread to end.
        """
        if self._loop is None or self._closed or self._terminated:
            return
        self._accepting = False
        self._terminated = True
        error = WorkerClosedError("the worker was terminated")
        for request in list(self._active):
            if request.state is State.QUEUED:
                self._fail(request, error)
        for task in list(self._tasks):
            if task.get_name() in _LOOP_TASKS:
                task.cancel()
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)

    async def wait_closed(self) -> None:
        """Wait until every task of the worker has ended, then release the backend."""
        await self._wait_tasks()
        if self._closed:
            return
        self._closed = True
        await self._release_backend()
        for executor in self._executors.values():
            await asyncio.to_thread(executor.shutdown, wait=True)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- submitting -----------------------------------------------------------------------------

    def store(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> TransferFuture[StoreResult]:
        """Write the whole chunks of ``tokens`` from the blocks ``block_ids`` (one sequence per group).

        Returns at once. The blocks must stay allocated and unchanged until the future is done.
        Bad arguments raise ``InvalidRequestError``/``TypeError`` here; bad token values fail the future.
        """
        return self._submit(Kind.STORE, tokens, block_ids, timeout)

    def load(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> TransferFuture[LoadResult]:
        """Read the whole chunks within ``tokens`` into the blocks ``block_ids`` (one per group).

        Returns at once. The blocks must not be read or reused until the future is done.
        """
        return self._submit(Kind.LOAD, tokens, block_ids, timeout)

    async def lookup(self, tokens: TokenIds | HashedPrompt) -> int:
        """Leading tokens whose chunks are present in every group (a hole ends the prefix)."""
        request = self._new_request(Kind.LOOKUP, tokens, None, None)
        if request.num_chunks == 0:
            self._finish(request, value=0)
        else:
            self._lookup_queue.put_nowait(request)
        result: int = await request.future
        return result

    def stats(self) -> dict[str, Any]:
        """Counters since start and recent latency summaries (see :class:`aiokv.stats.WorkerStats`)."""
        return self._stats.snapshot()

    def _submit(
        self, kind: Kind, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, timeout: float | None
    ) -> TransferFuture[Any]:
        request = self._new_request(kind, tokens, block_ids, timeout)
        if request.num_chunks == 0:
            request.codes = [np.zeros(0, dtype=np.int64) for _ in self.layouts]
            self._complete(request)
        else:
            self._queue.put_nowait(request)
        return request.future

    def _new_request(
        self,
        kind: Kind,
        tokens: TokenIds | HashedPrompt,
        block_ids: BlockIds | None,
        timeout: float | None,
    ) -> Request:
        if not self._accepting:
            raise WorkerClosedError(
                "the worker is not started (use `async with KVWorker(...)`)"
                if self._loop is None
                else "the worker is closed"
            )
        hashes, num_chunks = self._check_tokens(tokens)
        blocks = self._check_block_ids(block_ids, num_chunks) if kind is not Kind.LOOKUP else []
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout!r}")
        loop = self._running_loop()
        request_id = next(self._ids)
        request = Request(
            id=request_id,
            kind=kind,
            num_chunks=num_chunks,
            future=TransferFuture(loop, request_id, kind.value, lambda: self._cancel(request)),
            submitted=time.perf_counter(),
            tokens=None if hashes is not None else tokens,  # type: ignore[arg-type]
            hashes=hashes,
            blocks=blocks,
        )
        if timeout is not None:
            request.deadline_handle = loop.call_later(timeout, self._on_deadline, request)
        self._stats.requests[kind.value] += 1
        self._active.add(request)
        return request

    def _check_tokens(self, tokens: TokenIds | HashedPrompt) -> tuple[Sequence[str] | None, int]:
        """Cheap checks at submit; token values are checked as they are hashed, slice by slice."""
        if isinstance(tokens, HashedPrompt):
            if tokens.chunk_tokens != self.chunk_tokens:
                raise InvalidRequestError(
                    f"the HashedPrompt was chunked by {tokens.chunk_tokens} tokens, the worker by "
                    f"{self.chunk_tokens}"
                )
            return tokens.hashes, len(tokens.hashes)
        if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(
            tokens, (Sequence, np.ndarray)
        ):
            raise TypeError(f"token_ids must be a sequence or 1-D array of ints, not {type(tokens).__name__}")
        if isinstance(tokens, np.ndarray) and (tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
            raise InvalidRequestError(
                f"token_ids must be a 1-D integer array, got shape {tokens.shape} and dtype {tokens.dtype}"
            )
        return None, len(tokens) // self.chunk_tokens

    def _check_block_ids(self, block_ids: BlockIds | None, num_chunks: int) -> list[IntArray]:
        groups = len(self.layouts)
        if (
            block_ids is None
            or isinstance(block_ids, (str, bytes))
            or not isinstance(block_ids, (Sequence, np.ndarray))
            or (isinstance(block_ids, np.ndarray) and block_ids.ndim != 2)
        ):
            raise TypeError("block_ids must hold one sequence of block ids per KV-cache group")
        if len(block_ids) != groups:
            hint = " (for one group pass [block_ids])" if groups == 1 else ""
            raise InvalidRequestError(
                f"block_ids must hold one sequence per KV-cache group: expected {groups}, "
                f"got {len(block_ids)}{hint}"
            )
        checked = []
        for group, (ids, layout, per_chunk) in enumerate(
            zip(block_ids, self.layouts, self._blocks_per_chunk, strict=True)
        ):
            if np.isscalar(ids):
                raise TypeError(f"block_ids[{group}] must be a sequence of block ids, not a single value")
            array = as_int64_array(ids, f"block_ids[{group}]", ndim=1)
            needed = num_chunks * per_chunk
            if array.size < needed:
                raise InvalidRequestError(
                    f"block_ids[{group}] has {array.size} block ids but the {num_chunks} whole chunks "
                    f"need {needed}"
                )
            used = array[:needed]
            outside = (used < 0) | (used >= layout.num_blocks)
            if outside.any():
                index = int(np.flatnonzero(outside)[0])
                raise InvalidRequestError(
                    f"block_ids[{group}][{index}] = {int(used[index])} is outside the group's "
                    f"{layout.num_blocks} blocks"
                )
            checked.append(used.reshape(num_chunks, per_chunk))
        return checked

    # -- cancellation and deadlines -------------------------------------------------------------

    def _cancel(self, request: Request) -> bool:
        if request.finished:
            return False
        if request.state is State.TRANSFERRING:
            request.cancel_requested = True  # honoured once its backend calls have returned
        else:
            self._finish(request, cancelled=True)
        return True

    def _on_deadline(self, request: Request) -> None:
        request.deadline_handle = None
        if request.finished:
            return
        if request.state is State.TRANSFERRING:
            request.timed_out = True
        else:
            self._fail(
                request, TransferTimeoutError(f"{request.kind.value} #{request.id} timed out before it ran")
            )

    # -- finishing ------------------------------------------------------------------------------

    def _finish(
        self,
        request: Request,
        *,
        value: object = None,
        error: BaseException | None = None,
        cancelled: bool = False,
    ) -> None:
        if request.finished:
            return
        request.state = State.DONE
        self._active.discard(request)
        if request.deadline_handle is not None:
            request.deadline_handle.cancel()
        kind = request.kind.value
        self._stats.record_latency(kind, time.perf_counter() - request.submitted)
        if cancelled:
            self._stats.requests_cancelled[kind] += 1
            request.future._set_cancelled()
        elif error is not None:
            self._stats.requests_failed[kind] += 1
            request.future._set_exception(error)
        else:
            request.future._set_result(value)

    def _fail(self, request: Request, error: BaseException) -> None:
        self._finish(request, error=error)

    def _complete(self, request: Request) -> None:
        """Finish a request once none of its backend calls is running."""
        if request.cancel_requested:
            self._finish(request, cancelled=True)
        elif request.timed_out:
            message = f"{request.kind.value} #{request.id} passed its deadline during the transfer"
            self._fail(request, TransferTimeoutError(message))
        elif request.error is not None:
            self._fail(request, request.error)
        elif request.kind is Kind.STORE:
            self._finish(request, value=self._store_result(request))
        elif request.kind is Kind.LOAD:
            self._finish(request, value=self._load_result(request))
        else:
            present = np.stack(request.codes).astype(bool).all(axis=0)
            self._finish(request, value=_prefix_length(present) * self.chunk_tokens)

    def _store_result(self, request: Request) -> StoreResult:
        if request.num_chunks == 0:
            return StoreResult(0, 0, 0)
        codes = np.stack(request.codes)  # (groups, chunks)
        failed = (codes < 0).any(axis=0)
        stored = ~failed & (codes == WRITTEN).any(axis=0)
        failed_chunks = tuple(np.flatnonzero(failed).tolist())
        result = StoreResult(
            stored=int(stored.sum()),
            skipped=int((~failed & ~stored).sum()),
            failed=len(failed_chunks),
            failed_chunks=failed_chunks,
            errors=_count_errors(codes),
        )
        self._stats.chunks["stored"] += result.stored
        self._stats.chunks["skipped"] += result.skipped
        self._stats.chunks["failed"] += result.failed
        return result

    def _load_result(self, request: Request) -> LoadResult:
        if request.num_chunks == 0:
            return LoadResult(0, tuple(() for _ in self.layouts))
        codes = np.stack(request.codes)
        loaded = (codes >= 0).all(axis=0)
        failed = np.flatnonzero(~loaded)
        self._stats.chunks["loaded"] += int(loaded.sum())
        self._stats.chunks["load_failed"] += int(failed.size)
        return LoadResult(
            loaded_tokens=_prefix_length(loaded) * self.chunk_tokens,
            failed_block_ids=tuple(tuple(blocks[failed].ravel().tolist()) for blocks in request.blocks),
            loaded_chunks=int(loaded.sum()),
            errors=_count_errors(codes),
        )

    # -- dispatching ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        """Each wake-up takes everything queued into one batch (while batch slots are busy, requests
        pile up into a bigger one)."""
        slots = asyncio.Semaphore(self._max_batches)
        stopping = False
        while not stopping:
            request = await self._queue.get()
            await slots.acquire()
            batch, stopping = self._drain(self._queue, request)
            if not batch:
                slots.release()
                continue
            task = self._spawn(self._runner.run_transfers(batch), "aiokv-batch")
            task.add_done_callback(lambda _: slots.release())

    async def _lookup_loop(self) -> None:
        stopping = False
        while not stopping:
            request = await self._lookup_queue.get()
            batch, stopping = self._drain(self._lookup_queue, request)
            if batch:
                await self._runner.run_lookups(batch)

    @staticmethod
    def _drain(queue: asyncio.Queue[Request | None], first: Request | None) -> tuple[list[Request], bool]:
        batch: list[Request] = []
        stopping = False
        item = first
        while True:
            if item is None:
                stopping = True  # close() enqueues the stop mark after the last request
            elif not item.finished:
                batch.append(item)
            if queue.empty():
                return batch, stopping
            item = queue.get_nowait()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = self._running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _wait_tasks(self) -> None:
        # asyncio.wait, not gather: when a caller's timeout (close(timeout=...)) cancels this wait,
        # gather would cancel the batches too, while their backend calls still use the caller's memory.
        while self._tasks:
            done, _ = await asyncio.wait(list(self._tasks))
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved, as gather(return_exceptions=True) did

    # -- executor and backend -------------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise WorkerClosedError("the worker is not started")
        return self._loop

    async def _in_executor(self, fn: Callable[..., T], *args: Any, lane: str = "transfer") -> T:
        if self._terminated:
            raise WorkerClosedError("the worker was terminated")
        future = self._running_loop().run_in_executor(self._executors[lane], fn, *args)
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

    async def _release_backend(self) -> None:
        """Unregister our memory and, if asked to, close the backend (on a fresh thread: after
        terminate() the executor takes no more work)."""
        unregister = getattr(self.backend, "unregister_buffer", None)
        if callable(unregister):
            for addr in reversed(self._registered):
                try:
                    await asyncio.to_thread(unregister, addr)
                except Exception as exc:
                    logger.warning("aiokv: unregister_buffer(%#x) failed: %s", addr, exc)
        self._registered.clear()
        if self._close_backend:
            await asyncio.to_thread(self.backend.close)


def merged_spans(layouts: Sequence[KVLayout]) -> list[tuple[int, int]]:
    """All regions of all groups with overlapping or touching spans merged (stores refuse overlaps)."""
    spans = sorted(span for layout in layouts for span in layout.region_spans())
    merged: list[list[int]] = []
    for addr, size in spans:
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], addr + size - merged[-1][0])
        else:
            merged.append([addr, size])
    return [(addr, size) for addr, size in merged]


def _prefix_length(ok: np.ndarray) -> int:
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else int(ok.size)


def _count_errors(codes: IntArray) -> dict[int, int]:
    failures = codes[(codes < 0) & ~np.isin(codes, list(INTERNAL_CODES))]
    if not failures.size:
        return {}
    values, counts = np.unique(failures, return_counts=True)
    return dict(zip(values.tolist(), counts.tolist(), strict=True))
