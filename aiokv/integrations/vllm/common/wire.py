"""What travels between the connector's two sides, as plain dataclasses (no vLLM import): the chunks a
step moves (:class:`TransferSpec`), the host tier's orders and reports (:class:`TierStep`,
:class:`TierReport`), the writes the store confirmed (:class:`StoreReport`) and the load policy's
measurements (:class:`LoadSample`, :class:`Measurements`). vLLM's metadata classes wrap them
(:mod:`.step_metadata`)."""

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
    offset: int = 0  # the request's chunk index of ``prompt.hashes[0]`` (KV events name its blocks)

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
    reports of all ranks of a step (:meth:`merge`) before the scheduler reads them. ``found``: all a
    rank's store held for this engine when it opened (a disk tier after a restart), digest -> value
    bytes, sent once; ``lost``: chunks a load found gone from the rank's store (a damaged file)."""

    stored: dict[int, set[str]] = field(default_factory=dict)
    failed: dict[int, set[str]] = field(default_factory=dict)
    found: dict[int, dict[str, int]] = field(default_factory=dict)
    lost: dict[int, set[str]] = field(default_factory=dict)

    def merge(self, other: TierReport) -> TierReport:
        merged = TierReport(
            {r: set(d) for r, d in self.stored.items()},
            {r: set(d) for r, d in self.failed.items()},
            {**self.found, **other.found},
            {r: set(d) for r, d in self.lost.items()},
        )
        for mine, theirs in (
            (merged.stored, other.stored),
            (merged.failed, other.failed),
            (merged.lost, other.lost),
        ):
            for rank, digests in theirs.items():
                mine.setdefault(rank, set()).update(digests)
        return merged

    def __bool__(self) -> bool:
        return bool(self.found) or any(
            d for part in (self.stored, self.failed, self.lost) for d in part.values()
        )


@dataclass
class StoreReport:
    """Chunks the stores of one worker rank left in the store behind the engine, and those they did not,
    one entry per store ordered (a chunk two requests stored is listed twice): the scheduler announces a
    chunk once every writing rank has it (:mod:`..scheduler_side.kv_events`)."""

    stored: dict[int, list[str]] = field(default_factory=dict)
    failed: dict[int, list[str]] = field(default_factory=dict)

    def merge(self, other: StoreReport) -> StoreReport:
        merged = StoreReport(
            {r: list(d) for r, d in self.stored.items()}, {r: list(d) for r, d in self.failed.items()}
        )
        for mine, theirs in ((merged.stored, other.stored), (merged.failed, other.failed)):
            for rank, digests in theirs.items():
                mine.setdefault(rank, []).extend(digests)
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
