"""What travels between the connector's two sides, as plain dataclasses (no vLLM import): the chunks a
step moves (:class:`TransferSpec`), the host tier's orders and reports (:class:`TierStep`,
:class:`TierReport`) and the load policy's measurements (:class:`LoadSample`, :class:`Measurements`).
vLLM's metadata classes wrap them (:mod:`.step_metadata`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ....keys import HashedPrompt


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


@dataclass(frozen=True)
class TierStep:
    """The scheduler's orders to every worker for one step (pickled with the step's metadata)."""

    removes: tuple[str, ...] = ()  # chunk digests to drop, before any transfer of the step
    admits: tuple[str, ...] = ()  # chunk digests the workers may write this step (stores, promotions)


@dataclass
class TierReport:
    """Admitted writes, per worker rank: the digests written and those not written. vLLM merges the
    reports of all ranks of a step (:meth:`merge`) before the scheduler reads them."""

    stored: dict[int, set[str]] = field(default_factory=dict)
    failed: dict[int, set[str]] = field(default_factory=dict)

    def merge(self, other: TierReport) -> TierReport:
        merged = TierReport(
            {r: set(d) for r, d in self.stored.items()}, {r: set(d) for r, d in self.failed.items()}
        )
        for mine, theirs in ((merged.stored, other.stored), (merged.failed, other.failed)):
            for rank, digests in theirs.items():
                mine.setdefault(rank, set()).update(digests)
        return merged

    def __bool__(self) -> bool:
        return any(self.stored.values()) or any(self.failed.values())


@dataclass
class LoadSample:
    """One load, as a worker saw it: its bytes, the bytes of loads in flight ahead of it on the same
    worker, and seconds from submission to done."""

    source: str
    nbytes: int
    ahead_bytes: int
    seconds: float


@dataclass
class Measurements:
    """What the workers measured since the last step (merged over ranks by vLLM)."""

    loads: list[LoadSample] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per forward

    def merge(self, other: Measurements) -> Measurements:
        return Measurements([*self.loads, *other.loads], [*self.steps, *other.steps])

    def __bool__(self) -> bool:
        return bool(self.loads or self.steps)
