"""What a finished store or load reports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of one store, in chunks (a chunk counts once however many KV-cache groups it spans).

    ``stored``: chunks this request wrote (in at least one group); ``skipped``: chunks already in the
    store or written by a concurrent request; ``failed``: chunks not in the store afterwards (some group
    failed). ``failed_chunks`` lists their indices; ``errors`` counts status codes over (chunk, group).
    """

    stored: int
    skipped: int
    failed: int
    failed_chunks: tuple[int, ...] = ()
    errors: Mapping[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.failed == 0


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one load.

    ``loaded_tokens``: the prefix of tokens whose chunks were loaded in every group. ``failed_block_ids``
    (one list per group) holds every block of a chunk that was not loaded, because it was missing, its
    read failed, or it lies after the first missing chunk (not attempted): the engine must recompute
    those. Blocks of the requested chunks not listed hold the stored bytes.
    """

    loaded_tokens: int
    failed_block_ids: tuple[tuple[int, ...], ...]
    loaded_chunks: int = 0
    errors: Mapping[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.failed_block_ids)
