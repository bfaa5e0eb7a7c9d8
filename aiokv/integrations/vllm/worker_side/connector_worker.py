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

from ....backends.verified import VerifiedBackend
from ..common.backend_handles import acquire_backend, at_exit, release_backend, safe_call
from ..common.block_keys import moved_groups, value_fingerprint
from ..common.connector_config import ConnectorConfig
from ..common.from_vllm import engine_layout
from ..common.geometry import EngineGeometry
from ..common.group_workers import GroupWorkers
from ..common.stats_reporter import CounterDeltas, StatsReporter, add_counters
from ..common.step_metadata import AiokvConnectorMetadata, AiokvHandshakeMetadata, AiokvWorkerMetadata
from ..common.wire import TransferSpec
from .chunk_movers import ChunkMover
from .layerwise_mover import LayerwiseMover
from .load_meter import LoadMeter
from .load_outcomes import LoadOutcomes
from .step_transfers import chunk_requests, submit_step, warn_if_failed
from .store_confirmations import store_confirmations
from .tier_stores import DiskTierError, open_tier_worker
from .tier_worker import TierWorker
from .transfer_waits import wait_all

logger = logging.getLogger("aiokv.vllm")

_STATS_INTERVAL_S = 1.0


class WorkerSide:
    def __init__(self, vllm_config: Any, config: ConnectorConfig, geometry: EngineGeometry) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.config = config
        self.geometry = geometry
        self.vllm_config = vllm_config
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.tp_rank = int(get_tensor_model_parallel_rank())
        pp_rank = int(get_pp_group().rank_in_group)
        # What each aiokv worker moves: a KV cache group, or a run of its layers (layer_groups > 1).
        self.moved = moved_groups(vllm_config, config, geometry, tp_rank=self.tp_rank, pp_rank=pp_rank)
        self.namespaces = [namespace for _, namespace in self.moved]
        # MLA: the KV is the same on every TP rank; one rank writes the shared key, all read it.
        self.writes = not (geometry.is_mla and self.tp_rank != 0)
        self.chunk_tokens = config.chunk_blocks * geometry.block_size
        self._backend: Any = None  # this process's shared backend (clients.acquire_backend)
        self._verified: list[VerifiedBackend] = []  # over it, one per group, when values are verified
        # One aiokv worker per KV cache group: a sliding-window group moves fewer chunks than the others.
        self._groups: GroupWorkers | None = None
        # layer_groups > 1: the group's chunks move layer group by layer group (:mod:`.layerwise_mover`).
        self._layers: LayerwiseMover | None = None
        self._layerwise_loads: list[str] = []  # this step's synchronous loads, waited for per layer group
        self._on_cuda = False
        # Connector-level events, for tests and logs (the worker's own counters are in stats()).
        self.events: Counter[str] = Counter()
        self._loads = LoadOutcomes(geometry.hybrid, self.events)
        self._stores: defaultdict[str, list[concurrent.futures.Future[Any]]] = defaultdict(list)
        self._with_stores: set[str] = set()
        self._finishing: set[str] = set()
        self._stats: list[StatsReporter] = []  # one per group's worker
        # This rank's host tier (single-group engines: the connector refuses it on hybrid ones); it
        # then moves the group's chunks, in front of the store's worker if any.
        self.tier: TierWorker | None = None
        self._verify_deltas = CounterDeltas()
        # The load policy's measurements (scheduler_side.load_policy), reported to the scheduler each step.
        self.meter: LoadMeter | None = None
        # The chunks this rank's stores confirmed in the store behind, for KV events (None when off).
        self.confirmations = store_confirmations(vllm_config, config, geometry, self.tp_rank, pp_rank)

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        pages = self.config.key_format == "vllm"  # a state group's values then are vLLM's: whole pages
        shapes = [group for group, _ in self.moved]
        layouts = [engine_layout(kv_caches, g, self.chunk_tokens, whole_state_pages=pages) for g in shapes]
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
        try:
            if self._backend is not None:
                self._groups = GroupWorkers(
                    layouts,
                    self._backend,
                    self.namespaces,
                    wrap=functools.partial(self._verifying, layouts) if self.config.verify_values else None,
                    chunk_tokens=self.chunk_tokens,
                    executor_threads=self.config.executor_threads,
                    max_batch_chunks=self.config.max_batch_chunks,
                )
                if self.config.layer_groups > 1:
                    self._layers = LayerwiseMover(
                        self._groups.workers, [group.layer_names for group in shapes]
                    )
            if self.config.host_tier:  # this rank's host tier, in front of the store if any (tier_worker)
                behind = self._groups.workers[0] if self._groups is not None else None
                self.tier = open_tier_worker(
                    layouts[0],
                    self.namespaces[0],
                    self.chunk_tokens,
                    self.config,
                    behind=behind,
                    behind_writes=self.writes,
                    fingerprint=value_fingerprint(
                        self.vllm_config, self.namespaces[0], shapes[0], layouts[0]
                    ),
                )
                self.writes = True  # every rank holds its own tier, whoever writes to the store behind
        except Exception as exc:
            if not isinstance(exc, DiskTierError):  # a disk tier's directory is the user's to fix
                logger.error(
                    "aiokv: cannot register the KV cache with the store (%s); running without it", exc
                )
            if self._groups is not None:  # the tier failed: nothing may use the store's workers either
                groups, self._groups = self._groups, None
                groups.close()
            self._release_backend()
            if isinstance(exc, DiskTierError):
                raise
            return
        self._stats = [StatsReporter(worker, _STATS_INTERVAL_S) for worker in self._workers]
        if self.config.decline_slow_loads:
            self.meter = LoadMeter(
                self.config.backend,
                [group.chunk_bytes(self.config.chunk_blocks) for group in self.geometry.groups],
                on_cuda=self._on_cuda,
            )
        at_exit(self.shutdown)
        for group, layout in zip(shapes, layouts, strict=True):
            logger.info(
                "aiokv: KV cache registered (%s group: %d layers x %d blocks of %d bytes, %d tokens per key, "
                "values %s)",
                group.kind,
                layout.num_regions,
                layout.num_blocks,
                group.page_bytes,
                self.chunk_tokens,
                "verified" if self._verified or self.config.disk_tier else "not verified",  # disk: checksums
            )

    def _verifying(self, layouts: list[Any], group: int, backend: Any) -> VerifiedBackend:
        """Group ``group``'s view of the store, its values verified under the group's own fingerprint."""
        geometry, namespace = self.moved[group]
        fingerprint = value_fingerprint(self.vllm_config, namespace, geometry, layouts[group])
        # The shared backend is released (and closed) by its owner, not by the wrapper.
        verified = VerifiedBackend(backend, fingerprint, close_inner=False)
        self._verified.append(verified)
        return verified

    # -- each step ------------------------------------------------------------------------------

    def forward_begins(self) -> None:
        """vLLM is about to run a forward (it binds the step's metadata just before)."""
        if self.meter is not None:
            self.meter.forward_begins()

    def worker_metadata(self) -> AiokvWorkerMetadata | None:
        """What this rank tells the scheduler after a step: the host tier's writes since the last
        report, for the tier's index, and the load policy's measurements; None if nothing."""
        report = self.tier.report() if self.tier is not None else None
        measured = self.meter.take() if self.meter is not None else None
        done = self._loads.take_done_times()
        stored = self.confirmations.report() if self.confirmations is not None else None
        if report is None and not measured and not done and stored is None:
            return None
        return AiokvWorkerMetadata(report, measured, done, stored)

    def handshake(self) -> AiokvHandshakeMetadata | None:
        """What this rank's tier held when it opened (a disk tier's restart), for the scheduler's index
        before any request; None without (then, if ever, the first report carries it)."""
        found = self.tier.take_found() if self.tier is not None else None
        return AiokvHandshakeMetadata(found) if found is not None else None

    def handle_preemptions(self, meta: AiokvConnectorMetadata) -> None:
        """Before each step's forward: wait for the stores whose blocks this forward may rewrite."""
        for req_id in meta.preempted:
            futures = self._stores.pop(req_id, [])
            if any(not future.done() for future in futures):
                self.events["preemptions_waited"] += 1
                wait_all(futures, f"preempted request {req_id}")
        if self.geometry.has_state or any(group.sliding_window is not None for group in self.geometry.groups):
            # vLLM frees a sliding window's older blocks, and a state group's handed-over states, as
            # requests advance, between steps and without telling the connector: a store of earlier
            # steps must be done before they can be reused.
            pending = [future for futures in self._stores.values() for future in futures if not future.done()]
            if pending:
                self.events["state_stores_waited" if self.geometry.has_state else "window_stores_waited"] += 1
                wait_all(pending, "stores of blocks vLLM may free (sliding windows, states)")

    def start_load_kv(self, meta: AiokvConnectorMetadata) -> None:
        if self.tier is not None:
            self.tier.apply(meta.tier)  # the host tier's drops and admits come before the step's transfers
        if self._layers is not None:
            self._layers.new_step()
        wanted = [spec for spec in meta.loads if spec.prompt.hashes]
        futures = dict(zip((spec.req_id for spec in wanted), self._submit("load", wanted), strict=True))
        for spec in meta.loads:
            submitted = futures.get(spec.req_id)
            self._loads.submitted(spec, submitted)
            self.events["loads_submitted"] += 1
            if self.meter is not None and submitted:
                groups = [group for group, ids in enumerate(spec.block_ids) if ids]
                requested = sum(len(spec.block_ids[g]) * self.geometry.groups[g].block_bytes for g in groups)
                self.meter.load_submitted(submitted, groups, requested)
        if meta.sync_loads and meta.loads and self._layers is not None:
            # The forward reads these blocks in this step, each layer once its layer group is in.
            self._layerwise_loads = [spec.req_id for spec in meta.loads]
        elif meta.sync_loads and meta.loads:
            # The forward reads these blocks in this step.
            for spec in meta.loads:
                self._loads.finish(spec.req_id, wait=True)
            if self.meter is not None:
                self.meter.sync_loads_done()  # the forward starts after them

    @property
    def layerwise(self) -> bool:
        """Whether chunks move layer group by layer group (``layer_groups`` > 1, a store connected)."""
        return self._layers is not None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention reads its KV: its layer group's synchronous loads are in."""
        if self._layers is None or not self._layerwise_loads:
            return
        waited = self._layers.wait_for_layer(layer_name)
        if waited and self.meter is not None:
            self.meter.exclude(waited)  # the engine's compute rate must not count the waits

    def save_kv_layer(self, layer_name: str, meta: AiokvConnectorMetadata) -> None:
        """``layer_name``'s KV of this step is written: a layer group complete leaves for the store."""
        if self._layers is None or not meta.stores or not self.writes:
            return
        if self._on_cuda:
            import torch

            torch.cuda.current_stream().synchronize()  # the layer's KV must be written before it is read
        requests = functools.partial(chunk_requests, meta.stores, 0)
        self._layers.layer_written(layer_name, lambda: requests()[1], timeout=self.config.store_timeout_s)

    def _finish_layerwise_loads(self) -> None:
        """The forward is over: a load whose layers it never waited for (none read them) is waited for
        now, and every one's failures are recorded before they are reported."""
        loads, self._layerwise_loads = self._layerwise_loads, []
        for req_id in loads:
            self._loads.finish(req_id, wait=True)

    def wait_for_save(self, meta: AiokvConnectorMetadata) -> None:
        if self._layerwise_loads:
            self._finish_layerwise_loads()
        if self.meter is not None:
            self.meter.forward_ended(meta.scheduled_tokens)
        if not meta.stores:
            return
        if self._on_cuda:
            import torch

            torch.cuda.current_stream().synchronize()  # this step's KV must be written before it is read
        self._with_stores.update(spec.req_id for spec in meta.stores)
        if not self.writes:
            return
        for spec, futures in zip(meta.stores, self._submit("store", meta.stores), strict=True):
            if self.confirmations is not None:
                self.confirmations.watch(spec, futures)
            for future in futures or ():
                future.add_done_callback(functools.partial(warn_if_failed, spec.req_id))
                self._stores[spec.req_id].append(future)
            if futures:
                self.events["stores_submitted"] += 1

    def _submit(
        self, kind: str, specs: list[TransferSpec]
    ) -> list[list[concurrent.futures.Future[Any]] | None]:
        timeout = self.config.load_timeout_s if kind == "load" else self.config.store_timeout_s
        return submit_step(kind, specs, self._workers, timeout)

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
        recving = self._loads.finished()
        return sending or None, recving or None

    def _give_way(self, idle: bool) -> None:
        """Let aiokv's threads run while the engine only polls. vLLM steps without pause while a request
        waits for its KV, and an empty step is pure Python: it holds the GIL until CPython's switch
        interval (5 ms) takes it away, at every hand-off of a transfer between aiokv's threads, and it
        takes a core from the transport. On a step that computes nothing, wait up to ``idle_wait_s``
        for a load (or a finishing request's store) to finish; otherwise just yield the GIL."""
        pending = self._loads.pending()
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._loads.take_block_errors()

    def take_failed_loads(self) -> set[str]:
        """Requests whose load failed in some group (hybrid engines): vLLM recomputes them whole."""
        return self._loads.take_failed_requests()

    def stats_delta(self) -> dict[str, int] | None:
        """Counters since the last report, or None; never waits for aiokv's loop (see
        :class:`StatsReporter`), summed over the groups (a hybrid engine's request counts once per
        group it moves)."""
        total: dict[str, Any] = {}
        for delta in (reporter.delta() for reporter in self._stats):
            add_counters(total, delta or {})
        if self._verified:
            read_ns = sum(v.verification_stats()["checksum_read_cpu_ns"] for v in self._verified)
            add_counters(total, self._verify_deltas.since_last({"verify_read_seconds": read_ns / 1e9}) or {})
        return total or None

    def stats(self) -> dict[str, Any]:
        """The connector's events and the aiokv worker's counters (JSON-friendly)."""
        out: dict[str, Any] = {"events": dict(self.events), "connected": bool(self._workers)}
        for worker in self._workers:  # counters summed over the groups' workers
            worker_stats = worker.stats()
            worker_stats.pop("latency", None)
            add_counters(out, worker_stats)
        for verified in self._verified:
            add_counters(out.setdefault("verification", {}), verified.verification_stats())
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every store submitted so far is done; False if ``timeout`` passed first."""
        futures = [future for futures in self._stores.values() for future in futures]
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def shutdown(self) -> None:
        for futures in self._stores.values():
            wait_all(futures, "shutdown")
        if self.tier is not None:  # closes the store's worker behind it too (a second close is a no-op)
            tier, self.tier = self.tier, None
            safe_call("closing the host tier", lambda: tier.close(timeout=30.0))
        self._layers = None
        if self._groups is not None:
            groups, self._groups = self._groups, None
            groups.close()
        self._release_backend()

    def _release_backend(self) -> None:
        verified, self._verified = self._verified, []
        for wrapper in verified:
            safe_call("closing the value verification", wrapper.close)
        if self._backend is not None:
            backend, self._backend = self._backend, None
            release_backend(self.engine_id, backend)

    @property
    def _workers(self) -> list[ChunkMover]:
        """The worker moving each KV cache group's chunks: the host tier's, if there is one; the layer
        groups' (as one), if chunks move layer group by layer group."""
        if self.tier is not None:
            return [self.tier]
        if self._layers is not None:
            return [self._layers]
        return list(self._groups.workers) if self._groups is not None else []
