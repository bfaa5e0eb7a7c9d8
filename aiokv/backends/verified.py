"""Values that check themselves on load: a backend wrapper over any backend.

:class:`VerifiedBackend` appends a 64-byte header (:mod:`aiokv.backends.value_header`) to every value
it puts: the xxh3-64 checksum of the value's bytes, a digest of its key and a digest of a fingerprint
of what the bytes mean. A get reads the header with the value (one more region per key, from the
wrapper's own registered :class:`~aiokv.backends.header_arena.HeaderArena`) and answers a key
``VERIFY_FAILED`` (-13) unless the header is there, names the same key and fingerprint, and the bytes
that landed hash to its checksum. The worker then counts the chunk failed (``backend_errors``, the
load's ``failed_block_ids``) and the engine recomputes it.

Checksums are computed in place: over memoryviews of the caller's registered memory (proven inside
it first, as every backend does), never over a copy. xxhash releases the GIL on large buffers, so
the hashing of one transfer thread runs beside the others (figures in docs/benchmarks.md).

A value that fails for its bytes or its framing is removed from the store (``batch_remove(force=True)``,
when the store has it), so the next store of that chunk writes it again instead of skipping a key
that exists; a value of another fingerprint is left alone (it is another engine's good value).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from .._arrays import BoolArray, IntArray
from ..codes import Code
from ..errors import BackendError
from ._copies import select_keys
from ._regions import Regions, RegionTable, RegisteredMemory, check_keys
from .base import Backend, ClosingContext, backend_traits, check_backend
from .header_arena import DEFAULT_PAGES, SLOTS_PER_PAGE, HeaderArena
from .value_header import HEADER_BYTES, MISMATCHES, NO_MISMATCH, Headers, Mismatch, digest, fill, mismatches

logger = logging.getLogger("aiokv")

INVALID, TRANSFER_FAILED, VERIFY_FAILED = (
    int(Code.INVALID),
    int(Code.TRANSFER_FAILED),
    int(Code.VERIFY_FAILED),
)
LOGGED_KEYS_KEPT = 65536  # keys whose failure was logged, remembered so that each is logged once
# Members the wrapper hands through unchanged when the inner backend has them.
_PASSED_THROUGH = frozenset({"batch_remove", "batch_exists_leased", "health_check", "config"})

Read = Callable[[Sequence[str], Regions, Regions], list[int]]


class VerifiedBackend(ClosingContext):
    """``inner`` with every value checked on load against its checksum, key and ``fingerprint``.

    ``fingerprint``: bytes naming what a value's bytes mean (dtype, block geometry, layout kind,
    model, ISA: whatever makes two engines' KV incompatible); values written under another
    fingerprint are refused. ``close_inner``: whether :meth:`close` closes ``inner`` too (False when
    ``inner`` is shared and closed by its owner). Values written without the wrapper are 64 bytes
    shorter than a verified get asks for: the store answers a size mismatch (-800 or -600), never
    their bytes as loaded.
    """

    supports_device_memory = False  # the checksum reads the bytes with the CPU

    def __init__(
        self, inner: Backend, fingerprint: bytes, *, close_inner: bool = True, pages: int = DEFAULT_PAGES
    ) -> None:
        check_backend(inner)
        if not isinstance(fingerprint, bytes) or not fingerprint:
            raise TypeError(f"fingerprint must be non-empty bytes, got {fingerprint!r}")
        self.inner = inner
        self.fingerprint = fingerprint
        self._fingerprint_digest = digest(fingerprint)
        self._close_inner = close_inner
        traits = backend_traits(inner)
        # One more region per key: half the inner limit covers keys of one region and more.
        self.max_regions_per_call = max(2, traits.max_regions_per_call // 2)
        self.exists_in_process = traits.exists_in_process
        self._memory = RegisteredMemory()
        self._space: tuple[int, memoryview] | None = None
        self._arena = HeaderArena(pages)
        inner.register_buffer(self._arena.address, self._arena.nbytes)
        self._lock = threading.Lock()
        self._failures: Counter[Mismatch] = Counter()
        self._verified = 0
        self._checksum_ns = 0  # thread CPU time spent hashing, puts and gets
        self._checksum_bytes = 0
        self._read_checksum_ns = 0  # of it, hashing what gets read (on a load's critical path)
        self._logged: dict[str, None] = {}
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is not None and name in _PASSED_THROUGH:
            return getattr(inner, name)
        if inner is not None and name == "read_from_replicas":
            # Same arguments and answers as a get: verified the same way.
            return functools.partial(self._verified_get, getattr(inner, name))
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # -- protocol -------------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        self._check_open()
        self.inner.register_buffer(addr, size)
        self._memory.add(addr, size)
        self._map_space()

    def unregister_buffer(self, addr: int) -> None:
        self._check_open()
        self._memory.remove(addr)
        self._map_space()
        unregister = getattr(self.inner, "unregister_buffer", None)
        if unregister is not None:
            unregister(addr)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return self.inner.batch_exists(keys)

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        check_keys(keys)
        codes = [INVALID] * len(keys)
        for part, part_keys, sub, base, space in self._pages(keys, addrs, sizes):
            checksums = self._timed_checksums(sub, base, space)
            with self._arena.page(len(part_keys)) as (headers, first):
                fill(headers, sub.key_totals(), checksums, part_keys, self._fingerprint_digest)
                answer = self.inner.batch_put(part_keys, *_with_headers(sub, first))
            _scatter_codes(codes, part, answer)
        return codes

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._verified_get(self.inner.batch_get, keys, addrs, sizes)

    def close(self) -> None:
        """Stop taking calls; release the header arena from ``inner`` and close it if it is ours."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        unregister = getattr(self.inner, "unregister_buffer", None)
        if self._close_inner:
            self.inner.close()
        elif unregister is not None and not getattr(self.inner, "closed", False):
            try:
                unregister(self._arena.address)
            except Exception:  # the owner may have closed it meanwhile: nothing is left to release
                logger.debug("aiokv: releasing the header arena failed", exc_info=True)

    # -- extras ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def verification_stats(self) -> dict[str, int]:
        """Keys read and verified, keys refused by reason (``format``, ``length``, ``identity``,
        ``fingerprint``, ``checksum``), and the bytes hashed and thread CPU nanoseconds spent hashing
        them (``checksum_bytes``, ``checksum_cpu_ns``; puts and gets; ``checksum_read_cpu_ns``: gets only),
        since the wrapper was built."""
        with self._lock:
            return {
                "verified": self._verified,
                **{m.value: self._failures[m] for m in Mismatch},
                "checksum_bytes": self._checksum_bytes,
                "checksum_cpu_ns": self._checksum_ns,
                "checksum_read_cpu_ns": self._read_checksum_ns,
            }

    def __repr__(self) -> str:
        return f"VerifiedBackend({self.inner!r}, fingerprint={self.fingerprint!r})"

    # -- internals ------------------------------------------------------------------------------

    def _verified_get(self, read: Read, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        check_keys(keys)
        codes = [INVALID] * len(keys)
        for part, part_keys, sub, base, space in self._pages(keys, addrs, sizes):
            lengths = sub.key_totals()
            with self._arena.page(len(part_keys)) as (headers, first):
                answer = read(part_keys, *_with_headers(sub, first))
                # Copied out before the page goes back to the arena.
                framing = mismatches(headers, lengths, part_keys, self._fingerprint_digest)
                stored = headers.copy()
            checked = self._check_answers(part_keys, sub, lengths, answer, framing, stored, base, space)
            _scatter_codes(codes, part, checked)
        return codes

    def _check_answers(
        self,
        keys: list[str],
        sub: RegionTable,
        lengths: IntArray,
        answer: Sequence[int],
        framing: npt.NDArray[np.int8],
        stored: Headers,
        base: int,
        space: memoryview,
    ) -> list[int]:
        """The caller's codes from ``answer`` (the inner get's per-key codes): the caller's byte count
        where the value verified, else a failure code. Vectorised over the keys."""
        if len(answer) != len(keys):
            raise BackendError(
                f"{type(self.inner).__name__} answered {len(answer)} codes for {len(keys)} keys"
            )
        codes = np.array([int(code) for code in answer], dtype=np.int64)
        read = codes >= 0
        # A size not asked for: the engine would not trust it either.
        whole = codes == lengths + HEADER_BYTES
        codes[read & ~whole] = TRANSFER_FAILED
        framed = np.flatnonzero(whole & (framing == NO_MISMATCH))
        if framed.size:
            sums = self._timed_checksums(select_keys(sub, framed), base, space, reading=True)
            actual = np.array(sums, dtype=np.uint64)
            framing[framed[stored["checksum"][framed] != actual]] = MISMATCHES.index(Mismatch.CHECKSUM)
        verified = whole & (framing == NO_MISMATCH)
        failed = np.flatnonzero(whole & ~verified)
        codes[verified] = lengths[verified]
        codes[failed] = VERIFY_FAILED
        found = [(int(i), MISMATCHES[framing[i]]) for i in failed.tolist()]
        with self._lock:
            self._verified += int(np.count_nonzero(verified))
            self._failures.update(mismatch for _, mismatch in found)
        if found:
            self._report(keys, found, stored, lengths)
        return codes.tolist()

    def _report(
        self, keys: list[str], failed: list[tuple[int, Mismatch]], stored: Headers, lengths: IntArray
    ) -> None:
        """Log each key's first failure, and drop values that can never verify."""
        with self._lock:
            fresh = [(i, m) for i, m in failed if keys[i] not in self._logged]
            for i, _ in fresh:
                self._logged[keys[i]] = None
            while len(self._logged) > LOGGED_KEYS_KEPT:
                del self._logged[next(iter(self._logged))]
        for i, mismatch in fresh:
            logger.warning(
                "aiokv: the value of %s failed verification (%s: %s); the chunk is reported VERIFY_FAILED "
                "and recomputed",
                keys[i],
                mismatch.value,
                _what_differed(mismatch, stored[i], int(lengths[i]), self.fingerprint),
            )
        broken = [keys[i] for i, mismatch in failed if mismatch is not Mismatch.FINGERPRINT]
        remove = getattr(self.inner, "batch_remove", None)
        if broken and remove is not None:
            try:
                remove(broken, force=True)
            except Exception as exc:  # a failed clean-up leaves the value failing, still never loaded
                logger.warning(
                    "aiokv: removing %d values that failed verification failed: %s", len(broken), exc
                )

    def _pages(
        self, keys: Sequence[str], addrs: Regions, sizes: Regions
    ) -> Iterator[tuple[IntArray, list[str], RegionTable, int, memoryview]]:
        """The keys proven inside registered memory, a header page's worth at a time: their rows in
        the call, their keys, their regions, and the view of registered memory to read them through."""
        table = RegionTable.from_arguments(keys, addrs, sizes)
        rows, base, space = self._proven(table)
        for start in range(0, rows.size, SLOTS_PER_PAGE):
            part = rows[start : start + SLOTS_PER_PAGE]
            yield part, [keys[k] for k in part.tolist()], select_keys(table, part), base, space

    def _timed_checksums(
        self, table: RegionTable, base: int, space: memoryview, *, reading: bool = False
    ) -> list[int]:
        """:func:`region_checksums`, its thread CPU time counted (what verification costs, in stats)."""
        started = time.thread_time_ns()
        sums = region_checksums(table, base, space)
        spent = time.thread_time_ns() - started
        with self._lock:
            self._checksum_ns += spent
            if reading:
                self._read_checksum_ns += spent
            self._checksum_bytes += int(table.sizes.sum())
        return sums

    def _proven(self, table: RegionTable) -> tuple[IntArray, int, memoryview]:
        """The rows of keys whose regions all lie in memory registered through the wrapper (and in
        the view of it taken now), with that view; the others are answered ``INVALID`` untouched."""
        space = self._space
        valid: BoolArray = self._memory.valid_keys(table)
        if space is None:
            return np.empty(0, dtype=np.int64), 0, memoryview(b"")
        base, view = space
        # A buffer registered after the view was taken is outside it: refused, not read past the view.
        outside = (table.addrs < base) | (table.addrs - base > len(view) - table.sizes)
        if outside.any():
            counts = np.zeros(table.addrs.size + 1, dtype=np.int64)
            np.cumsum(outside, out=counts[1:])
            valid &= counts[table.offsets[1:]] == counts[table.offsets[:-1]]
        return np.flatnonzero(valid), base, view

    def _map_space(self) -> None:
        """One memoryview over all registered memory (see ``RegisteredMemory.address_space``)."""
        space = self._memory.address_space()
        self._space = None if space is None else (space[0], memoryview(space[1]).cast("B"))

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("VerifiedBackend is closed")


def region_checksums(table: RegionTable, base: int, space: memoryview) -> list[int]:
    """Per key, xxh3-64 of its regions back to back, read in place (no copy). Regions of a key that
    lie back to back in memory (a block-major key's pages) are hashed as one span: one call instead of
    a streaming state per key, the same digest."""
    starts = table.addrs - base
    ends = starts + table.sizes
    # A span begins at each key's first region and wherever a region does not continue the previous.
    begins = np.ones(starts.size, dtype=bool)
    begins[1:] = starts[1:] != ends[:-1]
    begins[table.offsets[:-1][np.diff(table.offsets) > 0]] = True
    first_regions = np.flatnonzero(begins)
    span_starts = starts[first_regions].tolist()
    span_ends = ends[np.append(first_regions[1:] - 1, starts.size - 1)].tolist() if starts.size else []
    spans_before = np.zeros(starts.size + 1, dtype=np.int64)
    np.cumsum(begins, out=spans_before[1:])
    bounds = spans_before[table.offsets].tolist()
    digest_of = xxhash.xxh3_64_intdigest
    if len(span_starts) == table.num_keys and all(a < b for a, b in itertools.pairwise(bounds)):
        return [digest_of(space[a:b]) for a, b in zip(span_starts, span_ends, strict=True)]
    sums = []
    for first, last in itertools.pairwise(bounds):
        if last - first == 1:
            sums.append(digest_of(space[span_starts[first] : span_ends[first]]))
            continue
        state = xxhash.xxh3_64()
        for j in range(first, last):
            state.update(space[span_starts[j] : span_ends[j]])
        sums.append(state.intdigest())
    return sums


def _with_headers(table: RegionTable, first_header: int) -> tuple[Regions, Regions]:
    """The table's regions with key ``k``'s header slot appended to its regions."""
    n = table.num_keys
    header_addrs = first_header + np.arange(n, dtype=np.int64) * HEADER_BYTES
    addrs = np.insert(table.addrs, table.offsets[1:], header_addrs)
    sizes = np.insert(table.sizes, table.offsets[1:], HEADER_BYTES)
    counts = np.diff(table.offsets) + 1
    if n and (counts == counts[0]).all():
        width = int(counts[0])
        return addrs.reshape(n, width), sizes.reshape(n, width)
    bounds = (table.offsets + np.arange(n + 1)).tolist()
    flat_addrs, flat_sizes = addrs.tolist(), sizes.tolist()
    return (
        [flat_addrs[bounds[k] : bounds[k + 1]] for k in range(n)],
        [flat_sizes[bounds[k] : bounds[k + 1]] for k in range(n)],
    )


def _scatter_codes(codes: list[int], rows: IntArray, answer: Sequence[int]) -> None:
    if len(answer) != rows.size:
        raise BackendError(f"the inner backend answered {len(answer)} codes for {rows.size} keys")
    if rows.size == len(codes):  # every key proven, in one page: rows are 0..n-1
        codes[:] = [int(code) for code in answer]
        return
    for k, code in zip(rows.tolist(), answer, strict=True):
        codes[k] = int(code)


def _what_differed(mismatch: Mismatch, header: Any, length: int, fingerprint: bytes) -> str:
    if mismatch is Mismatch.FORMAT:
        return "no verified-value header where it belongs (written without verification, or overwritten)"
    if mismatch is Mismatch.LENGTH:
        return f"the header describes {int(header['length'])} bytes, the value holds {length}"
    if mismatch is Mismatch.IDENTITY:
        return f"it is another key's value (key digest {bytes(header['key']).hex()})"
    if mismatch is Mismatch.FINGERPRINT:
        return (
            f"written under another fingerprint (digest {bytes(header['fingerprint']).hex()}, "
            f"this reader's is {digest(fingerprint).hex()}: {fingerprint.decode(errors='replace')})"
        )
    return f"its bytes hash to another checksum than the {int(header['checksum']):#018x} stored with them"
