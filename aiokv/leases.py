"""How much a worker's lookups may hold of a store's read leases.

A store whose existence check grants a read lease (Mooncake: every key ``batch_is_exist`` finds is kept
from eviction and non-forced removes for ``default_kv_lease_ttl``, 10 s by default) keeps a lookup's hit
loadable until the engine loads it. But every lookup leases what it finds, and nothing can end a lease
early (Mooncake has no call for it): many lookups of large prompts can lease so much of the store that
it has nothing left to evict, and puts fail "no space" (-200) until leases run out.

So a worker bounds what its lookups hold: :class:`LeaseBudget` (bytes and chunks), in distinct chunks
(a chunk leased twice holds one lease: Mooncake renews it). Each lookup asks the store only about as
many leading chunks as the budget has room for (chunks it already holds cost nothing), and the chunks
it found count against the budget until ``read_lease_s`` after the last lookup that found them (the
lease's own length: a lease of an aborted, preempted or finished request is left to expire with it).
How much: never more than the budget's chunks at once; how long: a chunk no lookup finds again is free
one lease after the last one did. A lookup that finds the budget spent answers a shorter prefix, or 0,
without asking the store: the engine recomputes those tokens instead of pinning more of the store. The
:class:`LeaseLedger` keeps the count; backends without leases (``read_lease_s`` 0, the embedded store)
keep none.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._engine.batch import KeyArray
    from ._engine.request import Request
    from .layout import KVLayout

__all__ = ["Claim", "LeaseBudget", "LeaseLedger", "lease_ledger", "trim_lookup"]


@dataclass(frozen=True)
class LeaseBudget:
    """The most a worker's lookups hold under read leases at once.

    ``max_bytes``: bytes of chunks found (a chunk's bytes over every KV-cache group); ``None`` means the
    worker's own KV cache size, the most it could load at once. ``max_chunks``: chunks found; ``None``:
    no bound beyond ``max_bytes``. Chunks count once each (distinct), for the backend's lease length
    (``read_lease_s``) after the last lookup that found them.
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


@dataclass(frozen=True, slots=True)
class Claim:
    """What one lookup reserved (:meth:`LeaseLedger.reserve`) until it answers: ``granted`` leading
    chunks asked about; ``digests``: theirs, of which ``reserved`` counted as new; ``anonymous``: chunks
    reserved by count (a lookup that named none)."""

    granted: int
    digests: tuple[str, ...] | None = None
    reserved: tuple[str, ...] = ()
    anonymous: int = 0


class LeaseLedger:
    """The distinct chunks a worker's lookups hold: each found chunk until ``lease_s`` after the last
    lookup that found it (the store renews a lease at every existence check that finds the key), plus
    the chunks of lookups still asking (reserved, as the store may lease every one).

    A chunk is its digest: a prompt looked up again (duplicate requests, a re-asked or preempted one,
    concurrent requests sharing a prefix) renews the chunks it holds and counts only the chunks not
    held yet, so repeats never shrink the budget (the worker hashes a lookup's token ids before it asks,
    to name its chunks; a lookup reserved by count alone is counted by count). Used on the worker's
    event loop only (no lock). It errs on the side of the store: a failed lookup counts all it asked
    about for a lease; chunks present after the first missing one (leased by the store, not part of the
    hit) are not counted.
    """

    def __init__(self, max_chunks: int, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_chunks = max_chunks
        self.lease_s = lease_s
        self._clock = clock
        # digest -> its lease's end; every renewal ends last (same lease_s), so the order is by expiry.
        self._held: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._unnamed: collections.deque[tuple[float, int]] = collections.deque()  # (expiry, chunks)
        self._unnamed_chunks = 0
        self._asking: collections.Counter[str] = collections.Counter()  # new chunks reserved, per lookup
        self._asking_unnamed = 0
        self.trimmed_lookups = 0  # lookups asked about fewer chunks than they named
        self.trimmed_chunks = 0
        self.renewed_chunks = 0  # chunks found again while held: counted once

    def held(self) -> int:
        """Chunks counted now: distinct chunks found within the last ``lease_s``, or asked about and
        not answered."""
        now = self._clock()
        held = self._held
        while held:
            digest, expiry = next(iter(held.items()))
            if expiry > now:
                break
            del held[digest]
        while self._unnamed and self._unnamed[0][0] <= now:
            self._unnamed_chunks -= self._unnamed.popleft()[1]
        return len(held) + self._unnamed_chunks + len(self._asking) + self._asking_unnamed

    def reserve(self, wanted: int, digests: Sequence[str] | KeyArray | None = None) -> Claim:
        """How many of a lookup's ``wanted`` leading chunks it may ask about, reserved until
        :meth:`settle`. With the chunks' ``digests``, a chunk held or reserved already costs nothing."""
        room = max(0, self.max_chunks - self.held())
        if digests is None:
            granted = min(wanted, room)
            self._asking_unnamed += granted
            claim = Claim(granted, anonymous=granted)
        else:
            fresh: list[str] = []
            granted = 0
            for digest in digests[:wanted]:
                if digest not in self._held and digest not in self._asking:
                    if len(fresh) == room:
                        break
                    fresh.append(digest)
                granted += 1
            self._asking.update(fresh)
            claim = Claim(granted, tuple(digests[:granted]), tuple(fresh))
        if claim.granted < wanted:
            self.trimmed_lookups += 1
            self.trimmed_chunks += wanted - claim.granted
        return claim

    def ask(self, request: Request, chunk_tokens: int) -> Claim:
        """:meth:`reserve` for a lookup request, trimmed to the chunks granted."""
        claim = self.reserve(request.num_chunks, request.hashes)
        trim_lookup(request, claim.granted, chunk_tokens)
        return claim

    def settle(self, claim: Claim, found: Sequence[str] | int) -> None:
        """A lookup answered: its reservation ends, and the chunks it ``found`` (their digests; a count
        when they are not known) are held for ``lease_s`` from now. A lookup that failed passes all it
        asked about (``claim.digests``, else ``claim.granted``): the store may have leased every one."""
        self._asking_unnamed -= claim.anonymous
        self._asking.subtract(claim.reserved)
        for digest in claim.reserved:
            if self._asking[digest] <= 0:
                del self._asking[digest]
        expiry = self._clock() + self.lease_s
        if isinstance(found, int):
            if found > 0:
                self._unnamed.append((expiry, found))
                self._unnamed_chunks += found
            return
        held = self._held
        for digest in found:
            if digest in held:
                self.renewed_chunks += 1
                held.move_to_end(digest)
            held[digest] = expiry

    async def held_until(self, request: Request, claim: Claim, chunk_tokens: int) -> int:
        """The lookup's answer (tokens found); then :meth:`settle`: the distinct chunks it found stay
        counted for the lease, or all it asked about if it failed."""
        found: Sequence[str] | int = claim.granted if claim.digests is None else claim.digests
        try:
            tokens: int = await request.future
            chunks = tokens // chunk_tokens
            found = chunks if claim.digests is None else claim.digests[:chunks]
        finally:
            self.settle(claim, found)
        return tokens

    def snapshot(self) -> dict[str, Any]:
        return {
            "max_chunks": self.max_chunks,
            "lease_s": self.lease_s,
            "held_chunks": self.held(),
            "trimmed_lookups": self.trimmed_lookups,
            "trimmed_chunks": self.trimmed_chunks,
            "renewed_chunks": self.renewed_chunks,
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
