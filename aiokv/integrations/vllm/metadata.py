"""What the scheduler-side connector tells the worker-side one each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ...keys import HashedPrompt
from .host_tier import TierReport, TierStep
from .load_policy import Measurements


@dataclass(frozen=True)
class TransferSpec:
    """Chunks ``prompt`` of request ``req_id`` to move between the store and the engine's blocks, per KV
    cache group ``g``: chunks ``prompt.hashes[first_chunks[g]:]`` into ``block_ids[g]`` (one per block of
    those chunks, in token order; a sliding-window group moves only the chunks after its null blocks).
    ``unloaded_block_ids`` (loads only, per group): blocks of the hit that no chunk fills, reported as
    failed so vLLM recomputes them."""

    req_id: str
    prompt: HashedPrompt
    block_ids: tuple[tuple[int, ...], ...]
    first_chunks: tuple[int, ...]
    unloaded_block_ids: tuple[tuple[int, ...], ...] = ()

    def group_prompt(self, group: int) -> HashedPrompt:
        return HashedPrompt(self.prompt.hashes[self.first_chunks[group] :], self.prompt.chunk_tokens)


@dataclass
class AiokvConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
    # Preempted this step: their blocks may be reused by this very step's forward.
    preempted: set[str] = field(default_factory=set)
    sync_loads: bool = False
    # No token is computed this step: the engine only polls for transfers (see WorkerSide.get_finished).
    idle: bool = False
    # The host tier's orders for this step (see host_tier.py), applied before its transfers.
    tier: TierStep | None = None
    scheduled_tokens: int = 0  # this step's forward computes this many tokens (timed: load_meter.py)


@dataclass
class AiokvWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler-side connector each step: the host tier's writes, and the
    load policy's measurements (load_policy.py)."""

    tier: TierReport | None = None
    measured: Measurements | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, AiokvWorkerMetadata):
            raise TypeError(f"cannot merge AiokvWorkerMetadata with {type(other).__name__}")
        tier = self.tier.merge(other.tier) if self.tier and other.tier else (self.tier or other.tier)
        measured = (
            self.measured.merge(other.measured)
            if self.measured and other.measured
            else (self.measured or other.measured)
        )
        return AiokvWorkerMetadata(tier, measured)
