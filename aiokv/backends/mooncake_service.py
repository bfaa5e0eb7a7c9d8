"""A Mooncake client attached to a client service on this host, through shared memory.

Mooncake's client service (``mooncake_client``) is a long-lived process that holds a segment and runs
the transfer engine; a process on the same host attaches to it (``setup_dummy``) and hands it buffers
inside shared memory that both have mapped. Reading a value the service holds is then a memory copy
in the service, where a client of another process's segment over TCP pays ~0.6 CPU s per GB
(docs/benchmarks.md). The service accepts only its shared memory, one contiguous buffer per key, so
a transfer here is staged: a put gathers each key's regions from registered memory into a staging
lane and hands the lane's slots to the service; a get has the service fill the slots and scatters
them into the keys' regions before it returns, so no caller memory is touched once the call is over.
A call that fails in the RPC (a timeout, a lost connection) may still be served later, so its lane is
retired rather than reused.

:class:`ServiceStaging` owns the staging buffer (``local_buffer_size``, cut into lanes so concurrent
transfer threads never share bytes); :class:`StagedForm` is the call form the backend's put retries
and get rounds use, as :class:`~.mooncake_calls.CallForm` is for a client with its own engine.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import IntArray
from ..codes import Code
from ..errors import BackendError, BackendUnavailableError
from ._copies import _exclusive_cumsum, gather, offsets_within_keys, scatter, select_keys
from ._regions import RegionTable, RegisteredMemory
from .mooncake_config import MooncakeConfig

logger = logging.getLogger("aiokv.backends.mooncake")

_INVALID = int(Code.INVALID)
_TRANSFER_FAILED = int(Code.TRANSFER_FAILED)
# The call itself failed (a timeout or a lost connection): the service may still hold the request and
# read or write its lane later.
_RPC_FAILED = int(Code.UNAVAILABLE)
# The staging buffer is cut into this many lanes: the worker's transfer threads each hold one.
STAGING_LANES = 2
# setup_dummy maps a buffer of its own for calls aiokv never makes (put/get of Python bytes).
_SERVICE_LOCAL_BUFFER = 1 << 20


@dataclass(frozen=True, slots=True)
class _Piece:
    """Keys of one native call through a lane: their rows in the transfer, their slots (byte offsets
    in the staging buffer, back to back from the lane's start) and their values' sizes."""

    rows: IntArray
    slots: IntArray
    totals: IntArray


def attach(store: Any, config: MooncakeConfig, memory: RegisteredMemory) -> ServiceStaging:
    """Attach ``store`` (a fresh ``MooncakeDistributedStore``) to ``config.client_service`` and map the
    staging buffer shared with it; ``memory`` is the backend's registered memory."""
    service = config.client_service
    rc = int(store.setup_dummy(0, _SERVICE_LOCAL_BUFFER, service))
    if rc != 0:
        raise BackendUnavailableError(
            f"cannot attach to the Mooncake client service at {service} ({rc}): is `mooncake_client "
            f"--port={service.rpartition(':')[2]}` running on this host?",
            code=rc,
            address=service,
        )
    try:
        return ServiceStaging(store, config.local_buffer_size, memory, service)
    except BaseException:
        store.close()
        raise


class ServiceStaging:
    """The shared staging buffer of an attached client, in lanes, and the staged transfers.

    ``memory`` is the backend's registered memory: every region reaching :meth:`put` or :meth:`get`
    was proven inside it, and the copies address it through one view of its span.
    """

    def __init__(self, store: Any, size: int, memory: RegisteredMemory, service: str) -> None:
        self._memory = memory
        self._service = service
        self.lane_bytes = size // STAGING_LANES
        total = self.lane_bytes * STAGING_LANES
        base = int(store.alloc_from_mem_pool(total))
        if base <= 0:
            raise BackendUnavailableError(
                f"Mooncake client service {service}: no shared staging buffer of {total} bytes", code=base
            )
        rc = int(store.register_buffer(base, total))
        if rc != 0:
            raise BackendUnavailableError(
                f"Mooncake client service {service} refused the staging buffer ({rc})", code=rc
            )
        self.base = base
        shared = (ctypes.c_uint8 * total).from_address(base)
        self._bytes: npt.NDArray[np.uint8] = np.ctypeslib.as_array(shared)
        self._free = [lane * self.lane_bytes for lane in range(STAGING_LANES)]
        self._live = STAGING_LANES
        self._lane_changed = threading.Condition()

    @property
    def live_lanes(self) -> int:
        """Lanes still in use: a lane whose call failed in the RPC is retired for good."""
        with self._lane_changed:
            return self._live

    def put(self, store: Any, keys: list[str], table: RegionTable, replicate: Any) -> list[int]:
        """Per key 0 or a negative code, as ``batch_put_from_multi_buffers`` answers. A key given twice
        keeps its first value (as there): only its first occurrence is put."""
        first: dict[str, int] = {}
        for k, key in enumerate(keys):
            first.setdefault(key, k)
        rows = np.fromiter(first.values(), dtype=np.int64, count=len(first))
        unique = select_keys(table, rows)
        base, space = self._space()

        def put_piece(piece: _Piece) -> list[int]:
            sub = select_keys(unique, piece.rows)
            start = int(piece.slots[0])
            gather(space, sub.addrs - base, sub.sizes, self._bytes[start : start + int(piece.totals.sum())])
            names = [keys[k] for k in rows[piece.rows].tolist()]
            answers = store.batch_put_from(names, self._addresses(piece), piece.totals.tolist(), replicate)
            return [int(code) for code in answers]

        answers = self._staged("batch_put_from", unique, put_piece)
        by_row = dict(zip(rows.tolist(), answers, strict=True))
        return [by_row[first[key]] for key in keys]

    def get(self, store: Any, keys: list[str], table: RegionTable) -> list[int]:
        """Per key the bytes read or a negative code, as ``batch_get_into_multi_buffers`` answers.
        The keys are distinct (the backend makes repeated keys in rounds)."""
        base, space = self._space()

        def get_piece(piece: _Piece) -> list[int]:
            names = [keys[k] for k in piece.rows.tolist()]
            answers = store.batch_get_into(names, self._addresses(piece), piece.totals.tolist())
            native = np.asarray(answers, dtype=np.int64)
            if native.size != len(names):
                return [int(code) for code in native]  # refused by _staged, nothing scattered
            read = np.flatnonzero(native == piece.totals)
            if read.size:
                sub = select_keys(table, piece.rows[read])
                source = np.repeat(piece.slots[read], np.diff(sub.offsets)) + offsets_within_keys(sub)
                scatter(self._bytes, source, sub.sizes, space, sub.addrs - base)
            # A value smaller than its regions is read and answered by its size: the multi-buffer form
            # answers -800 there, and so does this one.
            return [
                code if code < 0 or code == size else _TRANSFER_FAILED
                for code, size in zip(native.tolist(), piece.totals.tolist(), strict=True)
            ]

        return self._staged("batch_get_into", table, get_piece)

    # -- internals ------------------------------------------------------------------------------

    def _staged(self, call: str, table: RegionTable, move: Callable[[_Piece], list[int]]) -> list[int]:
        """Run ``move`` over pieces of the keys that fit a lane, holding one lane; a key larger than a
        lane is answered INVALID without a call."""
        totals = table.key_totals()
        codes = [_INVALID] * table.num_keys
        too_large = np.flatnonzero(totals > self.lane_bytes)
        if too_large.size:
            logger.warning(
                "Mooncake client service %s: %d values larger than a staging lane (%d bytes, half of "
                "local_buffer_size) answered %d; raise local_buffer_size",
                self._service,
                too_large.size,
                self.lane_bytes,
                _INVALID,
            )
        lane = self._take_lane()
        retired = False
        try:
            for rows in _pieces(totals, self.lane_bytes):
                if retired:  # the rest of the batch is not sent
                    answers = [_RPC_FAILED] * rows.size
                else:
                    answers = move(_Piece(rows, lane + _exclusive_cumsum(totals[rows]), totals[rows]))
                    # A timed-out call may still be served: the service would then read or write this
                    # lane while a later call uses it.
                    retired = _RPC_FAILED in answers
                    if len(answers) != rows.size:
                        raise BackendError(
                            f"Mooncake {call} (client service {self._service}) answered {len(answers)} "
                            f"codes for {rows.size} keys"
                        )
                for k, code in zip(rows.tolist(), answers, strict=True):
                    codes[k] = code
        finally:
            self._return_lane(lane, retired)
        return codes

    def _take_lane(self) -> int:
        with self._lane_changed:
            while not self._free and self._live:
                self._lane_changed.wait()
            if not self._free:
                raise BackendUnavailableError(
                    f"Mooncake client service {self._service}: every staging lane was retired after calls "
                    "that failed in the RPC (the service may still use them); close this backend and "
                    "attach a new one",
                    code=_RPC_FAILED,
                    address=self._service,
                )
            return self._free.pop()

    def _return_lane(self, lane: int, retired: bool) -> None:
        with self._lane_changed:
            if retired:
                self._live -= 1
                logger.error(
                    "Mooncake client service %s: a call failed in the RPC; its staging lane at offset %d "
                    "is retired (%d of %d left)",
                    self._service,
                    lane,
                    self._live,
                    STAGING_LANES,
                )
            else:
                self._free.append(lane)
            self._lane_changed.notify_all()

    def _addresses(self, piece: _Piece) -> list[int]:
        return (self.base + piece.slots).tolist()  # type: ignore[no-any-return]

    def _space(self) -> tuple[int, npt.NDArray[np.uint8]]:
        space = self._memory.address_space()
        if space is None:  # unreachable: a proven region lies in registered memory
            raise BackendUnavailableError("no registered memory to copy staged values to or from")
        return space[0], np.ctypeslib.as_array(space[1])


@dataclass(frozen=True, slots=True)
class StagedForm:
    """The proven keys' regions of one transfer through a client service (see the module docstring),
    with the interface of :class:`~.mooncake_calls.CallForm`."""

    staging: ServiceStaging
    table: RegionTable
    put_name = "batch_put_from (client service)"
    get_name = "batch_get_into (client service)"

    def only(self, positions: Sequence[int]) -> StagedForm:
        return StagedForm(self.staging, select_keys(self.table, np.asarray(positions, dtype=np.int64)))

    def put(self, store: Any, keys: list[str], replicate: Any) -> Sequence[int]:
        return self.staging.put(store, keys, self.table, replicate)

    def get(self, store: Any, keys: list[str], prefer_same_node: bool) -> Sequence[int]:
        return self.staging.get(store, keys, self.table)

    def get_answers(self, native: Sequence[int]) -> list[int]:
        return list(native)


def _pieces(totals: IntArray, limit: int) -> Iterator[IntArray]:
    """Consecutive runs of the keys whose values fit ``limit`` bytes together (larger keys skipped)."""
    fits = np.flatnonzero(totals <= limit)
    start = 0
    while start < fits.size:
        ends = np.cumsum(totals[fits[start:]])
        count = max(1, int(np.searchsorted(ends, limit, side="right")))
        yield fits[start : start + count]
        start += count
