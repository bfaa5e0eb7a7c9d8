"""Prototype: read chunks whose Mooncake get failed from another replica, bypassing the store's choice.

Measured in the cluster world (docs/cluster.md): with ``replica_num=2``, after one replica's node dies
the store keeps reading the dead replica for every key placed there (-800) until the master drops the
node (~``client_ttl`` = 10 s). Nothing in ``MooncakeDistributedStore`` routes around it: a repeated get, a
get session (``batch_get_session_start``) and ``batch_replica_clear`` all still fail in that window.
What works: ``batch_get_replica_desc(keys)`` names every replica's ``transport_endpoint``,
``buffer_address`` and ``size``, and a second ``mooncake.engine.TransferEngine`` in the same process can
read those bytes directly from a live replica.

:class:`ReplicaReader` does that for a batch of failed keys. It is the recipe for the core (the
Mooncake backend owns its store handle); it lives here so the cluster tests can prove it end to end.
Safety: local addresses come from the caller (already proven inside registered memory by the worker's
layout); a replica is read only when its size equals the sum of the key's regions, so nothing is
written past a region; a read that fails on one replica moves on to the next.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("aiokv.bench.cluster")

NOT_FOUND = -704
SIZE_MISMATCH = -600
TRANSFER_FAILED = -800


class ReplicaReader:
    """Direct reads from named replicas. ``store``: a set-up ``MooncakeDistributedStore``;
    ``local_hostname``: this node's address; ``spans``: the local memory to register, as (addr, size)."""

    def __init__(self, store: Any, local_hostname: str, spans: Sequence[tuple[int, int]]) -> None:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped]

        self._store = store
        self._engine = TransferEngine()
        rc = self._engine.initialize(local_hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize({local_hostname!r}) answered {rc}")
        for addr, size in spans:
            rc = self._engine.register_memory(int(addr), int(size))
            if rc != 0:
                raise RuntimeError(f"TransferEngine.register_memory({addr:#x}, {size}) answered {rc}")
        self.failed_endpoints: dict[str, int] = {}  # endpoint -> failed reads, tried last next time

    def read(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Per key: the bytes read from some complete memory replica, or a negative code."""
        descriptors = self._store.batch_get_replica_desc(list(keys))
        codes = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True):
            codes.append(self._read_one(descriptors.get(key, []), list(key_addrs), list(key_sizes)))
        return codes

    def _read_one(self, replicas: Sequence[Any], addrs: list[int], sizes: list[int]) -> int:
        total = sum(sizes)
        candidates = []
        for replica in replicas:
            if not replica.is_memory_replica() or replica.status.name != "COMPLETE":
                continue
            buffer = replica.get_memory_descriptor().buffer_descriptor
            candidates.append((buffer.transport_endpoint, int(buffer.buffer_address), int(buffer.size)))
        if not candidates:
            return NOT_FOUND
        candidates.sort(key=lambda replica: self.failed_endpoints.get(replica[0], 0))
        code = TRANSFER_FAILED
        for endpoint, base, size in candidates:
            if size != total:
                code = SIZE_MISMATCH  # never read a value of another shape into these regions
                continue
            remote, offset = [], base
            for length in sizes:
                remote.append(offset)
                offset += length
            rc = self._engine.batch_transfer_sync_read(endpoint, addrs, remote, sizes)
            if rc == 0:
                return total
            self.failed_endpoints[endpoint] = self.failed_endpoints.get(endpoint, 0) + 1
            logger.info("direct read from replica at %s answered %d; trying the next", endpoint, rc)
        return code
