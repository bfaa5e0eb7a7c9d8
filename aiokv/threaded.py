"""``ThreadedKVWorker``: the worker for an engine's synchronous threads.

It runs a :class:`~aiokv.worker.KVWorker` on an event loop in a background thread and hands out
:class:`concurrent.futures.Future` objects, which keep the same promise as ``TransferFuture``: done
only once no backend touches the request's memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

from .backends.base import Backend
from .errors import WorkerClosedError
from .futures import TransferFuture
from .keys import HashedPrompt, KeyNamespace, TokenIds
from .layout import KVLayout
from .results import LoadResult, StoreResult
from .runner import new_event_loop
from .worker import BlockIds, KVWorker

T = TypeVar("T")


class SyncTransferFuture(concurrent.futures.Future[T], Generic[T]):
    """A ``concurrent.futures.Future`` whose ``cancel()`` follows TransferFuture's rules.

    ``cancel()`` of a request inside a backend call returns True but the future completes (cancelled)
    only when that call returns, so ``done()`` never turns True while the memory is in use.
    """

    def __init__(self, owner: ThreadedKVWorker, transfer: TransferFuture[T]) -> None:
        super().__init__()
        self._owner = owner
        self._transfer = transfer
        self.request_id = transfer.request_id

    def cancel(self) -> bool:
        if self.done():
            return False
        return self._owner._call(self._transfer.cancel)

    def _settle(self, transfer: TransferFuture[T]) -> None:
        """Runs on the loop thread when the transfer is done."""
        if transfer.cancelled():
            concurrent.futures.Future.cancel(self)
            self.set_running_or_notify_cancel()
            return
        error = transfer.exception()
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(transfer.result())


class ThreadedKVWorker:
    """Same arguments as :class:`KVWorker`; methods are plain blocking calls safe from any thread.

    ``store``/``load`` return at once with a :class:`SyncTransferFuture`; bad arguments raise at the
    call. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        layouts: Sequence[KVLayout] | KVLayout,
        backend: Backend,
        *,
        namespace: KeyNamespace | str,
        chunk_tokens: int | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        **options: Any,
    ) -> None:
        self._loop = (loop_factory or new_event_loop)()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aiokv-loop", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._worker = KVWorker(
                layouts, backend, namespace=namespace, chunk_tokens=chunk_tokens, **options
            )
            self._run(self._worker.start())
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self) -> ThreadedKVWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker(self) -> KVWorker:
        return self._worker

    def store(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> SyncTransferFuture[StoreResult]:
        return self._submit(self._worker.store, tokens, block_ids, timeout)

    def load(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> SyncTransferFuture[LoadResult]:
        return self._submit(self._worker.load, tokens, block_ids, timeout)

    def lookup(self, tokens: TokenIds | HashedPrompt, *, timeout: float | None = None) -> int:
        return self._run(self._worker.lookup(tokens), timeout)

    def stats(self) -> dict[str, Any]:
        return self._call(self._worker.stats)

    def close(self, timeout: float | None = None) -> None:
        """Graceful close (see :meth:`KVWorker.close`), then stop the loop thread."""
        if self._closed:
            return
        try:
            self._run(self._worker.close(timeout))
        finally:
            self._stop_loop()

    def terminate(self) -> None:
        """Immediate close (see :meth:`KVWorker.terminate`); waits for in-flight backend calls."""
        if self._closed:
            return
        try:
            self._call(self._worker.terminate)
            self._run(self._worker.wait_closed())
        finally:
            self._stop_loop()

    # -- internals ------------------------------------------------------------------------------

    def _submit(
        self,
        method: Callable[..., TransferFuture[T]],
        tokens: TokenIds | HashedPrompt,
        block_ids: BlockIds,
        timeout: float | None,
    ) -> SyncTransferFuture[T]:
        def submit() -> SyncTransferFuture[T]:
            transfer = method(tokens, block_ids, timeout=timeout)
            future = SyncTransferFuture(self, transfer)
            transfer.add_done_callback(future._settle)
            return future

        return self._call(submit)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop thread and return its result (or raise its exception) here."""
        if self._closed:
            raise WorkerClosedError("the threaded worker is closed")
        if threading.current_thread() is self._thread:
            return fn()

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self._closed:
            coro.close()
            raise WorkerClosedError("the threaded worker is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking ThreadedKVWorker calls cannot run on its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
