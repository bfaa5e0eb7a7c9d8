"""Prefill on one node, decode on another: real bytes over TCP between network namespaces."""

from __future__ import annotations

from collections import Counter

from .support import REQUEST_BOUND_S, Cluster, blocks, check_honest_load, scattered


def test_prefill_on_a_stores_decode_on_b_loads_into_other_blocks(cluster: Cluster) -> None:
    prefill = cluster.node(0, segment_size=64 << 20)  # the values live in A's segment
    decode = cluster.node(1)  # a pure client: every byte it loads crosses the bridge
    chunks = 48
    stored = prefill.result("store", seed=11, chunks=chunks, block_ids=scattered(chunks, seed=1))
    assert stored["stored"] == chunks and stored["failed"] == 0
    assert decode.result("lookup", seed=11, chunks=chunks) == chunks * 16
    where = decode.result("replicas", seed=11, chunks=chunks)
    assert {endpoint.split(":")[0] for places in where.values() for endpoint in places} == {prefill.address}

    target = scattered(chunks, seed=2)
    reply = decode.call("load", seed=11, chunks=chunks, block_ids=target, timeout=REQUEST_BOUND_S)
    assert reply["ok"], reply
    loaded = reply["result"]
    assert check_honest_load(loaded, target) == list(range(chunks))
    assert loaded["loaded_tokens"] == chunks * 16
    assert loaded["digests"] == stored["digests"]  # B's blocks hold A's bytes, chunk for chunk


def test_values_on_a_third_node(cluster: Cluster) -> None:
    """Segments on nodes 0 and 1; node 2 (no segment) writes, node 1 reads: the chunks placed on node 0
    move writer -> node 0 -> reader, never touching the reader's or writer's own memory in between."""
    holder = cluster.node(0, segment_size=64 << 20)
    reader = cluster.node(1, segment_size=64 << 20)
    writer = cluster.node(2)
    chunks = 64
    stored = writer.result("store", seed=21, chunks=chunks, block_ids=blocks(0, chunks))
    assert stored["stored"] == chunks

    where = reader.result("replicas", seed=21, chunks=chunks)
    hosts = Counter(places[0].split(":")[0] for places in where.values())
    # Mooncake spreads the allocations over both segments; all 64 on one would be 2**-63 likely.
    assert hosts[holder.address] > 0 and hosts[reader.address] > 0, hosts
    assert writer.address not in hosts

    target = blocks(100, chunks)
    loaded = reader.result("load", seed=21, chunks=chunks, block_ids=target, timeout=REQUEST_BOUND_S)
    assert check_honest_load(loaded, target) == list(range(chunks))
    assert loaded["digests"] == stored["digests"]
