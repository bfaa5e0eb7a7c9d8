"""The worker-side half of the connector: runs aiokv's worker on its own event-loop thread.

Loads and stores go through aiokv's queues and dispatcher, so concurrent requests batch together.
Memory rules (aiokv's futures are done only once the store no longer touches the blocks):

- a finishing request with stores is reported in ``get_finished`` (sending) only once they are done;
  the scheduler keeps its blocks until then;
- a preempted request's blocks may be reused by this very step: ``handle_preemptions`` waits for its
  stores before the forward runs;
- a load is reported (receiving) once done; the blocks it could not fill are reported through
  ``get_block_ids_with_load_errors`` and recomputed (``kv_load_failure_policy="recompute"``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from ...backends.verified import VerifiedBackend
from ...results import LoadResult
from ...threaded import ThreadedKVWorker
from .clients import acquire_backend, at_exit, release_backend, safe_call
from .config import ConnectorConfig
from .geometry import KVGeometry, engine_layout
from .keys import key_namespace, value_fingerprint
from .metadata import AiokvConnectorMetadata, TransferSpec
from .stats_reporter import StatsReporter
from .tier_worker import TierWorker, open_tier_worker

logger = logging.getLogger("aiokv.vllm")

_WAIT_LOG_S = 5.0  # a wait for in-flight transfers this long is logged (and then every as long)
_STATS_INTERVAL_S = 1.0


def _warn_if_failed(req_id: str, future: concurrent.futures.Future[Any]) -> None:
    """A store's future is done: a failure here is a refusal or an error, not a failed chunk (those
    are in the result)."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        logger.warning("aiokv: store for %s failed (%s)", req_id, exc)


def _wait_all(futures: list[concurrent.futures.Future[Any]], what: str) -> None:
    """Wait until every future is done. Not bounded here: each transfer is bounded by its own timeout
    and the backend's, and the blocks must not be reused while one may still touch them."""
    pending = [future for future in futures if not future.done()]
    started = time.monotonic()
    while pending:
        _, not_done = concurrent.futures.wait(pending, timeout=_WAIT_LOG_S)
        pending = list(not_done)
        if pending:
            logger.warning(
                "aiokv: %s still waits for %d transfer(s) after %.0f s",
                what,
                len(pending),
                time.monotonic() - started,
            )


class WorkerSide:
    def __init__(self, vllm_config: Any, config: ConnectorConfig, geometry: KVGeometry) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.config = config
        self.geometry = geometry
        self.vllm_config = vllm_config
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.tp_rank = int(get_tensor_model_parallel_rank())
        self.namespace = key_namespace(
            vllm_config, config, geometry, tp_rank=self.tp_rank, pp_rank=int(get_pp_group().rank_in_group)
        )
        # MLA: the KV is the same on every TP rank; one rank writes the shared key, all read it.
        self.writes = not (geometry.is_mla and self.tp_rank != 0)
        self.chunk_tokens = config.chunk_blocks * geometry.block_size
        self._backend: Any = None  # this process's shared backend (clients.acquire_backend)
        self._verified: VerifiedBackend | None = None  # over it, when values are verified
        self._worker: ThreadedKVWorker | TierWorker | None = None
        self._on_cuda = False
        self._loads: dict[str, tuple[concurrent.futures.Future[LoadResult] | None, TransferSpec]] = {}
        self._stores: defaultdict[str, list[concurrent.futures.Future[Any]]] = defaultdict(list)
        self._with_stores: set[str] = set()
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        # Connector-level events, for tests and logs (the worker's own counters are in stats()).
        self.events: Counter[str] = Counter()
        self._stats: StatsReporter | None = None
        self.tier: TierWorker | None = None

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        layout = engine_layout(kv_caches, self.geometry)
        first = next(iter(kv_caches.values()))
        self._on_cuda = first.device.type == "cuda"
        if self._on_cuda and self.config.host_tier:
            raise ValueError(
                f"AiokvConnector backend {self.config.backend!r} needs the KV cache in host memory"
            )
        if self.config.remote:
            self._backend = acquire_backend(self.engine_id, self.config, pure_client=False)
        if self._backend is None and not self.config.host_tier:
            return
        store_worker: ThreadedKVWorker | None = None
        try:
            if self._backend is not None:
                backend = self._backend
                if self.config.verify_values:
                    fingerprint = value_fingerprint(self.vllm_config, self.namespace, self.geometry, layout)
                    # The shared backend is released (and closed) by its owner, not by the wrapper.
                    backend = self._verified = VerifiedBackend(self._backend, fingerprint, close_inner=False)
                store_worker = ThreadedKVWorker(
                    layout,
                    backend,
                    namespace=self.namespace,
                    chunk_tokens=self.chunk_tokens,
                    executor_threads=self.config.executor_threads,
                )
            self._worker = store_worker
            if self.config.host_tier:  # this rank's host tier, in front of the store if any (tier_worker.py)
                self.tier = self._worker = open_tier_worker(layout, self, behind=store_worker)
                self.writes = True  # every rank holds its own tier, whoever writes to the store behind
        except Exception as exc:
            logger.error("aiokv: cannot register the KV cache with the store (%s); running without it", exc)
            if store_worker is not None:  # the tier failed: nothing may use the store's worker either
                safe_call("closing the aiokv worker", lambda: store_worker.close(timeout=30.0))
            self._worker = None
            self._release_backend()
            return
        if self._worker is None:
            return
        self._stats = StatsReporter(self._worker, _STATS_INTERVAL_S)
        at_exit(self.shutdown)
        logger.info(
            "aiokv: KV cache registered (%d layers x %d blocks of %d bytes, %d tokens per key, values %s)",
            layout.num_regions,
            layout.num_blocks,
            self.geometry.page_bytes,
            self.chunk_tokens,
            "verified" if self._verified is not None else "not verified",
        )

    # -- each step ------------------------------------------------------------------------------

    def handle_preemptions(self, meta: AiokvConnectorMetadata) -> None:
        for req_id in meta.preempted:
            futures = self._stores.pop(req_id, [])
            if any(not future.done() for future in futures):
                self.events["preemptions_waited"] += 1
                _wait_all(futures, f"preempted request {req_id}")

    def start_load_kv(self, meta: AiokvConnectorMetadata) -> None:
        if self.tier is not None:
            self.tier.apply(meta.tier)  # the host tier's drops and admits come before the step's transfers
        wanted = [spec for spec in meta.loads if spec.prompt.hashes]
        futures = dict(zip((spec.req_id for spec in wanted), self._submit("load", wanted), strict=True))
        for spec in meta.loads:
            self._loads[spec.req_id] = (futures.get(spec.req_id), spec)
            self.events["loads_submitted"] += 1
        if meta.sync_loads:
            # The forward reads these blocks in this step.
            for spec in meta.loads:
                self._finish_load(spec.req_id, wait=True)

    def wait_for_save(self, meta: AiokvConnectorMetadata) -> None:
        if not meta.stores:
            return
        if self._on_cuda:
            import torch

            torch.cuda.current_stream().synchronize()  # this step's KV must be written before it is read
        self._with_stores.update(spec.req_id for spec in meta.stores)
        if not self.writes:
            return
        for spec, future in zip(meta.stores, self._submit("store", meta.stores), strict=True):
            if future is None:
                continue
            future.add_done_callback(functools.partial(_warn_if_failed, spec.req_id))
            self._stores[spec.req_id].append(future)
            self.events["stores_submitted"] += 1

    def _submit(self, kind: str, specs: list[TransferSpec]) -> list[concurrent.futures.Future[Any] | None]:
        """All of a step's loads or stores in one call, handed to aiokv's loop without waiting for it
        (waiting, once per request, stalled the engine's step a millisecond or more each); None for
        each if the worker refused them all."""
        if self._worker is None or not specs:
            return [None] * len(specs)
        requests = [(spec.prompt, [list(spec.block_ids)]) for spec in specs]
        try:
            if kind == "load":
                return list(self._worker.load_many(requests, timeout=self.config.load_timeout_s))
            return list(self._worker.store_many(requests, timeout=self.config.store_timeout_s))
        except Exception as exc:
            logger.warning("aiokv: %d %s(s) refused (%s)", len(specs), kind, exc)
            return [None] * len(specs)

    def get_finished(
        self, finished_req_ids: set[str], *, idle: bool = False
    ) -> tuple[set[str] | None, set[str] | None]:
        self._finishing |= finished_req_ids & self._with_stores
        self._give_way(idle)
        sending = set()
        for req_id in list(self._finishing):
            futures = self._stores.get(req_id, [])
            if all(future.done() for future in futures):
                sending.add(req_id)
                self._finishing.discard(req_id)
                self._with_stores.discard(req_id)
                self._stores.pop(req_id, None)
        for req_id, futures in list(self._stores.items()):
            # Drop finished stores of running requests, keep the ones a preemption must wait for.
            self._stores[req_id] = [future for future in futures if not future.done()]
        recving = {req_id for req_id, (future, _) in list(self._loads.items()) if self._finish_load(req_id)}
        return sending or None, recving or None

    def _give_way(self, idle: bool) -> None:
        """Let aiokv's threads run while the engine only polls. vLLM steps without pause while a request
        waits for its KV, and an empty step is pure Python: it holds the GIL until CPython's switch
        interval (5 ms) takes it away, at every hand-off of a transfer between aiokv's threads, and it
        takes a core from the transport. On a step that computes nothing, wait up to ``idle_wait_s``
        for a load (or a finishing request's store) to finish; otherwise just yield the GIL."""
        pending = [future for future, _ in self._loads.values() if future is not None and not future.done()]
        if idle:
            for req_id in self._finishing:
                pending += [future for future in self._stores.get(req_id, ()) if not future.done()]
        if not pending:
            return
        if idle and self.config.idle_wait_s > 0:
            concurrent.futures.wait(
                pending, timeout=self.config.idle_wait_s, return_when=concurrent.futures.FIRST_COMPLETED
            )
        else:
            time.sleep(0)

    def _finish_load(self, req_id: str, *, wait: bool = False) -> bool:
        """If the load of ``req_id`` is done (waiting for it with ``wait``), record its failed blocks."""
        future, spec = self._loads[req_id]
        if future is not None and wait:
            _wait_all([future], f"load of {req_id}")
        if future is not None and not future.done():
            return False
        del self._loads[req_id]
        failed: set[int] = set(spec.block_ids)
        if future is not None:
            try:
                result = future.result()
                failed = set(result.failed_block_ids[0]) if result.failed_block_ids else set()
            except Exception as exc:
                logger.warning("aiokv: load for %s failed (%s); recomputing it", req_id, exc)
        failed |= set(spec.unloaded_block_ids)
        if failed:
            self.events["load_error_blocks"] += len(failed)
            self._load_errors |= failed
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats_delta(self) -> dict[str, int] | None:
        """Counters since the last report, or None; never waits for aiokv's loop (see
        :class:`StatsReporter`)."""
        return self._stats.delta() if self._stats is not None else None

    def stats(self) -> dict[str, Any]:
        """The connector's events and the aiokv worker's counters (JSON-friendly)."""
        out: dict[str, Any] = {"events": dict(self.events), "connected": self._worker is not None}
        if self._worker is not None:
            worker_stats = self._worker.stats()
            out.update({key: value for key, value in worker_stats.items() if key != "latency"})
        if self._verified is not None:
            out["verification"] = self._verified.verification_stats()
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every store submitted so far is done; False if ``timeout`` passed first."""
        futures = [future for futures in self._stores.values() for future in futures]
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def shutdown(self) -> None:
        for futures in self._stores.values():
            _wait_all(futures, "shutdown")
        if self._worker is not None:
            worker, self._worker = self._worker, None
            safe_call("closing the aiokv worker", lambda: worker.close(timeout=30.0))
        self._release_backend()

    def _release_backend(self) -> None:
        if self._verified is not None:
            verified, self._verified = self._verified, None
            safe_call("closing the value verification", verified.close)
        if self._backend is not None:
            backend, self._backend = self._backend, None
            release_backend(self.engine_id, backend)
