"""replica_num=2 with segments on two nodes, one node SIGKILLed.

Mooncake keeps reading the dead replica of every key placed there (-800) until the master drops the
node (~10 s, its client_ttl). These tests measure that window, prove that reading the failed chunks from
the live replica (``MooncakeBackend.read_from_replicas``: replica descriptors + a direct TransferEngine
read) loses nothing and refuses what it must, and pin that the worker itself does so, whatever the
reader's own ``replica_num``.
"""

from __future__ import annotations

import time
from typing import Any

from .support import (
    CHUNK_TOKENS,
    MASTER_DROP_BOUND_S,
    REQUEST_BOUND_S,
    Cluster,
    NodeClient,
    blocks,
    check_honest_load,
    cluster_world,
    wait_for,
)

CHUNKS = 64
TARGET = blocks(100, CHUNKS)


def lose_one_replica(cluster: Cluster) -> NodeClient:
    """Segments on nodes 0 and 1, a prompt with two replicas written by node 2 (no segment), node 0
    killed; node 2 is returned: every byte it reads comes from node 0 or node 1."""
    victim = cluster.node(0, segment_size=64 << 20)
    cluster.node(1, segment_size=64 << 20)
    client = cluster.node(2, replica_num=2)
    assert client.result("store", seed=9, chunks=CHUNKS, block_ids=blocks(0, CHUNKS))["stored"] == CHUNKS
    where = client.result("replicas", seed=9, chunks=CHUNKS)
    assert all(len({place.split(":")[0] for place in places}) == 2 for places in where.values())
    victim.kill()
    return client


def load(client: NodeClient, **options: Any) -> dict[str, Any]:
    reply = client.call("load", seed=9, chunks=CHUNKS, block_ids=TARGET, timeout=REQUEST_BOUND_S, **options)
    assert reply["ok"], reply
    assert reply["elapsed_s"] < REQUEST_BOUND_S + 1
    result: dict[str, Any] = reply["result"]
    return result


def test_no_prefix_is_lost_in_the_window_before_the_master_notices(
    cluster: Cluster, record_property: Any
) -> None:
    """While the store still reads the dead replica (raw gets fail -800 for ~10 s), every worker load
    reads the failed chunks from the live replica: nothing lost, bytes right, in every round."""
    client = lose_one_replica(cluster)
    killed = time.monotonic()
    raw_failed: list[int] = []

    def master_noticed() -> bool:
        assert check_honest_load(load(client), TARGET) == list(range(CHUNKS))
        raw = client.result(
            "direct", direct_op="get", worker_keys=True, seed=9, chunks=CHUNKS, block_ids=TARGET
        )
        raw_failed.append(int(raw["failed"]))
        return not raw_failed[-1]

    window = wait_for(master_noticed, MASTER_DROP_BOUND_S, "raw gets of the live replica succeeding again")
    record_property("raw_failed_chunks_per_round", raw_failed)
    record_property("window_s", round(time.monotonic() - killed, 1))
    print(f"replica window: {window:.1f} s, raw get failures per round {raw_failed}")
    assert raw_failed[0] > 0  # the window is real: raw gets right after the kill failed


def test_replica_reads_after_a_kill_give_the_right_bytes_and_refuse_what_they_must(cluster: Cluster) -> None:
    client = lose_one_replica(cluster)
    chunk_bytes = 8 * 16 * 1024
    # Every chunk, also the ones whose get fails right now: read from whichever replica is alive.
    read = client.result("replica_read", seed=9, chunks=CHUNKS, block_ids=TARGET)
    assert read["codes"] == [chunk_bytes] * CHUNKS
    assert read["verdicts"] == ["ok"] * CHUNKS
    # Regions one byte short of the value: refused per chunk (-600), nothing written.
    short = client.result("replica_read", seed=9, chunks=CHUNKS, block_ids=TARGET, size_delta=1)
    assert short["codes"] == [-600] * CHUNKS
    assert short["verdicts"] == ["untouched"] * CHUNKS
    # Memory never registered: refused before any native call, nothing written.
    wild = client.result("replica_read", seed=9, chunks=CHUNKS, block_ids=TARGET, unregistered=True)
    assert wild == {"codes": [-600] * CHUNKS, "scratch_untouched": True}
    assert client.result("health") == 0  # the node keeps serving


PROMPTS = 16
PROMPT_CHUNKS = 4


def test_a_reader_configured_with_one_replica_reads_the_live_replica_of_what_was_stored_with_two(
    record_property: Any,
) -> None:
    """Whether a failed get is read again from another replica depends on the stored object (the master's
    replica descriptors), not on the reader's own ``replica_num``: right after the node holding one
    replica dies, a reader configured with 1 loads every prompt whole, as one configured with 2 does."""
    with cluster_world(4) as cluster:
        victim = cluster.node(0, segment_size=64 << 20)
        cluster.node(1, segment_size=64 << 20)
        writer = cluster.node(2, replica_num=2)  # also the reader configured with 2
        single = cluster.node(3, replica_num=1)
        for seed in range(PROMPTS):
            first = seed * PROMPT_CHUNKS
            stored = writer.result("store", seed=100 + seed, chunks=PROMPT_CHUNKS, block_ids=blocks(first, 4))
            assert stored["stored"] == PROMPT_CHUNKS
        where = writer.result("replicas", seed=100, chunks=PROMPT_CHUNKS)
        assert all(len({place.split(":")[0] for place in places}) == 2 for places in where.values())
        victim.kill()
        killed = time.monotonic()
        whole: dict[str, int] = {}
        recovered: dict[str, int] = {}
        for name, reader in (("replica_num_1", single), ("replica_num_2", writer)):
            before = reader.result("stats")["backend_calls"].get("replica_get", 0)
            loads = [
                reader.submit(
                    "load",
                    seed=100 + seed,
                    chunks=PROMPT_CHUNKS,
                    block_ids=blocks(128 + seed * PROMPT_CHUNKS, PROMPT_CHUNKS),
                    timeout=REQUEST_BOUND_S,
                )
                for seed in range(PROMPTS)
            ]
            replies = [future.result(REQUEST_BOUND_S * 2) for future in loads]
            assert all(reply["ok"] for reply in replies), replies
            for seed, reply in enumerate(replies):
                check_honest_load(reply["result"], blocks(128 + seed * PROMPT_CHUNKS, PROMPT_CHUNKS))
            whole[name] = sum(
                reply["result"]["loaded_tokens"] == PROMPT_CHUNKS * CHUNK_TOKENS for reply in replies
            )
            recovered[name] = reader.result("stats")["backend_calls"].get("replica_get", 0) - before
        window_s = time.monotonic() - killed
        record_property("prompts_whole", whole)
        record_property("replica_gets", recovered)
        print(f"after the kill ({window_s:.1f} s): prompts whole {whole}, replica reads {recovered}")
        # Loaded inside the window in which raw gets of the dead replica fail (the master drops the node
        # after its 10 s client_ttl): else the replica reads were never needed and this shows nothing.
        assert window_s < 10, f"the loads took {window_s:.1f} s: past the window the test is about"
        assert whole == {"replica_num_1": PROMPTS, "replica_num_2": PROMPTS}
        assert recovered["replica_num_1"] > 0, "no get failed: the killed node held no replica read first"
