"""``AiokvConnector``: aiokv as a vLLM (v1) KV connector. Tested with vLLM 0.32.0.

    kv_transfer_config={"kv_connector": "AiokvConnector",
                        "kv_connector_module_path": "aiokv.integrations.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {...}}

vLLM builds one instance per role; this facade only delegates, to the scheduler side
(:mod:`.scheduler_side`, in the scheduler's process) or to the worker side (:mod:`.worker_side`, in each
worker's). What both use is in :mod:`.common`. Keys and extra-config keys: docs/vllm.md.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.platforms import current_platform

from .common.amx import allow_amx_tiles
from .common.connector_config import ConnectorConfig
from .common.connector_stats import AiokvConnectorStats, AiokvPromMetrics
from .common.from_vllm import check_tiers_fit, kv_geometry
from .common.step_metadata import AiokvConnectorMetadata
from .common.vllm_logging import log_through_vllm
from .scheduler_side.connector_scheduler import SchedulerSide
from .worker_side.connector_worker import WorkerSide

logger = logging.getLogger("aiokv.vllm")


class AiokvConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads and stores full KV blocks through aiokv (Mooncake, or the embedded store). With vLLM's
    hybrid allocator, each KV cache group (full attention, sliding window, linear-attention states in
    mamba_cache_mode "align") is keyed and moved apart."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_through_vllm()
        if current_platform.device_type == "cpu":
            allow_amx_tiles()  # vLLM's CPU attention would otherwise die with SIGILL on AMX hosts
        if kv_cache_config is None:
            raise ValueError("AiokvConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        self.config = ConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        geometry = kv_geometry(kv_cache_config)
        check_tiers_fit(self.config, geometry)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                vllm_config, self.config, geometry, int(kv_cache_config.num_blocks)
            )
        else:
            self._worker = WorkerSide(vllm_config, self.config, geometry)

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on the worker-side AiokvConnector")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on the scheduler-side AiokvConnector")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store lost to preemption is a later miss, never wrong KV

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,)), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids), None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Scheduler side: every rank's handshake (:meth:`get_handshake_metadata`), at start-up."""
        self._sched().on_handshake(metadata.values())

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._sched().on_handshake(metadata.values())

    def take_events(self) -> list[Any]:
        """vLLM's ``BlockStored``/``BlockRemoved`` for the connector's tiers, published by the scheduler
        with its own (built only with ``kv_events_config.enable_kv_cache_events``)."""
        return self._sched().take_events()

    def get_kv_connector_kv_cache_events(self) -> None:
        """Worker side: nothing. A chunk is announced by the scheduler side, which knows when every rank
        wrote it, through ``take_events``; the workers report their writes in their metadata."""
        return None

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work().handle_preemptions(_meta(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.forward_begins()  # vLLM binds the metadata just before the forward

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv(_meta(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Called before every attention layer: nothing to do unless chunks move per layer group.
        worker = self._worker
        if worker is not None and worker.layerwise:
            worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        worker = self._worker
        if worker is not None and worker.layerwise:
            worker.save_kv_layer(layer_name, _meta(self._get_connector_metadata()))

    def wait_for_save(self) -> None:
        self._work().wait_for_save(_meta(self._get_connector_metadata()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self._work().get_finished(
            finished_req_ids, idle=isinstance(meta, AiokvConnectorMetadata) and meta.idle
        )

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._work().take_failed_loads(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker side: what this rank's disk tier held when it opened, so a restarted engine's first
        requests already hit it (vLLM collects it once, after the KV cache is registered)."""
        return self._work().handshake()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The host tier's writes since the last step, for the scheduler's index, and the load policy's
        measurements."""
        return self._work().worker_metadata()

    def flush(self, timeout: float | None = None) -> bool:
        """Worker side: wait until every store submitted so far is in the store (or failed).

        For offline scripts that exit right after generating; False if ``timeout`` passed first."""
        return self._work().flush(timeout)

    def stats(self) -> dict[str, Any]:
        """Worker side: the connector's events (``stores_submitted``, ``loads_submitted``,
        ``preemptions_waited``, ``load_error_blocks``) and aiokv's worker counters. Scheduler side: its
        counters (``lookups_deferred``) and the load policy's (hit tokens declined, and why) with its
        estimates."""
        if self._scheduler is not None:
            return self._scheduler.stats()
        return self._work().stats()

    def get_kv_connector_stats(self) -> AiokvConnectorStats | None:
        if self._scheduler is not None:
            delta = self._scheduler.stats_delta()
            return AiokvConnectorStats(data=delta) if delta else None
        if self._worker is None:
            return None
        delta = self._worker.stats_delta()
        return AiokvConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AiokvConnectorStats:
        return AiokvConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> AiokvPromMetrics:
        return AiokvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()


def _meta(meta: KVConnectorMetadata) -> AiokvConnectorMetadata:
    if not isinstance(meta, AiokvConnectorMetadata):
        raise TypeError(f"AiokvConnector got {type(meta).__name__} metadata")
    return meta
