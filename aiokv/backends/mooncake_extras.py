"""What :class:`~aiokv.backends.mooncake.MooncakeBackend` offers beyond the Backend protocol: reads
straight from a replica (for the window after a replica's node died), replica endpoints and the client's
health. Each refuses a closed backend and proves every local region inside registered memory before any
native call, like the protocol's calls (docs/backends.md, "Beyond the protocol"). There is no "leased
lookup" here: ``batch_exists`` already grants each key it finds the master's read lease.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ..codes import Code
from ._regions import Regions, RegisteredMemory, check_keys
from .mooncake_calls import prove
from .mooncake_config import MooncakeConfig
from .mooncake_replicas import ReplicaReader, replica_endpoints

logger = logging.getLogger("aiokv.backends.mooncake")


class MooncakeExtras:
    """Mixed into ``MooncakeBackend``, whose state and guards these methods use."""

    if TYPE_CHECKING:
        config: MooncakeConfig
        _memory: RegisteredMemory
        _replica_reader: ReplicaReader | None
        _replica_lock: threading.Lock

        def _check_open(self) -> None: ...
        def _native(self) -> AbstractContextManager[Any]: ...

    def read_from_replicas(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        """Read keys whose get failed (-800) straight from a complete memory replica, per key the bytes
        read or a negative code, as :meth:`batch_get`. For the window after a replica's node died and
        before the master drops it, when every get keeps choosing the dead replica
        (:mod:`.mooncake_replicas`). A replica is read only when its size equals the sum of the key's
        regions (else -600); keys with regions outside registered memory get -600 and reach no native
        call. Needs ``metadata_server="P2PHANDSHAKE"``. Like a get it may block until Mooncake's
        transfer timeout when a replica's node vanished without a reset (docs/cluster.md)."""
        self._check_open()
        rows, addr_lists, size_lists, codes = self._proven_regions("read_from_replicas", keys, addrs, sizes)
        if not rows:
            return codes
        if self.config.client_service:
            # The client service picks replicas itself and answers no replica descriptors: the keys
            # stay failed (-800) and the caller recomputes them.
            for k in rows:
                codes[k] = int(Code.TRANSFER_FAILED)
            return codes
        native_keys = [keys[k] for k in rows]
        with self._native() as store:
            reader = self._replicas()
            reader.sync_memory(self._memory.spans())
            descriptors = store.batch_get_replica_desc(native_keys)
            native = reader.read(native_keys, descriptors, addr_lists, size_lists)
        for k, code in zip(rows, native, strict=True):
            codes[k] = code
        return codes

    def replica_endpoints(self, keys: Sequence[str]) -> dict[str, list[str]]:
        """Per key, the transport endpoints of its memory replicas as the master lists them."""
        self._check_open()
        check_keys(keys)
        with self._native() as store:
            descriptors = store.batch_get_replica_desc(list(keys))
        return replica_endpoints(descriptors, keys)

    def health_check(self) -> int:
        """Mooncake's client health: 0 healthy, 1 not initialised/closed, 2 master unreachable. Measured:
        it still answers 0 with the master killed, so a probe must also make a master call
        (``batch_exists``) before calling the store healthy."""
        self._check_open()
        with self._native() as store:
            return int(store.health_check())

    def _proven_regions(
        self, call: str, keys: Sequence[str], addrs: Regions, sizes: Regions
    ) -> tuple[list[int], list[list[int]], list[list[int]], list[int]]:
        """The rows of keys whose regions all lie in registered memory, their region lists, and codes
        with -600 for every other key (filled in by the caller for the proven rows)."""
        batch = prove(self._memory, call, keys, addrs, sizes)
        if not batch.rows:
            return [], [], [], batch.codes
        addr_lists, size_lists = batch.region_lists()
        return list(batch.rows), addr_lists, size_lists, batch.codes

    def _replicas(self) -> ReplicaReader:
        with self._replica_lock:
            if self._replica_reader is None:
                cfg = self.config
                self._replica_reader = ReplicaReader(
                    cfg.local_hostname, cfg.metadata_server, cfg.protocol, cfg.device_name
                )
            return self._replica_reader
