"""What the cluster tests share: the skip/fail rule, a world with nodes, and the honesty check of a load.

The world and its nodes are :mod:`aiokv.testing.cluster`: a node runs in its own network namespace with
its own Mooncake client and KVWorker; nodes with an even index run asyncio, odd ones uvloop, so every
cross-node test drives both event loops.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from aiokv.testing.cluster import Cluster, NodeClient, world_unavailable_reason

from ..mooncake_support import in_ci

__all__ = ["Cluster", "NodeClient"]

CHUNK_TOKENS = 16  # one 16-token block per chunk: 8 regions x 16 KiB = 128 KiB per chunk
# Bounds on waits that must end (not speed assertions): every request of these tests must finish
# within REQUEST_BOUND_S; a dead node's segment must leave the master within MASTER_DROP_BOUND_S
# (its client_ttl is 10 s).
REQUEST_BOUND_S = 15.0
MASTER_DROP_BOUND_S = 40.0


def require_cluster() -> None:
    """Skip the calling test (fail it under CI) unless a cluster world can be built here."""
    reason = world_unavailable_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI must run the cluster tests, but: {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def cluster_world(nodes: int = 3, master_args: Sequence[str] = ()) -> Iterator[Cluster]:
    """A started world (skipped, or failed under CI, where none can be built); nodes use 16-token chunks."""
    require_cluster()
    with Cluster(nodes, master_args=master_args) as cluster:
        yield cluster


def blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def scattered(count: int, num_blocks: int = 256, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).permutation(num_blocks)[:count].tolist()


def check_honest_load(
    reply: dict[str, Any], block_ids: Sequence[int], per_chunk: int = 1, chunk_tokens: int = CHUNK_TOKENS
) -> list[int]:
    """Assert a load reported the truth; return the indices of chunks it reported loaded.

    Every chunk is either loaded (its bytes are the stored bytes) or failed whole (all its blocks in
    ``failed_block_ids``); ``loaded_tokens`` covers exactly the leading loaded chunks.
    """
    failed = set(reply["failed_block_ids"][0])
    assert failed <= set(block_ids), "failed blocks outside the request"
    verdicts = reply["verdicts"]
    loaded = []
    for chunk, verdict in enumerate(verdicts):
        ids = block_ids[chunk * per_chunk : (chunk + 1) * per_chunk]
        hits = sum(block in failed for block in ids)
        assert hits in (0, len(ids)), f"chunk {chunk} is partly failed"
        if hits == 0:
            assert verdict == "ok", f"chunk {chunk} reported loaded but holds {verdict} bytes"
            loaded.append(chunk)
    leading = next((k for k in range(len(verdicts)) if k not in loaded), len(verdicts))
    assert reply["loaded_tokens"] == leading * chunk_tokens, "loaded_tokens is not the loaded prefix"
    return loaded


def wait_for(condition: Callable[[], bool], bound_s: float, what: str, step_s: float = 0.5) -> float:
    """Poll until ``condition()``; return the seconds it took; fail past ``bound_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > bound_s:
            raise AssertionError(f"{what} did not happen within {bound_s:.0f} s")
        time.sleep(step_s)
    return time.monotonic() - started
