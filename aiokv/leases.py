"""How much a worker's lookups may hold of a store's read leases (issue 25 part 3).

A store whose existence check grants a read lease (Mooncake: every key ``batch_is_exist`` finds is kept
from eviction and non-forced removes for ``default_kv_lease_ttl``, 10 s by default) keeps a lookup's hit
loadable until the engine loads it. But every lookup leases what it finds, and nothing can end a lease
early (Mooncake has no call for it): many lookups of large prompts can lease so much of the store that
it has nothing left to evict, and puts fail "no space" (-200) until leases run out.

So a worker bounds what its lookups hold: :class:`LeaseBudget` (bytes and chunks); each lookup asks the
store only about as many leading chunks as the budget has room for, and the chunks it found count
against the budget for the backend's ``read_lease_s`` after the answer (the lease's own length: a lease
of an aborted or preempted request is left to expire with it). A lookup that finds the budget spent
answers a shorter prefix, or 0, without asking the store: the engine recomputes those tokens instead of
pinning more of the store. The :class:`LeaseLedger` keeps the count; backends without leases
(``read_lease_s`` 0, the embedded store) keep none.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._engine.request import Request
    from .layout import KVLayout

__all__ = ["LeaseBudget", "LeaseLedger", "lease_ledger", "trim_lookup"]


@dataclass(frozen=True)
class LeaseBudget:
    """The most a worker's lookups hold under read leases at once.

    ``max_bytes``: bytes of chunks found (a chunk's bytes over every KV-cache group); ``None`` means the
    worker's own KV cache size, the most it could load at once. ``max_chunks``: chunks found; ``None``:
    no bound beyond ``max_bytes``. Each found chunk counts for the backend's lease length
    (``read_lease_s``) after the lookup that found it.
    """

    max_bytes: int | None = None
    max_chunks: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_chunks"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LeaseBudget.{name} must be an int or None, not {type(value).__name__}")
            if value < 0:
                raise ValueError(f"LeaseBudget.{name} must be >= 0, got {value}")

    def chunk_limit(self, chunk_bytes: int, cache_bytes: int) -> int:
        """The most chunks of ``chunk_bytes`` held at once; ``cache_bytes`` stands in for ``max_bytes``."""
        max_bytes = cache_bytes if self.max_bytes is None else self.max_bytes
        chunks = max_bytes // max(1, chunk_bytes)
        return chunks if self.max_chunks is None else min(chunks, self.max_chunks)


class LeaseLedger:
    """The chunks a worker's lookups hold: each found chunk for ``lease_s`` after its lookup answered,
    plus the chunks of lookups still asking (reserved in full, as the store may lease every one).

    Used on the worker's event loop only (no lock). It errs on the side of the store, except for one
    thing: a prompt looked up twice within a lease counts twice; but chunks present after the first
    missing one (leased by the store, not part of the hit) are not counted.
    """

    def __init__(self, max_chunks: int, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_chunks = max_chunks
        self.lease_s = lease_s
        self._clock = clock
        self._held: collections.deque[tuple[float, int]] = collections.deque()  # (expiry, chunks)
        self._held_chunks = 0
        self._asking = 0  # chunks reserved by lookups not answered yet
        self.trimmed_lookups = 0  # lookups asked about fewer chunks than they named
        self.trimmed_chunks = 0

    def held(self) -> int:
        """Chunks counted now: found within the last ``lease_s``, or asked about and not answered."""
        now = self._clock()
        while self._held and self._held[0][0] <= now:
            self._held_chunks -= self._held.popleft()[1]
        return self._held_chunks + self._asking

    def reserve(self, wanted: int) -> int:
        """How many of a lookup's ``wanted`` leading chunks it may ask about (reserved until
        :meth:`settle`)."""
        granted = max(0, min(wanted, self.max_chunks - self.held()))
        if granted < wanted:
            self.trimmed_lookups += 1
            self.trimmed_chunks += wanted - granted
        self._asking += granted
        return granted

    def ask(self, request: Request, chunk_tokens: int) -> int:
        """:meth:`reserve` for a lookup request, trimmed to the chunks granted; returns that count."""
        granted = self.reserve(request.num_chunks)
        trim_lookup(request, granted, chunk_tokens)
        return granted

    def settle(self, granted: int, found: int) -> None:
        """A lookup that reserved ``granted`` answered: its ``found`` chunks are held for ``lease_s``
        from now (pass ``granted`` when it failed: the store may have leased them all the same)."""
        self._asking -= granted
        if found > 0:
            self._held.append((self._clock() + self.lease_s, found))
            self._held_chunks += found

    async def held_until(self, answer: Awaitable[int], granted: int, chunk_tokens: int) -> int:
        """The lookup's ``answer`` (tokens found); then :meth:`settle`: the chunks it found stay counted
        leased, or all ``granted`` if it failed (the store may have leased them all the same)."""
        found = granted
        try:
            tokens = await answer
            found = tokens // chunk_tokens
        finally:
            self.settle(granted, found)
        return tokens

    def snapshot(self) -> dict[str, Any]:
        return {
            "max_chunks": self.max_chunks,
            "lease_s": self.lease_s,
            "held_chunks": self.held(),
            "trimmed_lookups": self.trimmed_lookups,
            "trimmed_chunks": self.trimmed_chunks,
        }


def lease_ledger(
    budget: LeaseBudget | None, lease_s: float, layouts: Sequence[KVLayout], blocks_per_chunk: Sequence[int]
) -> LeaseLedger | None:
    """A worker's ledger: ``budget`` over chunks of its layouts, counted ``lease_s`` each (None without
    a budget or a leasing backend)."""
    if budget is None or lease_s <= 0:
        return None
    per_block = [layout.chunk_bytes_per_block for layout in layouts]
    chunk_bytes = sum(b * n for b, n in zip(per_block, blocks_per_chunk, strict=True))
    cache_bytes = sum(b * layout.num_blocks for b, layout in zip(per_block, layouts, strict=True))
    return LeaseLedger(budget.chunk_limit(chunk_bytes, cache_bytes), lease_s)


def trim_lookup(request: Request, chunks: int, chunk_tokens: int) -> None:
    """Make a lookup ask about its first ``chunks`` chunks only (before any batch has seen it)."""
    if chunks >= request.num_chunks:
        return
    request.num_chunks = chunks
    if request.tokens is not None:
        request.tokens = request.tokens[: chunks * chunk_tokens]
    if request.hashes is not None:
        request.hashes = request.hashes[:chunks]
