"""A Mooncake cluster in private network namespaces, for tests and benchmarks (docs/cluster.md).

A master and N nodes, each in its own network namespace joined by a bridge, so every byte between
nodes goes over TCP; each node is a process with its own Mooncake client and :class:`~aiokv.KVWorker`,
driven over a pipe::

    from aiokv.testing.cluster import Cluster, world_unavailable_reason

    if (reason := world_unavailable_reason()) is not None:  # needs root or `unshare -rn`, and Mooncake
        raise SystemExit(reason)
    with Cluster(3) as cluster:
        cluster.node(0, segment_size=64 << 20)  # contributes memory
        writer, reader = cluster.node(1), cluster.node(2)
        writer.result("store", seed=1, chunks=8, block_ids=list(range(8)))
        loaded = reader.result("load", seed=1, chunks=8, block_ids=list(range(100, 108)))
        assert set(loaded["verdicts"]) == {"ok"}
        cluster.world.master.kill()  # or .freeze(), .thaw(), .start(); cluster.nodes[0].kill()

Modules: :mod:`.world` (namespaces, bridge, master process), :mod:`.node` (the node process and its
operations), :mod:`.client` (:class:`NodeClient`, :class:`Cluster`). Nothing here is imported by
``import aiokv.testing``.
"""

from __future__ import annotations

from .client import Cluster, NodeClient, NodeError, node_config
from .world import ClusterWorld, world_unavailable_reason

__all__ = ["Cluster", "ClusterWorld", "NodeClient", "NodeError", "node_config", "world_unavailable_reason"]
