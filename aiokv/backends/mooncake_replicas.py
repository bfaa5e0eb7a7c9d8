"""Reading keys from a chosen Mooncake replica, around the one the store's own get keeps failing on.

With ``replica_num > 1``, after one replica's node dies the store keeps reading that replica for every
key placed there (-800) until the master drops the node (~``client_ttl``, 10 s). Nothing in
``MooncakeDistributedStore`` routes around it: a repeated get, a get session and ``batch_replica_clear``
all still fail in that window (docs/cluster.md). What works: ``batch_get_replica_desc(keys)`` names every
replica's ``transport_endpoint``, ``buffer_address`` and ``size``, and a second
``mooncake.engine.TransferEngine`` in the same process reads those bytes straight from a live replica.

:class:`ReplicaReader` does that for :meth:`MooncakeBackend.read_from_replicas`, which proves every local
region inside registered memory before calling it. Here: only ``COMPLETE`` memory replicas are read; a
replica is read only when its size equals the sum of the key's regions (else -600, nothing written); an
endpoint that failed recently is tried last; the engine's registered memory follows the backend's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..codes import Code
from ..errors import BackendError

logger = logging.getLogger("aiokv.backends.mooncake")

# An endpoint whose read failed within this many seconds is tried after the others (a dead node stays
# listed by the master for ~10 s; a revived one is preferred again after this).
FAILED_ENDPOINT_MEMORY_S = 60.0


def engine_hostname(local_hostname: str) -> str:
    """The host part of a store's ``local_hostname``: the second engine must not take the store's port
    (with P2PHANDSHAKE a bare host gets a free port of its own)."""
    host, sep, port = local_hostname.rpartition(":")
    if sep and host and port.isdigit() and ":" not in host:
        return host
    return local_hostname


class ReplicaReader:
    """Direct reads from named replicas through a ``TransferEngine`` of its own.

    Not safe to use after :meth:`close`; the owning backend guards that (it holds its in-flight count
    around every call and closes this reader only once no call is in flight).
    """

    def __init__(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> None:
        if metadata_server != "P2PHANDSHAKE":
            # With a shared metadata server a second engine would publish a segment under the store's
            # own name; only the peer-to-peer handshake gives it a name of its own.
            raise BackendError(
                f"replica reads need metadata_server='P2PHANDSHAKE' (configured: {metadata_server!r})"
            )
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped]

        self._engine = TransferEngine()
        hostname = engine_hostname(local_hostname)
        rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise BackendError(
                f"replica reader: TransferEngine.initialize({hostname!r}) answered {rc}", code=rc
            )
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # addr -> size, registered with the engine
        self._failed_at: dict[str, float] = {}  # endpoint -> when a read from it last failed

    def sync_memory(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register exactly ``spans`` (the backend's registered memory) with the engine."""
        wanted = dict(spans)
        with self._lock:
            for addr, size in list(self._registered.items()):
                if wanted.get(addr) != size:
                    del self._registered[addr]
                    rc = self._engine.unregister_memory(addr)
                    if rc != 0:
                        logger.warning("replica reader: unregister_memory(%#x) answered %d", addr, rc)
            for addr, size in wanted.items():
                if addr not in self._registered:
                    rc = self._engine.register_memory(addr, size)
                    if rc != 0:
                        raise BackendError(
                            f"replica reader: register_memory({addr:#x}, {size}) answered {rc}", code=rc
                        )
                    self._registered[addr] = size

    def read(
        self,
        keys: Sequence[str],
        descriptors: Mapping[str, Sequence[Any]],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
    ) -> list[int]:
        """Per key: the bytes read from some complete memory replica, or a negative code. ``addrs`` and
        ``sizes`` must already be proven inside the memory given to :meth:`sync_memory`."""
        return [
            self._read_one(descriptors.get(key, ()), list(key_addrs), list(key_sizes))
            for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True)
        ]

    def close(self) -> None:
        """Unregister the memory; the engine itself goes with its last reference (it has no close)."""
        self.sync_memory(())

    def _read_one(self, replicas: Sequence[Any], addrs: list[int], sizes: list[int]) -> int:
        total = sum(sizes)
        candidates = [replica for replica in map(_memory_replica, replicas) if replica is not None]
        if not candidates:
            return int(Code.NOT_FOUND)
        recent = time.monotonic() - FAILED_ENDPOINT_MEMORY_S
        candidates.sort(key=lambda replica: self._failed_at.get(replica[0], recent) > recent)  # stable
        code = int(Code.TRANSFER_FAILED)
        for endpoint, base, size in candidates:
            if size != total:
                code = int(Code.INVALID)  # never read a value of another shape into these regions
                continue
            remote, offset = [], base
            for length in sizes:
                remote.append(offset)
                offset += length
            rc = self._engine.batch_transfer_sync_read(endpoint, addrs, remote, sizes)
            if rc == 0:
                return total
            self._failed_at[endpoint] = time.monotonic()
            code = int(Code.TRANSFER_FAILED)
            logger.info("read from the replica at %s answered %d; trying the next", endpoint, rc)
        return code


def _memory_replica(replica: Any) -> tuple[str, int, int] | None:
    """(endpoint, address, size) of a complete memory replica; None for any other."""
    if not replica.is_memory_replica() or replica.status.name != "COMPLETE":
        return None
    buffer = replica.get_memory_descriptor().buffer_descriptor
    return str(buffer.transport_endpoint), int(buffer.buffer_address), int(buffer.size)


def replica_endpoints(descriptors: Mapping[str, Sequence[Any]], keys: Sequence[str]) -> dict[str, list[str]]:
    """Per key, the endpoints of its memory replicas (any status), for diagnostics."""
    return {
        key: [
            str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
            for replica in descriptors.get(key, ())
            if replica.is_memory_replica()
        ]
        for key in keys
    }
