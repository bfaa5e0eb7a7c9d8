"""The master dies: every request fails with BackendUnavailableError within a bound; after a restart on
the same address the same workers store and load again (the old keys are gone with the old master)."""

from __future__ import annotations

from typing import Any

from .support import REQUEST_BOUND_S, Cluster, blocks, check_honest_load, wait_for

CHUNKS = 16


def test_master_restart(cluster: Cluster) -> None:
    holder = cluster.node(0, segment_size=64 << 20)
    # Without the circuit breaker: every request fails with an error (with the default breaker, once
    # tripped they are answered "no cache" / -900 results at once: test_breaker_cluster.py).
    client = cluster.node(1, worker={"breaker": None})
    assert client.result("store", seed=1, chunks=CHUNKS, block_ids=blocks(0, CHUNKS))["stored"] == CHUNKS
    assert cluster.world.master is not None
    cluster.world.master.kill()

    requests: dict[str, dict[str, Any]] = {
        "lookup": {"seed": 1},
        "store": {"seed": 2, "block_ids": blocks(0, CHUNKS)},
        "load": {"seed": 1, "block_ids": blocks(50, CHUNKS)},
    }
    for op, args in requests.items():
        reply = client.call(op, chunks=CHUNKS, timeout=REQUEST_BOUND_S, wait_s=2 * REQUEST_BOUND_S, **args)
        assert not reply["ok"], f"{op} succeeded without a master: {reply}"
        assert reply["error"] == "BackendUnavailableError", reply
        assert reply["elapsed_s"] < REQUEST_BOUND_S

    cluster.world.master.start()
    # Clients reconnect and re-mount their segments by themselves (measured: ~1-2 s).

    def stores_again() -> bool:
        reply = client.call(
            "store", seed=3, chunks=CHUNKS, block_ids=blocks(0, CHUNKS), timeout=REQUEST_BOUND_S
        )
        return bool(reply["ok"] and reply["result"]["stored"] + reply["result"]["skipped"] == CHUNKS)

    wait_for(stores_again, 30, "a store through the same worker after the restart")
    loaded = client.result(
        "load", seed=3, chunks=CHUNKS, block_ids=blocks(50, CHUNKS), timeout=REQUEST_BOUND_S
    )
    assert check_honest_load(loaded, blocks(50, CHUNKS)) == list(range(CHUNKS))
    assert client.result("lookup", seed=1, chunks=CHUNKS) == 0  # the old master's keys died with it
    assert holder.result("health") == 0
