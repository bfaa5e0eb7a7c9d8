"""A chunk found by lookup can be evicted before load reads it. Measured under memory pressure, with a
plain lookup (``batch_is_exist``, no lease) and with a leased one (``batch_get_session_start``, which
grants each found key Mooncake's read lease). Either way a load never reports wrong bytes."""

from __future__ import annotations

import time
from concurrent.futures import wait
from typing import Any

import pytest

from .support import REQUEST_BOUND_S, blocks, check_honest_load, cluster_world

LEASE_MS = 500
CHUNKS = 32  # 4 MiB per prompt; the 32 MiB segment evicts above 60 %
MASTER_ARGS = (
    f"--default_kv_lease_ttl={LEASE_MS}",
    "--eviction_high_watermark_ratio=0.6",
    "--eviction_ratio=0.1",
)
ROUNDS = 12
PRESSURE_STORES = 6


@pytest.mark.parametrize("lookup", ["lookup", "lookup_leased"])
def test_chunks_evicted_between_lookup_and_load(lookup: str, record_property: Any) -> None:
    with cluster_world(3, master_args=MASTER_ARGS) as cluster:
        cluster.node(0, segment_size=32 << 20)
        reader = cluster.node(1)
        writer = cluster.node(2, worker={"pressure_backoff_s": 0.0})
        found_total = lost_total = rounds_within_lease = pressure_failed = 0
        for round_ in range(ROUNDS):
            seed = 1000 + round_
            writer.result("store", seed=seed, chunks=CHUNKS, block_ids=blocks(0, CHUNKS))
            time.sleep(LEASE_MS / 1000 * 1.2)  # the put's own lease has run out: the prompt is evictable
            started = time.monotonic()
            found = reader.result(lookup, seed=seed, chunks=CHUNKS) // 16
            pressure = [
                writer.submit(
                    "store",
                    seed=5000 + 10 * round_ + j,
                    chunks=CHUNKS,
                    block_ids=blocks(64 + j * CHUNKS, CHUNKS),
                )
                for j in range(PRESSURE_STORES)
            ]
            wait(pressure, REQUEST_BOUND_S * 2)
            pressure_failed += sum(future.result()["result"]["failed"] for future in pressure)
            target = blocks(200, CHUNKS)
            loaded = reader.result(
                "load", seed=seed, chunks=CHUNKS, block_ids=target, timeout=REQUEST_BOUND_S
            )
            within_lease = time.monotonic() - started < LEASE_MS / 1000
            check_honest_load(loaded, target)
            # Emptied for the next round: the next prompt is then the only object old enough to evict.
            writer.result("remove", seed=seed, chunks=CHUNKS)
            for j in range(PRESSURE_STORES):
                writer.result("remove", seed=5000 + 10 * round_ + j, chunks=CHUNKS)
            lost = max(0, found - loaded["loaded_tokens"] // 16)
            if lookup == "lookup_leased" and within_lease:
                assert lost == 0, "a chunk under the lookup's read lease was evicted"
            found_total += found
            rounds_within_lease += within_lease
            lost_total += lost
        record_property("looked_up_chunks", found_total)
        record_property("evicted_before_load", lost_total)
        print(
            f"{lookup}: {lost_total} of {found_total} looked-up chunks were gone at load "
            f"({rounds_within_lease} of {ROUNDS} rounds loaded within the lease; "
            f"{pressure_failed} competing chunks refused for space)"
        )
        assert found_total > 0  # the measurement measured something
