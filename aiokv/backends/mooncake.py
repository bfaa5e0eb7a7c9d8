"""The Mooncake backend: the protocol over ``mooncake.store.MooncakeDistributedStore``.

Mooncake trusts its caller completely: a call after ``close()``, or a region outside mapped memory,
kills the process with SIGSEGV. So nothing reaches the native store unchecked: calls after
:meth:`MooncakeBackend.close` raise, ``close`` waits for calls in flight, and every region of every
key is proven inside memory registered through :meth:`MooncakeBackend.register_buffer` first (a key
that fails gets ``INVALID``, -600, and is left out of the native call).

Configuration is written the way vLLM/LMCache users already write it (see :class:`MooncakeConfig`).
``mooncake`` is imported only when a backend is constructed, never by ``import aiokv``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .._arrays import BoolArray
from ..codes import Code, code_name
from ..errors import BackendError, BackendUnavailableError, InvalidRequestError
from ._regions import Regions, RegionTable, RegisteredMemory, check_keys
from .base import ClosingContext
from .mooncake_binding import TCP_QUEUE_ENV, import_store
from .mooncake_calls import CallForm, call_form, distinct_rounds, prove, region_lists
from .mooncake_config import (
    CONFIG_ENV_VAR,
    DEFAULT_GLOBAL_SEGMENT_SIZE,
    DEFAULT_LOCAL_BUFFER_SIZE,
    INSTALL_HINT,
    MIN_GLOBAL_SEGMENT_SIZE,
    MooncakeConfig,
    parse_size,
)
from .mooncake_extras import MooncakeExtras
from .mooncake_replicas import ReplicaReader
from .mooncake_service import ServiceStaging, StagedForm, attach

logger = logging.getLogger("aiokv.backends.mooncake")

# The config names are importable from here too, as the docs show.
__all__ = [
    "CONFIG_ENV_VAR",
    "DEFAULT_GLOBAL_SEGMENT_SIZE",
    "DEFAULT_LOCAL_BUFFER_SIZE",
    "INSTALL_HINT",
    "MIN_GLOBAL_SEGMENT_SIZE",
    "MooncakeBackend",
    "MooncakeConfig",
    "parse_size",
    "region_lists",
]

_TRANSFER_FAILED = int(Code.TRANSFER_FAILED)
# Codes meaning the master could not be asked: the batch fails as a whole.
_UNAVAILABLE_CODES = frozenset({int(Code.UNAVAILABLE), int(Code.INTERNAL)})


class MooncakeBackend(MooncakeExtras, ClosingContext):
    """The backend protocol over a Mooncake distributed store client.

    ``config`` is a :class:`MooncakeConfig`, a dict, a JSON file path, or ``None`` to read the file
    named by ``MOONCAKE_CONFIG_PATH``. Construction connects to the master (blocking, tens of ms);
    :meth:`close` takes 1-2 s. Status codes pass through unchanged, except that ``-900``/``-1``
    (master unreachable) raise :class:`~aiokv.errors.BackendUnavailableError` naming the master.
    A put of a key that already exists (or that another client is still writing) keeps the old value
    and reports 0; keys a put fails with -800 are put again up to :attr:`put_retries` times. Beyond the
    protocol: :class:`~.mooncake_extras.MooncakeExtras` (replica reads, replica endpoints, ``health_check``).
    """

    # The binding converts ~12 us of Python ints per 96-region key while it holds the GIL
    # (docs/benchmarks.md): 8192 regions per call keep that near 1 ms, so the event loop never waits long.
    max_regions_per_call = 8192
    # Puts failing -800 (a replica placed on a dead client's segment) are tried again this many times:
    # the master places about half of them there again, so each retry halves what fails: 16 leave a
    # re-store after a node loss all but certain to succeed, where 8 still failed a key now and then.
    put_retries = 16

    def __init__(
        self, config: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None
    ) -> None:
        self.config = MooncakeConfig.load(config)
        store_class, replicate_class = import_store()
        for name, value in TCP_QUEUE_ENV.items():
            os.environ.setdefault(name, value)
        self._replicate = replicate_class()
        self._replicate.replica_num = self.config.replica_num
        if self.config.preferred_segment:
            self._replicate.preferred_segment = self.config.preferred_segment
        if self.config.preferred_segments:
            self._replicate.preferred_segments = list(self.config.preferred_segments)
        self._replicate.prefer_alloc_in_same_node = self.config.prefer_alloc_in_same_node
        self._replicate.with_hard_pin = self.config.with_hard_pin

        self._memory = RegisteredMemory()
        self._state = threading.Condition()
        self._close_lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._store: Any = None
        self._replica_reader: ReplicaReader | None = None  # made on the first read_from_replicas
        self._replica_lock = threading.Lock()
        # Set when attached to a client service on this host (MooncakeConfig.client_service).
        self._staging: ServiceStaging | None = None
        store = store_class()
        started = time.monotonic()
        cfg = self.config
        if cfg.client_service:
            try:
                self._staging = attach(store, cfg, self._memory)
            except BaseException:
                self._closed = True
                raise
        else:
            rc = store.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.global_segment_size,
                cfg.local_buffer_size,
                cfg.protocol,
                cfg.device_name,
                cfg.master_server_address,
            )
            if rc != 0:
                self._closed = True
                raise BackendUnavailableError(
                    f"Mooncake setup against master {self.master_address} failed: {code_name(rc)} ({rc}) "
                    f"(local_hostname={cfg.local_hostname!r}, metadata_server={cfg.metadata_server!r}, "
                    f"protocol={cfg.protocol!r})",
                    code=rc,
                    address=self.master_address,
                )
        self._store = store
        logger.info(
            "Mooncake client %s connected to %s in %.0f ms",
            cfg.local_hostname,
            self._peer,
            (time.monotonic() - started) * 1e3,
        )

    @classmethod
    def from_master(cls, master_address: str, **overrides: Any) -> MooncakeBackend:
        """A loopback client of the master at ``master_address``, for tests and examples."""
        config: dict[str, Any] = {
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": master_address,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": 128 << 20,
            "local_buffer_size": 16 << 20,
        }
        config.update(overrides)
        return cls(config)

    @property
    def master_address(self) -> str:
        return self.config.master_server_address

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def read_lease_s(self) -> float:
        """How long a key ``batch_exists`` found stays leased: the master's ``default_kv_lease_ttl``, as
        configured here (``MooncakeConfig.default_kv_lease_ttl``); the worker bounds its lookups by it."""
        return self.config.default_kv_lease_ttl / 1000

    # -- protocol -------------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        self._check_open()
        self._memory.add(addr, size)
        if self._staging is not None:  # the service never sees this memory: staged copies do
            return
        try:
            with self._native() as store:
                rc = store.register_buffer(int(addr), int(size))
        except BaseException:
            self._memory.remove(addr)
            raise
        if rc != 0:
            self._memory.remove(addr)
            raise self._error(f"register_buffer({int(addr):#x}, {int(size)})", rc)

    def unregister_buffer(self, addr: int) -> None:
        """Forget the buffer starting at ``addr``. As with freeing it, only once no batch using it is
        in flight: a call already past its checks still touches the memory."""
        self._check_open()
        # Forgotten first: whatever Mooncake answers, no later call may use this memory.
        self._memory.remove(addr)
        if self._staging is not None:
            return
        with self._native() as store:
            rc = store.unregister_buffer(int(addr))
        if rc != 0:
            raise self._error(f"unregister_buffer({int(addr):#x})", rc)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        check_keys(keys)
        if not len(keys):
            return []
        with self._native() as store:
            # The master grants each key found its read lease (default_kv_lease_ttl): found now, not
            # evicted before a load within the lease (tests/cluster/test_leases.py).
            codes = store.batch_is_exist(list(keys))
        self._check_length("batch_is_exist", codes, len(keys))
        present = []
        for code in codes:
            if code == 1:
                present.append(True)
            elif code == 0:
                present.append(False)
            else:
                raise self._error("batch_is_exist", code)
        return present

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._transfer("put", keys, addrs, sizes)

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._transfer("get", keys, addrs, sizes)

    def close(self) -> None:
        """Close the client once no call is in flight; later calls raise. Idempotent, thread-safe."""
        with self._close_lock:  # a second close returns only once the first is done
            with self._state:
                store = self._store
                self._closed = True
                if store is None:
                    return
                if self._in_flight:
                    logger.debug("close waits for %d Mooncake call(s) in flight", self._in_flight)
                while self._in_flight:
                    self._state.wait()
                self._store = None
                reader, self._replica_reader = self._replica_reader, None
            started = time.monotonic()
            rc = store.close()
            if rc != 0:
                logger.warning("Mooncake close answered %s (%d)", code_name(rc), rc)
            if reader is not None:
                reader.close()
            logger.info("Mooncake client closed in %.1f s", time.monotonic() - started)

    # -- extras beyond the protocol -------------------------------------------------------------

    def valid_keys(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> BoolArray:
        """Per key: whether every region lies inside memory registered with this backend, the proof
        every batch call makes before Mooncake sees a key (a key failing it is answered -600)."""
        self._check_open()
        check_keys(keys)
        return self._memory.valid_keys(RegionTable.from_arguments(keys, addrs, sizes))

    def conversion_probe(self, addr_lists: list[list[int]], size_lists: list[list[int]]) -> None:
        """For benchmarks: the binding converts these region lists (holding the GIL, as in a real get),
        passed for a single key, so Mooncake refuses the call (-600: more lists than keys) and nothing
        is transferred. The lists must be at least two and lie in registered memory, like any call's."""
        self._check_open()
        if len(addr_lists) < 2:
            raise InvalidRequestError("conversion_probe needs at least two region lists (one per key)")
        names = [f"probe-{i}" for i in range(len(addr_lists))]
        if not self._memory.valid_keys(RegionTable.from_arguments(names, addr_lists, size_lists)).all():
            raise InvalidRequestError("conversion_probe: a region lies outside registered memory")
        with self._native() as store:
            codes = store.batch_get_into_multi_buffers(
                ["aiokv-conversion-probe"], addr_lists, size_lists, False
            )
        if list(codes) != [int(Code.INVALID)]:
            raise BackendError(f"the conversion probe answered {list(codes)}, expected [-600]")

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """Drop keys; per key 0 or a negative code. ``force`` ignores read leases (-706 for ~10 s
        after a get otherwise). For tests and explicit eviction."""
        self._check_open()
        check_keys(keys)
        if not len(keys):
            return []
        with self._native() as store:
            codes = store.batch_remove(list(keys), force)
        self._check_length("batch_remove", codes, len(keys))
        self._raise_if_unavailable("batch_remove", codes)
        return list(codes)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"MooncakeBackend(master={self.master_address!r}, {state})"

    # -- internals ------------------------------------------------------------------------------

    def _transfer(self, op: str, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        self._check_open()
        batch = prove(self._memory, op, keys, addrs, sizes)
        if not batch.rows:
            return batch.codes
        form: CallForm | StagedForm
        if self._staging is None:
            form = call_form(batch, op, prefer_same_node=self.config.prefer_alloc_in_same_node)
        else:
            form = StagedForm(self._staging, batch.proven_table())
        if op == "put":
            native = self._put(batch.keys, form)
        else:
            rounds = distinct_rounds(batch.keys)
            if rounds is None:
                native = self._get(batch.keys, form)
            else:
                native = [0] * len(batch.keys)
                for positions in rounds:
                    answers = self._get([batch.keys[k] for k in positions], form.only(positions))
                    for k, code in zip(positions, answers, strict=True):
                        native[k] = code
        if batch.subset is None:  # every key proven: the answers are the codes
            return native
        codes = batch.codes
        for k, code in zip(batch.rows, native, strict=True):
            codes[k] = code
        return codes

    def _get(self, keys: list[str], form: CallForm | StagedForm) -> list[int]:
        with self._native() as store:
            answer = form.get(store, keys, self.config.prefer_alloc_in_same_node)
        self._check_length(form.get_name, answer, len(keys))
        self._raise_if_unavailable(form.get_name, answer)
        return form.get_answers(answer)

    def _put(self, keys: list[str], form: CallForm | StagedForm) -> list[int]:
        """One native batch put, and up to :attr:`put_retries` more of the keys that failed -800.

        While the master still lists a dead client's segment it places new replicas on it too, and
        those puts fail -800; a retry is placed anew (measured: retries made every key readable).
        """
        codes: list[int] = []
        pending: Sequence[int] = range(len(keys))
        for attempt in range(self.put_retries + 1):
            going = form.only(pending) if attempt else form
            with self._native() as store:
                native = going.put(store, [keys[k] for k in pending] if attempt else keys, self._replicate)
            self._check_length(form.put_name, native, len(pending))
            self._raise_if_unavailable(form.put_name, native)
            if not attempt:
                codes = list(native)
            else:
                for k, code in zip(pending, native, strict=True):
                    codes[k] = code
            if _TRANSFER_FAILED not in native:
                break
            pending = [k for k in pending if codes[k] == _TRANSFER_FAILED]
            logger.info("Mooncake put: %d keys failed TRANSFER_FAIL (attempt %d)", len(pending), attempt + 1)
        return codes

    @property
    def _peer(self) -> str:
        """What this client talks to: its client service, or the master."""
        service = self.config.client_service
        return f"client service {service}" if service else f"master {self.master_address}"

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"MooncakeBackend (master {self.master_address}) is closed")

    @contextmanager
    def _native(self) -> Iterator[Any]:
        """The store, held open for the duration of one native call."""
        with self._state:
            if self._closed:
                raise BackendError(f"MooncakeBackend (master {self.master_address}) is closed")
            self._in_flight += 1
        try:
            yield self._store
        finally:
            with self._state:
                self._in_flight -= 1
                if not self._in_flight:
                    self._state.notify_all()

    def _error(self, call: str, code: int) -> BackendError:
        if code in _UNAVAILABLE_CODES:
            return BackendUnavailableError(
                f"Mooncake {call}: {self._peer} unreachable ({code_name(code)}, {code})",
                code=code,
                address=self.config.client_service or self.master_address,
            )
        return BackendError(f"Mooncake {call} failed: {code_name(code)} ({code})", code=code)

    def _raise_if_unavailable(self, call: str, codes: Sequence[int]) -> None:
        for code in codes:
            if code in _UNAVAILABLE_CODES:
                raise self._error(call, code)

    @staticmethod
    def _check_length(call: str, codes: Sequence[int], expected: int) -> None:
        if len(codes) != expected:
            raise BackendError(f"Mooncake {call} answered {len(codes)} codes for {expected} keys")
