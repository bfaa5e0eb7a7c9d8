"""How much a worker's lookups may hold of a store's read leases.

A store whose existence check grants a read lease (Mooncake: every key ``batch_is_exist`` finds is kept
from eviction and non-forced removes for ``default_kv_lease_ttl``, 10 s by default) keeps a lookup's hit
loadable until the engine loads it. But every lookup leases what it finds, and nothing can end a lease
early (Mooncake has no call for it): many lookups of large prompts can lease so much of the store that
it has nothing left to evict, and puts fail "no space" (-200) until leases run out.

So a worker bounds what its lookups hold: :class:`LeaseBudget` (bytes and chunks), in distinct chunks
(a chunk leased twice holds one lease: Mooncake renews it). Each lookup asks the store only about as
many leading chunks as the budget has room for (chunks it already holds cost nothing), and the chunks
it found count against the budget until ``read_lease_s`` after the last lookup that found them, or
until they are loaded: a load leases what it reads itself (its existence check and its get), so a
loaded chunk pins the store no longer because a lookup found it, and counting it would turn the next
prompts' hits into recomputes while the store has room. What the budget bounds is what lookups pin
beyond loads: hits of requests still waiting, aborted, preempted or answered but never loaded (a lease
left to expire with its lookup). A lookup that finds the budget spent answers a shorter prefix, or 0,
without asking the store: the engine recomputes those tokens instead of pinning more of the store.

The budget follows what the store says of its room, from the worker's own puts: a put answered "no
space" halves it (at most once a quarter lease, as a burst of concurrent puts is one signal and a cut
shows only as the leases before it run out; never below a sixteenth, so hits are not all lost), and
while it is cut loaded chunks count again (loads lease too) and a budget held past its limit renews
nothing, so the excess runs out within a lease. Every put call the store takes whole gives back a
sixteenth; a lease without a "no space" answer gives back all (every lease from before has run out).
The :class:`LeaseLedger` keeps the count; backends without leases (``read_lease_s`` 0, the embedded
store) keep none.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable, Sequence
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
    (``read_lease_s``) after the last lookup that found them or until they are loaded; puts answered
    "no space" cut the bound for a while (see the module).
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


# A "no space" cut halves the limit, never below a sixteenth of the budget; each put the store takes
# whole gives a sixteenth back.
LIMIT_SHARES = 16
# At most one cut a quarter lease: concurrent puts answering "no space" together are one signal, and a
# cut shows only as the leases granted before it run out.
CUTS_PER_LEASE = 4


class LeaseLedger:
    """The distinct chunks a worker's lookups hold: each found chunk until ``lease_s`` after the last
    lookup that found it (the store renews a lease at every existence check that finds the key) or
    until it is loaded (:meth:`loaded`), plus the chunks of lookups still asking (reserved, as the store
    may lease every one); against ``limit``: ``max_chunks``, cut while puts answer "no space"
    (:meth:`store_full`, :meth:`store_took`).

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
        self.limit = max_chunks  # what lookups may hold now: max_chunks unless "no space" cut it
        self._floor = min(max_chunks, max(1, max_chunks // LIMIT_SHARES))
        self._step = max(1, max_chunks // LIMIT_SHARES)
        self._last_full = self._last_cut = -math.inf
        # digest -> its lease's end; every renewal ends last (same lease_s), so the order is by expiry.
        self._held: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._loaded: set[str] = set()  # held chunks a load has read since: leased by that load
        self._unnamed: collections.deque[tuple[float, int]] = collections.deque()  # (expiry, chunks)
        self._unnamed_chunks = 0
        self._asking: collections.Counter[str] = collections.Counter()  # new chunks reserved, per lookup
        self._asking_unnamed = 0
        self.trimmed_lookups = 0  # lookups asked about fewer chunks than they named
        self.trimmed_chunks = 0
        self.renewed_chunks = 0  # chunks found again while held: counted once
        self.loaded_chunks = 0  # held chunks a load read: no longer counted while puts find room
        self.limit_cuts = 0  # times a "no space" answer halved the limit

    def held(self) -> int:
        """Chunks counted now: distinct chunks found within the last ``lease_s`` and not loaded since
        (loaded ones too while the limit is cut), or asked about and not answered."""
        now = self._clock()
        self._restore(now)
        held, loaded = self._held, self._loaded
        while held:
            digest, expiry = next(iter(held.items()))
            if expiry > now:
                break
            del held[digest]
            loaded.discard(digest)
        while self._unnamed and self._unnamed[0][0] <= now:
            self._unnamed_chunks -= self._unnamed.popleft()[1]
        found = len(held) if self.limit < self.max_chunks else len(held) - len(loaded)
        return found + self._unnamed_chunks + len(self._asking) + self._asking_unnamed

    def leased(self) -> int:
        """Distinct chunks the worker's lookups found within the last ``lease_s``, loaded or not."""
        self.held()
        return len(self._held) + self._unnamed_chunks

    def reserve(self, wanted: int, digests: Sequence[str] | KeyArray | None = None) -> Claim:
        """How many of a lookup's ``wanted`` leading chunks it may ask about, reserved until
        :meth:`settle`. With the chunks' ``digests``, a chunk counted already costs nothing, unless
        the ledger holds more than a cut limit: then nothing is granted (renewing would keep the
        excess pinned)."""
        room = self.limit - self.held()
        if digests is None or room < 0:
            granted = min(wanted, max(0, room))
            self._asking_unnamed += granted
            claim = Claim(granted, anonymous=granted)
        else:
            held, loaded, asking = self._held, self._loaded, self._asking
            counts_loaded = self.limit < self.max_chunks
            fresh: list[str] = []
            granted = 0
            for digest in digests[:wanted]:
                if digest not in asking and (digest not in held or (digest in loaded and not counts_loaded)):
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
        when they are not known) are held for ``lease_s`` from now, until loaded. A lookup that failed
        passes all it asked about (``claim.digests``, else ``claim.granted``): the store may have
        leased every one."""
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
        held, loaded = self._held, self._loaded
        for digest in found:
            if digest in held:
                self.renewed_chunks += 1
                held.move_to_end(digest)
            held[digest] = expiry
            loaded.discard(digest)  # found again: held for this lookup until its own load

    def loaded(self, digests: Iterable[str]) -> None:
        """A load reads these chunks (the rest of ``digests`` is not held): it leases them itself, so
        they stop counting while the limit is not cut."""
        held, loaded = self._held, self._loaded
        if not held:
            return
        for digest in digests:
            if digest in held and digest not in loaded:
                loaded.add(digest)
                self.loaded_chunks += 1

    def store_full(self) -> None:
        """A put answered "no space": the limit halves (at most once a quarter lease, never below a
        sixteenth of ``max_chunks``)."""
        now = self._clock()
        self._last_full = now
        if self.limit > self._floor and now - self._last_cut >= self.lease_s / CUTS_PER_LEASE:
            self.limit = max(self._floor, self.limit // 2)
            self._last_cut = now
            self.limit_cuts += 1

    def store_took(self) -> None:
        """A put call was taken whole: a cut limit gets a sixteenth of ``max_chunks`` back."""
        if self.limit < self.max_chunks:
            self.limit = min(self.max_chunks, self.limit + self._step)

    def _restore(self, now: float) -> None:
        # A lease without a "no space" answer: every lease from before the last one has run out.
        if self.limit < self.max_chunks and now - self._last_full >= self.lease_s:
            self.limit = self.max_chunks

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
        held = self.held()  # first: a limit due back is restored
        return {
            "max_chunks": self.max_chunks,
            "limit_chunks": self.limit,
            "lease_s": self.lease_s,
            "held_chunks": held,
            "leased_chunks": self.leased(),
            "trimmed_lookups": self.trimmed_lookups,
            "trimmed_chunks": self.trimmed_chunks,
            "renewed_chunks": self.renewed_chunks,
            "loaded_chunks": self.loaded_chunks,
            "limit_cuts": self.limit_cuts,
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
