"""``KVWorker``: the user-facing worker. Public API, lifecycle, and the wiring of its engine.

Arguments are checked in :mod:`aiokv._validate` and calls made requests in :mod:`aiokv._intake`;
requests are tracked by :class:`~aiokv._engine.tracker.RequestTracker`, batched by
:class:`~aiokv._engine.dispatcher.Dispatcher` and run by :class:`~aiokv._engine.pipeline.BatchPipeline`
on the threads of :class:`~aiokv._engine.lanes.Lanes`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any

from ._arrays import as_positive_int
from ._engine.config import EngineConfig
from ._engine.dispatcher import Dispatcher
from ._engine.guard import BreakerGuard
from ._engine.lanes import Lane, Lanes
from ._engine.pipeline import BatchPipeline
from ._engine.tracker import RequestTracker
from ._intake import Intake
from ._lifecycle import NEXT_STATES, WorkerState, to_the_end
from ._registration import Registration
from ._validate import (
    BlockIds,
    check_backoff,
    check_chunk_tokens,
    check_instance,
    check_layouts,
    check_layouts_reachable,
)
from .backends.base import Backend, backend_traits, check_backend
from .breaker import BreakerConfig, CircuitBreaker
from .errors import AiokvError, WorkerClosedError
from .futures import TransferFuture
from .keys import HashedPrompt, KeyNamespace, TokenIds
from .layout import KVLayout
from .leases import LeaseBudget, lease_ledger
from .results import LoadResult, StoreResult
from .stats import Kind, StatName, WorkerStats

logger = logging.getLogger("aiokv")

__all__ = ["KVWorker"]  # the names it imports are public from ``aiokv`` itself


class KVWorker:
    """Moves chunks of one engine's KV cache between its blocks and a backend, from asyncio.

    ``layouts``: one :class:`KVLayout` per KV-cache group (or a single layout). ``namespace``: a
    :class:`KeyNamespace`, or just the model name. ``chunk_tokens``: tokens per stored chunk (one key),
    a multiple of every group's ``block_size``; by default 256 rounded up to such a multiple: 128 KiB-1
    MiB (address, size) pairs for real models, 64 keys for a 16K prompt, at most 255 matched tokens
    recomputed (see docs/layouts.md for the trade-off).

    Use ``async with KVWorker(...) as worker:`` or ``await worker.start()`` / ``await worker.close()``.
    The backend belongs to the caller: the worker registers the layouts' memory with it on start,
    unregisters it on close, and closes the backend only with ``close_backend=True``.

    Tuning: ``max_regions_per_call`` bounds the (address, size) pairs of one backend call (what the
    binding converts while it holds the GIL; default: the backend's ``max_regions_per_call``
    attribute, else 16384); ``max_concurrent_batches`` how many batches overlap; ``max_batch_chunks``
    the most chunks one transfer batch takes (None: everything queued; a request of more goes alone;
    a load of 8 MiB or more in a group gets calls of its own and settles as soon as they return, so a
    cap is not needed for the first loads to finish first);
    ``executor_threads`` the threads running backend calls (more overlap more transfers, but every
    thread converting arguments contends with the loop for the GIL, so the loop's lag grows with them:
    the default, 2, keeps it well below what 4 cause; existence checks and address computation have a
    thread of their own);
    ``pressure_backoff_s`` how long stores pause after the store answers "full" (-200).

    ``breaker``: the circuit breaker's :class:`~aiokv.breaker.BreakerConfig` (on by default; ``None``
    removes it). While the store cannot answer (calls stuck, -900/-1 answers, raised calls), lookups
    answer 0 and stores and loads finish at once with their chunks failed ``UNAVAILABLE`` (-900)
    instead of waiting; a probe resumes the worker once the store answers (docs/reliability.md).

    ``lease_budget``: with a backend whose lookups lease what they find (``read_lease_s`` > 0: Mooncake),
    the most they hold at once (:class:`~aiokv.leases.LeaseBudget`; default: the worker's cache size):
    chunks loaded since (:meth:`lookup_loaded`) stop counting, and puts answered "no space" cut it
    until puts find room again.
    """

    def __init__(
        self,
        layouts: Sequence[KVLayout] | KVLayout,
        backend: Backend,
        *,
        namespace: KeyNamespace | str,
        chunk_tokens: int | None = None,
        max_regions_per_call: int | None = None,
        max_concurrent_batches: int = 2,
        max_batch_chunks: int | None = None,
        executor_threads: int = 2,
        pressure_backoff_s: float = 1.0,
        close_backend: bool = False,
        breaker: BreakerConfig | None = BreakerConfig(),  # noqa: B008  (frozen: safe to share)
        lease_budget: LeaseBudget | None = LeaseBudget(),  # noqa: B008  (frozen: safe to share)
    ) -> None:
        checked_layouts = check_layouts(layouts)
        check_backend(backend)
        traits = backend_traits(backend)
        if isinstance(namespace, str):
            namespace = KeyNamespace(namespace)
        check_instance(namespace, KeyNamespace, "namespace")
        chunk_tokens = check_chunk_tokens(chunk_tokens, checked_layouts)
        check_layouts_reachable(checked_layouts, backend, traits.supports_device_memory)
        backoff_s = check_backoff(pressure_backoff_s)
        self._max_batches = as_positive_int(max_concurrent_batches, "max_concurrent_batches")
        self._max_batch_chunks = (
            None if max_batch_chunks is None else as_positive_int(max_batch_chunks, "max_batch_chunks")
        )
        self._threads = as_positive_int(executor_threads, "executor_threads")
        check_instance(close_backend, bool, "close_backend")
        check_instance(breaker, BreakerConfig, "breaker", optional=True)
        check_instance(lease_budget, LeaseBudget, "lease_budget", optional=True)
        self._registration = Registration(
            checked_layouts, backend, can_unregister=traits.can_unregister, close_backend=close_backend
        )
        self.namespace = namespace
        self._stats = WorkerStats()
        self._tracker = RequestTracker(self._stats, chunk_tokens)
        self._guard = (
            BreakerGuard(CircuitBreaker(breaker), backend, self._tracker) if breaker is not None else None
        )
        self._config = EngineConfig.build(
            checked_layouts,
            backend if self._guard is None else self._guard.backend,  # type: ignore[arg-type]
            namespace,
            chunk_tokens,
            max_regions_per_call=as_positive_int(
                traits.max_regions_per_call if max_regions_per_call is None else max_regions_per_call,
                "max_regions_per_call",
            ),
            transfer_threads=self._threads,
            pressure_backoff_s=backoff_s,
            exists_in_process=traits.exists_in_process,
        )
        self._leases = lease_ledger(
            lease_budget, traits.read_lease_s, checked_layouts, self._config.blocks_per_chunk
        )
        self._intake = Intake(self._config, self._tracker, self._guard, self._leases)
        self._state = WorkerState.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lanes: Lanes | None = None
        self._dispatcher: Dispatcher | None = None
        self._finish_task: asyncio.Task[None] | None = None

    # -- read-only figures ----------------------------------------------------------------------

    @property
    def layouts(self) -> list[KVLayout]:
        return list(self._config.layouts)

    @property
    def backend(self) -> Backend:
        return self._config.backend

    @property
    def chunk_tokens(self) -> int:
        return self._config.chunk_tokens

    @property
    def max_regions_per_call(self) -> int:
        """The effective bound on (address, size) pairs per backend call (see the class docstring);
        calls are split by :func:`aiokv.backends.base.keys_per_call`."""
        return self._config.max_regions_per_call

    @property
    def breaker(self) -> CircuitBreaker | None:
        """The circuit breaker (None when the worker was made with ``breaker=None``)."""
        return self._guard.breaker if self._guard is not None else None

    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state is WorkerState.CLOSED

    @property
    def requests_in_flight(self) -> int:
        """Requests submitted whose futures are not settled yet (0: the worker is idle)."""
        return len(self._tracker.active)

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> KVWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Register every layout's memory with the backend and start the dispatcher."""
        if self._state is WorkerState.CLOSED:
            raise WorkerClosedError("the worker is closed; a KVWorker cannot be restarted (create a new one)")
        if self._state is not WorkerState.NEW:
            raise AiokvError("KVWorker.start() was already called: the worker is started")
        self._loop = asyncio.get_running_loop()
        guard = self._guard
        lanes = self._lanes = Lanes(
            self._threads,
            guard.admit if guard is not None else None,
            lock=self._tracker.lock,
            admits_on_thread=guard.admits_on_thread if guard is not None else None,
        )
        try:
            await self._registration.register(functools.partial(lanes.run, Lane.TRANSFER))
        except BaseException:
            await self._registration.release()
            lanes.shutdown_now()
            self._move(WorkerState.CLOSED)
            raise
        pipeline = BatchPipeline(self._config, self._tracker, lanes, self._stats, self._leases)
        self._dispatcher = Dispatcher(pipeline, self._max_batches, self._max_batch_chunks)
        self._dispatcher.start()
        if guard is not None:
            guard.start()
        self._move(WorkerState.RUNNING)

    async def close(self, timeout: float | None = None) -> None:
        """Graceful: take no more work, finish everything submitted, then release the backend.

        With ``timeout``, whatever is still pending after it is failed as by :meth:`terminate`. Returns
        once the backend is released and the threads stopped, however many callers close at once.
        If the close is cancelled, it still finishes the shutdown (terminating what it can, waiting
        for the calls using caller memory, unregistering, stopping threads) and then re-raises.
        """
        if self._state is WorkerState.NEW:
            self._move(WorkerState.CLOSED)
            return
        if self._state is WorkerState.CLOSED:
            return
        if self._move(WorkerState.CLOSING):
            self._running_dispatcher().stop()
        finishing = self._finishing()
        try:
            await asyncio.wait_for(asyncio.shield(finishing), timeout)
        except TimeoutError:
            logger.warning("aiokv: close() did not finish within %s s; terminating", timeout)
            self.terminate()
            await to_the_end(finishing)
        except asyncio.CancelledError:
            self.terminate()
            await to_the_end(finishing)
            raise

    def terminate(self) -> None:
        """Immediate: fail every request that is not inside a backend call with ``WorkerClosedError``.

        A request inside a backend call finishes when that call returns, since its memory is in use
        until then; :meth:`wait_closed` waits for that and for every task and thread to end. Calls
        holding no caller memory (existence checks, address computation) are abandoned.
        """
        if not self._move(WorkerState.TERMINATING):
            return
        self._tracker.terminate(WorkerClosedError("the worker was terminated"))
        self._running_dispatcher().cancel_loops()
        self._running_lanes().terminate()
        if self._guard is not None:
            self._guard.stop()

    async def wait_closed(self) -> None:
        """Wait until every task of the worker has ended, the backend is released and the threads
        are stopped (by whichever of ``close``/``terminate`` ended it)."""
        if self._state in (WorkerState.NEW, WorkerState.CLOSED) and self._finish_task is None:
            return
        await asyncio.shield(self._finishing())

    def _finishing(self) -> asyncio.Task[None]:
        """The one task that ends the worker: shared by every close() and wait_closed() caller, and
        never cancelled by theirs being cancelled."""
        if self._finish_task is None:
            self._finish_task = self._running_loop().create_task(self._finish(), name="aiokv-close")
        return self._finish_task

    async def _finish(self) -> None:
        try:
            await self._running_dispatcher().wait()
            await self._registration.release()
            await self._running_lanes().shutdown()
        finally:
            if self._guard is not None:
                await self._guard.stopped()
            self._move(WorkerState.CLOSED)

    # -- submitting -----------------------------------------------------------------------------

    def store(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> TransferFuture[StoreResult]:
        """Write the whole chunks of ``tokens`` from the blocks ``block_ids`` (one sequence per group).

        Returns at once. The blocks must stay allocated and unchanged until the future is done.
        Bad arguments raise ``InvalidRequestError``/``TypeError`` here; bad token values fail the future.
        """
        return self._intake.transfer(Kind.STORE, tokens, block_ids, timeout, *self._serving())

    def load(
        self, tokens: TokenIds | HashedPrompt, block_ids: BlockIds, *, timeout: float | None = None
    ) -> TransferFuture[LoadResult]:
        """Read the whole chunks within ``tokens`` into the blocks ``block_ids`` (one per group).

        Returns at once. The blocks must not be read or reused until the future is done.
        """
        return self._intake.transfer(Kind.LOAD, tokens, block_ids, timeout, *self._serving())

    async def lookup(self, tokens: TokenIds | HashedPrompt) -> int:
        """Leading tokens whose chunks are present in every group (a hole ends the prefix). With a
        leasing backend, past ``lease_budget`` a lookup asks about (and answers) fewer chunks."""
        return await self._intake.lookup(tokens, *self._serving())

    def lookup_loaded(self, tokens: TokenIds | HashedPrompt) -> None:
        """Tell the lease budget that another worker loads the chunks of ``tokens`` this worker's
        lookups found (this worker's own loads tell it themselves): a load leases what it reads, so
        they stop counting against ``lease_budget`` (see :mod:`aiokv.leases`). Token ids are hashed
        here, on the loop: pass a :class:`~aiokv.keys.HashedPrompt` for a long prompt."""
        if self._state is WorkerState.RUNNING:
            self._intake.loaded(tokens, self._running_loop())

    def stats(self) -> dict[str, Any]:
        """Counters since start and recent latency summaries (see :class:`aiokv.stats.WorkerStats`);
        ``"breaker"``: the circuit breaker's :meth:`~aiokv.breaker.CircuitBreaker.snapshot` (None
        without one); ``"leases"``: the lookups' lease ledger (:meth:`~aiokv.leases.LeaseLedger.snapshot`;
        None without leases or bound)."""
        snapshot = self._stats.snapshot()
        snapshot[StatName.BREAKER.value] = self._guard.snapshot() if self._guard is not None else None
        snapshot[StatName.LEASES.value] = self._leases.snapshot() if self._leases is not None else None
        return snapshot

    def _serving(self) -> tuple[asyncio.AbstractEventLoop, Dispatcher]:
        """The loop and the dispatcher of a running worker; ``WorkerClosedError`` otherwise."""
        if self._state is not WorkerState.RUNNING:
            raise WorkerClosedError(
                "the worker is not started (use `async with KVWorker(...)`)"
                if self._state is WorkerState.NEW
                else "the worker is closed"
            )
        return self._running_loop(), self._running_dispatcher()

    # -- internals ------------------------------------------------------------------------------

    def _move(self, state: WorkerState) -> bool:
        """Enter ``state`` if the lifecycle allows it from the current one; False otherwise."""
        if state not in NEXT_STATES[self._state]:
            return False
        self._state = state
        return True

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise WorkerClosedError("the worker is not started")
        return self._loop

    def _running_dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            raise WorkerClosedError("the worker is not started")
        return self._dispatcher

    def _running_lanes(self) -> Lanes:
        if self._lanes is None:
            raise WorkerClosedError("the worker is not started")
        return self._lanes
