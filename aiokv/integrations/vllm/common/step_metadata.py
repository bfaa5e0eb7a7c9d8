"""The metadata vLLM carries between the connector's sides each step: the scheduler's orders to the workers
(:class:`AiokvConnectorMetadata`) and the workers' reports back (:class:`AiokvWorkerMetadata`), built of the
plain types of :mod:`.wire`. Pickled across processes."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .wire import Measurements, StoreReport, TierReport, TierStep, TransferSpec


@dataclass
class AiokvConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
    # Preempted this step: their blocks may be reused by this very step's forward.
    preempted: set[str] = field(default_factory=set)
    sync_loads: bool = False
    # No token is computed this step: the engine only polls for transfers (see WorkerSide.get_finished).
    idle: bool = False
    # The host tier's orders for this step (the index: scheduler_side.tier_index), applied before the
    # step's transfers.
    tier: TierStep | None = None
    scheduled_tokens: int = 0  # this step's forward computes this many tokens (timed: worker_side.load_meter)


@dataclass
class AiokvWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler-side connector each step: the host tier's writes, the
    load policy's measurements (:mod:`..scheduler_side.load_policy`), and when loads were done
    (``time.monotonic()``, per request; merged over ranks, the last rank's time)."""

    tier: TierReport | None = None
    measured: Measurements | None = None
    loads_done: dict[str, float] = field(default_factory=dict)
    # Chunks the store behind the engine confirmed, for the scheduler's KV events (None when they are off).
    stored: StoreReport | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, AiokvWorkerMetadata):
            raise TypeError(f"cannot merge AiokvWorkerMetadata with {type(other).__name__}")
        tier = self.tier.merge(other.tier) if self.tier and other.tier else (self.tier or other.tier)
        measured = (
            self.measured.merge(other.measured)
            if self.measured and other.measured
            else (self.measured or other.measured)
        )
        loads_done = dict(self.loads_done)
        for req_id, at in other.loads_done.items():
            loads_done[req_id] = max(at, loads_done.get(req_id, at))
        stored = (
            self.stored.merge(other.stored) if self.stored and other.stored else (self.stored or other.stored)
        )
        return AiokvWorkerMetadata(tier, measured, loads_done, stored)


@dataclass
class AiokvHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker rank tells the scheduler once, at start-up (vLLM's handshake, after the KV cache
    is registered): what its disk tier held when it opened."""

    tier: TierReport | None = None
