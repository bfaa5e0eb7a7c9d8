"""One dispatcher batch: from drained requests to backend calls and back.

A batch runs these steps over everything the dispatcher drained:

1. hash the prompts on the loop, in short slices, so the loop never stalls;
2. build keys, and claim the store keys, so no key is written twice, by two requests of this batch
   or by two overlapping batches (a claimed key's outcome is shared with every request that has it);
3. one ``batch_exists`` for all keys;
4. per KV-cache group one ``prepare_values`` call (in the executor) for every chunk to move;
5. backend batch calls per group, split to at most ``max_regions_per_call`` regions each, so that no
   call holds the GIL for long while the binding converts its arguments;
6. per-chunk codes written back into each request.

The bookkeeping is vectorised over chunks: per key only hashing, string building and one dict
operation or two happen in Python.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ._arrays import IntArray
from .backends.base import NO_SPACE, NOT_FOUND, TRANSFER_FAILED, Backend, code_name
from .errors import AiokvError, BackendError, BackendUnavailableError, InvalidRequestError, WorkerClosedError
from .keys import chain_digests, digests_to_hex, token_bytes
from .layout import KVLayout
from .requests import (
    BACKEND_EXCEPTION,
    NOT_ATTEMPTED,
    PENDING,
    PRESENT,
    WRITER_CANCELLED,
    WRITTEN,
    Kind,
    Request,
    State,
    Wait,
)
from .stats import WorkerStats

logger = logging.getLogger("aiokv")

T = TypeVar("T")
InExecutor = Callable[..., Awaitable[Any]]

# Tokens hashed between yields to the loop (~0.5 ms): a Python list also pays its conversion to an
# array, about 3x the hashing, so it gets smaller slices.
_HASH_SLICE_TOKENS = {"array": 49152, "list": 16384}
_YIELD_EVERY_KEYS = 2048  # bookkeeping between yields to the loop


@dataclass(eq=False, slots=True)
class Cycle:
    """The keys of one batch and the outcome of the store keys it claimed."""

    outcomes_ready: asyncio.Future[None]
    keys: list[str] = field(default_factory=list)  # unique keys of the batch
    owned: IntArray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    outcome: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    claimed: list[str] = field(default_factory=list)
    _index: dict[str, int] | None = None

    def outcome_of(self, keys: Sequence[str]) -> IntArray:
        if self._index is None:  # only batches that other requests wait on need it
            self._index = {k: i for i, k in enumerate(self.keys)}
        index = self._index
        return self.outcome[np.fromiter((index[k] for k in keys), dtype=np.int64, count=len(keys))]


@dataclass(slots=True)
class _Rows:
    """Chunks of one request that one group moves: its block rows, and (for puts) key positions."""

    request: Request
    op: str  # "put" | "get"
    chunks: IntArray
    positions: IntArray


class BatchRunner:
    """Runs batches for a worker; owns the key claims and the store-pressure backoff."""

    def __init__(
        self,
        *,
        layouts: list[KVLayout],
        prefixes: list[str],
        chunk_tokens: int,
        seed: bytes,
        backend: Backend,
        stats: WorkerStats,
        max_regions_per_call: int,
        pressure_backoff_s: float,
        in_executor: InExecutor,
        complete: Callable[[Request], None],
        fail: Callable[[Request, BaseException], None],
    ) -> None:
        self.layouts = layouts
        self.prefixes = prefixes
        self.chunk_tokens = chunk_tokens
        self.seed = seed
        self.backend = backend
        self.stats = stats
        self.max_regions_per_call = max_regions_per_call
        self.pressure_backoff_s = pressure_backoff_s
        self._in_executor = in_executor
        self._complete = complete
        self._fail = fail
        self._claims: dict[str, Cycle] = {}
        self._backoff_until = 0.0

    # -- transfers ------------------------------------------------------------------------------

    async def run_transfers(self, batch: list[Request]) -> None:
        loop = asyncio.get_running_loop()
        cycle = Cycle(outcomes_ready=loop.create_future())
        self.stats.batches += 1
        try:
            live = await self._prepare_keys(batch, cycle)
            await self._claim(cycle, [r for r in live if r.kind is Kind.STORE])
            present = await self._exists(cycle, live)
            if present is not None:
                live = [r for r in live if not r.finished]
                plan = await self._decide(cycle, live, present, backing_off=loop.time() < self._backoff_until)
                await _all_settled(
                    self._transfer_group(cycle, g, rows) for g, rows in enumerate(plan) if rows
                )
        except Exception as exc:  # a bug, not a backend fault: fail this batch, keep serving
            logger.exception("aiokv: a batch of %d requests failed unexpectedly", len(batch))
            error = AiokvError(f"internal error in the dispatcher: {exc!r}")
            error.__cause__ = exc
            for request in batch:
                if request.state is State.TRANSFERRING:
                    request.error = error
                else:
                    self._fail(request, error)
        finally:
            self._release_claims(cycle)
        await self._finish(batch)

    async def _prepare_keys(self, requests: list[Request], cycle: Cycle) -> list[Request]:
        """Hash, build every key and its position in the batch's list of unique keys."""
        await self._hash(requests)
        live = [r for r in requests if not r.finished]
        done_keys = 0
        for request in live:
            hashes = request.hashes
            if hashes is None:
                raise AiokvError(f"request #{request.id} reached key building unhashed")
            request.keys = [[prefix + h for h in hashes] for prefix in self.prefixes]
            request.codes = [np.full(request.num_chunks, PENDING, dtype=np.int64) for _ in self.prefixes]
            done_keys += request.num_chunks * len(self.prefixes)
            if done_keys >= _YIELD_EVERY_KEYS:
                done_keys = 0
                await asyncio.sleep(0)
        every_key = [keys for r in live for keys in r.keys]
        unique = dict.fromkeys(itertools.chain.from_iterable(every_key))
        cycle.keys = list(unique)
        if len(unique) == sum(map(len, every_key)):
            # No key repeats (the usual case): positions are consecutive, no per-key lookups.
            offset = 0
            for request in live:
                request.positions = []
                for keys in request.keys:
                    request.positions.append(np.arange(offset, offset + len(keys), dtype=np.int64))
                    offset += len(keys)
        else:
            index = {k: i for i, k in enumerate(cycle.keys)}
            for request in live:
                request.positions = [
                    np.fromiter((index[k] for k in keys), dtype=np.int64, count=len(keys))
                    for keys in request.keys
                ]
                await asyncio.sleep(0)
        cycle.owned = np.zeros(len(cycle.keys), dtype=bool)
        cycle.outcome = np.full(len(cycle.keys), PENDING, dtype=np.int64)
        return live

    async def _hash(self, requests: list[Request]) -> None:
        """Chunk digests of requests that came with token ids, yielding to the loop between slices."""
        c = self.chunk_tokens
        for request in requests:
            if request.hashes is not None or request.finished:
                continue
            tokens = request.tokens
            digests: list[bytes] = []
            previous = self.seed
            per_slice = max(1, _HASH_SLICE_TOKENS["array" if isinstance(tokens, np.ndarray) else "list"] // c)
            try:
                for first in range(0, request.num_chunks, per_slice):
                    count = min(per_slice, request.num_chunks - first)
                    data = token_bytes(tokens[first * c : (first + count) * c])  # type: ignore[index]
                    digests += chain_digests(data, 4 * c, count, previous)
                    previous = digests[-1]
                    await asyncio.sleep(0)
            except (TypeError, ValueError) as exc:
                self._fail(request, InvalidRequestError(f"{request.kind.value} #{request.id}: {exc}"))
                continue
            request.hashes = digests_to_hex(digests)
            request.tokens = None

    async def _claim(self, cycle: Cycle, stores: list[Request]) -> None:
        """Claim the store keys nobody claimed; a key claimed by another batch makes a Wait."""
        claims = self._claims
        done_keys = 0
        for request in stores:
            for group, keys in enumerate(request.keys):
                owners = [claims.setdefault(k, cycle) for k in keys]
                if owners.count(cycle) == len(owners):
                    cycle.owned[request.positions[group]] = True
                    continue
                foreign = np.array([o is not cycle for o in owners], dtype=bool)
                cycle.owned[request.positions[group][~foreign]] = True
                for other in {id(o): o for o in owners if o is not cycle}.values():
                    mine = np.flatnonzero([o is other for o in owners])
                    request.waits.append(Wait(other, group, mine, [keys[i] for i in mine.tolist()]))
            done_keys += request.num_chunks * len(self.prefixes)
            if done_keys >= _YIELD_EVERY_KEYS:
                done_keys = 0
                await asyncio.sleep(0)
        cycle.claimed = _pick(cycle.keys, np.flatnonzero(cycle.owned))

    async def _exists(self, cycle: Cycle, live: list[Request]) -> IntArray | None:
        keys = cycle.keys
        if not keys:
            return np.zeros(0, dtype=bool)
        self.stats.backend_calls["exists"] += 1
        try:
            answer = await self._in_executor(self.backend.batch_exists, keys, lane="control")
            if len(answer) != len(keys):
                raise BackendError(f"batch_exists answered {len(answer)} values for {len(keys)} keys")
            return np.asarray(answer, dtype=bool)
        except Exception as exc:
            self.stats.backend_exceptions["exists"] += 1
            error = batch_error("batch_exists", exc)
            logger.warning("aiokv: batch_exists of %d keys failed: %s", len(keys), exc)
            for request in live:
                self._fail(request, error)
            return None

    async def _decide(
        self, cycle: Cycle, live: list[Request], present: IntArray, *, backing_off: bool
    ) -> list[list[_Rows]]:
        """Settle what needs no transfer; return per group the rows to move."""
        plan: list[list[_Rows]] = [[] for _ in self.layouts]
        taken = np.zeros(present.size, dtype=bool)  # store keys given a writer in this batch
        done_keys = 0
        for request in live:
            if request.kind is Kind.STORE:
                self._decide_store(cycle, request, present, taken, plan, backing_off=backing_off)
            else:
                self._decide_load(request, present, plan)
            done_keys += request.num_chunks * len(self.prefixes)
            if done_keys >= _YIELD_EVERY_KEYS:
                done_keys = 0
                await asyncio.sleep(0)
        return plan

    def _decide_store(
        self,
        cycle: Cycle,
        request: Request,
        present: IntArray,
        taken: IntArray,
        plan: list[list[_Rows]],
        *,
        backing_off: bool,
    ) -> None:
        for group, positions in enumerate(request.positions):
            codes = request.codes[group]
            own = cycle.owned[positions]
            if not own.any():
                continue
            found = own & present[positions]
            codes[found] = PRESENT
            cycle.outcome[positions[found]] = PRESENT
            missing = own & ~found
            if backing_off:
                codes[missing] = NO_SPACE
                cycle.outcome[positions[missing]] = NO_SPACE
                continue
            first = missing & ~taken[positions]
            duplicate = missing & ~first
            taken[positions[first]] = True
            if duplicate.any():
                chunks = np.flatnonzero(duplicate)
                request.waits.append(Wait(cycle, group, chunks, [request.keys[group][i] for i in chunks]))
            if first.any():
                chunks = np.flatnonzero(first)
                plan[group].append(_Rows(request, "put", chunks, positions[chunks]))

    def _decide_load(self, request: Request, present: IntArray, plan: list[list[_Rows]]) -> None:
        found = np.stack([present[positions] for positions in request.positions])
        holes = np.flatnonzero(~found.all(axis=0))
        prefix = int(holes[0]) if holes.size else request.num_chunks
        for group, codes in enumerate(request.codes):
            codes[prefix:] = np.where(found[group, prefix:], NOT_ATTEMPTED, NOT_FOUND)
            if prefix:
                chunks = np.arange(prefix, dtype=np.int64)
                plan[group].append(_Rows(request, "get", chunks, request.positions[group][:prefix]))

    async def _transfer_group(self, cycle: Cycle, group: int, plan: list[_Rows]) -> None:
        """One prepare_values call for the group, then its batch calls, then codes to each request.

        Rows are the chunks of ``plan`` back to back; calls write per-row codes into one array, so a
        call costs a few NumPy operations however many requests its rows belong to.
        """
        layout = self.layouts[group]
        lengths = np.fromiter((rows.chunks.size for rows in plan), dtype=np.int64, count=len(plan))
        offsets = np.zeros(len(plan) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        row_codes = np.full(int(offsets[-1]), PENDING, dtype=np.int64)
        row_errors: list[tuple[IntArray, BaseException]] = []
        matrix = np.concatenate([rows.request.blocks[group][rows.chunks] for rows in plan])
        try:
            region_batches = await self._in_executor(layout.regions_for_chunks, matrix, lane="control")
        except Exception as exc:
            error = AiokvError(f"computing the regions of group {group} failed: {exc!r}")
            error.__cause__ = exc
            row_codes[:] = BACKEND_EXCEPTION
            row_errors.append((np.arange(row_codes.size), error))
            region_batches = []
        # Requests cancelled while the regions were computed are dropped before any backend call;
        # the others are now in flight and their memory may be touched.
        alive = np.array([not rows.request.abandoned for rows in plan], dtype=bool)
        for rows, ok in zip(plan, alive.tolist(), strict=True):
            if ok:
                rows.request.state = State.TRANSFERRING
            elif rows.op == "put":
                cycle.outcome[rows.positions] = WRITER_CANCELLED
        plan_of_row = np.repeat(np.arange(len(plan)), lengths)
        is_put = np.array([rows.op == "put" for rows in plan], dtype=bool)[plan_of_row]
        live_row = alive[plan_of_row]
        row_keys = list(
            itertools.chain.from_iterable(_pick(rows.request.keys[group], rows.chunks) for rows in plan)
        )
        parts: list[tuple[str, IntArray, list[str], IntArray, IntArray]] = []
        for regions in region_batches:
            for op, wanted in (("put", is_put), ("get", ~is_put)):
                mask = wanted[regions.rows] & live_row[regions.rows]
                if not mask.any():
                    continue
                if mask.all():  # the usual case: no copy of the region arrays on the loop
                    rows_idx, addrs, sizes = regions.rows, regions.addrs, regions.sizes
                else:
                    rows_idx = regions.rows[mask]
                    addrs, sizes = regions.addrs[mask], regions.sizes[mask]
                per_call = max(1, self.max_regions_per_call // max(1, addrs.shape[1]))
                for start in range(0, rows_idx.size, per_call):
                    part = slice(start, start + per_call)
                    rows_part = rows_idx[part]
                    parts.append((op, rows_part, _pick_rows(row_keys, rows_part), addrs[part], sizes[part]))

        # Each answer is turned into codes as it arrives, so the loop never handles all calls at once.
        async def call(
            op: str, rows_part: IntArray, keys: list[str], addrs: IntArray, sizes: IntArray
        ) -> None:
            self.stats.backend_calls[op] += 1
            method = self.backend.batch_put if op == "put" else self.backend.batch_get
            answer: object
            try:
                answer = await self._in_executor(method, keys, addrs, sizes)
            except Exception as exc:
                answer = exc
            row_codes[rows_part] = self._codes(op, keys, sizes, answer, rows_part, row_errors)

        await _all_settled(call(*part) for part in parts)
        for j, rows in enumerate(plan):
            if alive[j]:
                codes = row_codes[offsets[j] : offsets[j + 1]]
                rows.request.codes[group][rows.chunks] = codes
                if rows.op == "put":
                    cycle.outcome[rows.positions] = codes
        for failed_rows, error in row_errors:
            for j in np.unique(plan_of_row[failed_rows]).tolist():
                if plan[j].request.error is None:
                    plan[j].request.error = error

    def _codes(
        self,
        op: str,
        keys: list[str],
        sizes: IntArray,
        answer: object,
        rows: IntArray,
        row_errors: list[tuple[IntArray, BaseException]],
    ) -> IntArray:
        """Per-key outcome codes of one backend batch call (``answer``: its result, or the Exception
        it raised)."""
        # The worker's sizes are often one row broadcast over every key: sum it once.
        expected = np.full(len(sizes), int(sizes[0].sum())) if sizes.strides[0] == 0 else sizes.sum(axis=1)
        if isinstance(answer, Exception) or len(answer) != len(keys):  # type: ignore[arg-type]
            exc = (
                answer
                if isinstance(answer, Exception)
                else BackendError(
                    f"batch_{op} answered {len(answer)} codes for {len(keys)} keys"  # type: ignore[arg-type]
                )
            )
            self.stats.backend_exceptions[op] += 1
            logger.warning("aiokv: batch_%s of %d keys failed: %s", op, len(keys), exc)
            row_errors.append((rows, batch_error(f"batch_{op}", exc)))
            return np.full(len(keys), BACKEND_EXCEPTION, dtype=np.int64)
        try:
            codes = np.asarray(answer, dtype=np.int64)
            if codes.shape != (len(keys),):
                raise ValueError(f"shape {codes.shape}")
        except (TypeError, ValueError, OverflowError) as exc:
            self.stats.backend_exceptions[op] += 1
            error = BackendError(f"batch_{op} answered something other than one int code per key: {exc}")
            row_errors.append((rows, error))
            return np.full(len(keys), BACKEND_EXCEPTION, dtype=np.int64)
        ok = codes >= 0
        if op == "get":
            # A read reporting another byte count did not fill the blocks as asked.
            codes = np.where(ok & (codes != expected), TRANSFER_FAILED, codes)
            ok = codes >= 0
            self.stats.bytes["get"] += int(expected[ok].sum())
        else:
            codes = np.where(ok, WRITTEN, codes)
            self.stats.bytes["put"] += int(expected[ok].sum())
            if (codes == NO_SPACE).any() and self.pressure_backoff_s > 0:
                self._enter_backoff()
        if not ok.all():
            failed = codes[~ok]
            self.stats.backend_errors.update(failed.tolist())
            if logger.isEnabledFor(logging.WARNING):
                # Counts by code, never the keys: a batch can hold thousands.
                values, counts = np.unique(failed, return_counts=True)
                pairs = zip(values.tolist(), counts.tolist(), strict=True)
                by_code = ", ".join(f"{code_name(v)} ({v}): {n}" for v, n in pairs)
                logger.warning(
                    "aiokv: batch_%s: %d of %d keys failed: %s", op, failed.size, len(keys), by_code
                )
        return codes

    def _enter_backoff(self) -> None:
        now = asyncio.get_running_loop().time()
        if now >= self._backoff_until:
            self.stats.pressure_backoffs += 1
            logger.warning("aiokv: store full (-200); backing off stores for %.2f s", self.pressure_backoff_s)
        self._backoff_until = now + self.pressure_backoff_s

    def _release_claims(self, cycle: Cycle) -> None:
        claims = self._claims
        for key in cycle.claimed:
            del claims[key]  # only the claiming batch removes a claim
        cycle.outcome[cycle.owned & (cycle.outcome == PENDING)] = WRITER_CANCELLED
        if not cycle.outcomes_ready.done():
            cycle.outcomes_ready.set_result(None)

    async def _finish(self, batch: list[Request]) -> None:
        """Resolve shared chunks from their writers' outcomes; complete every request."""
        for request in batch:
            if request.finished:
                continue
            for wait in request.waits:
                await wait.cycle.outcomes_ready
                outcome = wait.cycle.outcome_of(wait.keys)
                request.codes[wait.group][wait.chunks] = np.where(outcome >= 0, PRESENT, outcome)
            self._complete(request)

    # -- lookups --------------------------------------------------------------------------------

    async def run_lookups(self, batch: list[Request]) -> None:
        cycle = Cycle(outcomes_ready=asyncio.get_running_loop().create_future())
        try:
            live = await self._prepare_keys(batch, cycle)
            present = await self._exists(cycle, live)
            if present is None:
                return
            for request in live:
                if not request.finished:
                    request.codes = [present[p].astype(np.int64) for p in request.positions]
                    self._complete(request)
        except Exception as exc:
            logger.exception("aiokv: a lookup batch failed unexpectedly")
            error = AiokvError(f"internal error in lookup: {exc!r}")
            error.__cause__ = exc
            for request in batch:
                self._fail(request, error)


async def _all_settled(coroutines: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Await every coroutine to its end, then raise the first error: a plain gather would hand an
    error on while other backend calls still run on the requests' memory."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _pick_rows(items: list[str], rows: IntArray) -> list[str]:
    """``items`` at ``rows``, by slicing when the rows are consecutive (the usual case)."""
    first, last = int(rows[0]), int(rows[-1])
    return items[first : last + 1] if last - first + 1 == rows.size else _pick(items, rows)


def _pick(items: Sequence[str], index: IntArray) -> list[str]:
    """``[items[i] for i in index]`` at C speed."""
    if index.size == 1:
        return [items[int(index[0])]]
    return list(operator.itemgetter(*index.tolist())(items)) if index.size else []


def batch_error(call: str, exc: BaseException) -> AiokvError:
    """An aiokv error for a failed backend call, keeping the cause and whether the store is gone."""
    if isinstance(exc, WorkerClosedError):  # terminate() dropped the call before it started
        return WorkerClosedError(f"{call} was not run: {exc}")
    if isinstance(exc, BackendUnavailableError):
        error: BackendError = BackendUnavailableError(
            f"{call} failed: {exc}", code=exc.code, address=exc.address
        )
    else:
        error = BackendError(f"{call} failed: {exc}", code=getattr(exc, "code", None))
    error.__cause__ = exc
    return error
