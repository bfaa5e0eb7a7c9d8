"""What the worker side calls on whatever moves a KV cache group's chunks: aiokv's
:class:`~aiokv.ThreadedKVWorker` over the store, or this rank's host tier
(:class:`~.tier_worker.TierWorker`) in front of it. One protocol, so the worker side never asks which."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ....keys import HashedPrompt
from ....results import LoadResult, StoreResult

# One request: a prompt's chunks and the engine's block ids for them (one list, the group's).
ChunkRequest = tuple[HashedPrompt, Sequence[Sequence[int]]]


class ChunkMover(Protocol):
    def load_many(
        self, requests: Iterable[ChunkRequest], *, timeout: float | None = None
    ) -> Sequence[concurrent.futures.Future[LoadResult]]: ...

    def store_many(
        self, requests: Iterable[ChunkRequest], *, timeout: float | None = None
    ) -> Sequence[concurrent.futures.Future[StoreResult]]: ...

    def stats(self) -> dict[str, Any]: ...

    def stats_soon(self) -> concurrent.futures.Future[dict[str, Any]]: ...

    def close(self, timeout: float | None = None) -> None: ...
