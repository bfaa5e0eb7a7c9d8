"""The worker's circuit breaker against a real master, frozen (SIGSTOP) and killed: time to "no cache",
answer latency while open, time to resume. The node runs a KVWorker with the default BreakerConfig; a
second node without a breaker shows what it replaces (a lookup that waits out the whole freeze)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from aiokv.breaker import BreakerConfig

from .support import Cluster, blocks, wait_for

CONFIG = BreakerConfig()
FREEZE_S = 8.0
CHUNKS = 8
FULL = CHUNKS * 16
OPEN_ANSWER_S = 0.5  # "well under a second" once tripped
SETTLE_S = 0.5  # after the trip, before answers must be fast (the watcher's tick, a loaded machine)


def start(cluster: Cluster) -> tuple[Any, Any]:
    cluster.node(0, segment_size=64 << 20)
    guarded = cluster.node(1)
    plain = cluster.node(2, worker={"breaker": None})
    assert guarded.result("store", seed=1, chunks=CHUNKS, block_ids=blocks(0, CHUNKS))["stored"] == CHUNKS
    assert guarded.result("lookup", seed=1, chunks=CHUNKS) == FULL
    assert plain.result("lookup", seed=1, chunks=CHUNKS) == FULL
    return guarded, plain


def drive(client: Any, seconds: float, seed: int) -> list[tuple[str, float, Future[dict[str, Any]]]]:
    """A lookup and a store (of a fresh prompt, into blocks of its own) every 0.25 s for ``seconds``."""
    sent: list[tuple[str, float, Future[dict[str, Any]]]] = []
    began = time.monotonic()
    k = 0
    while time.monotonic() - began < seconds:
        offset = time.monotonic() - began
        sent.append(("lookup", offset, client.submit("lookup", seed=1, chunks=CHUNKS)))
        first = 16 + (k % 28) * CHUNKS  # 256 blocks: ring of store destinations
        sent.append(
            (
                "store",
                offset,
                client.submit("store", seed=seed + k, chunks=CHUNKS, block_ids=blocks(first, CHUNKS)),
            )
        )
        k += 1
        time.sleep(0.25)
    return sent


def open_answers(
    sent: list[tuple[str, float, Future[dict[str, Any]]]], wait_s: float
) -> tuple[float, float, int]:
    """(time from the start to the first "no cache" answer, the slowest answer sent after the trip
    had settled, requests answered while open); checks every answer is a fast "unavailable"."""
    replies = [(op, offset, future.result(wait_s)) for op, offset, future in sent]
    no_cache = [
        offset + reply["elapsed_s"]
        for op, offset, reply in replies
        if op == "lookup" and reply["ok"] and reply["result"] == 0
    ]
    assert no_cache, "no lookup was answered 'no cache'"
    tripped_at = min(no_cache)
    slowest, answered = 0.0, 0
    for op, offset, reply in replies:
        if offset < tripped_at + SETTLE_S:
            continue
        assert reply["ok"], reply
        if op == "lookup":
            assert reply["result"] == 0
        else:
            assert reply["result"]["failed"] == CHUNKS and reply["result"]["errors"] == {"-900": CHUNKS}
        slowest = max(slowest, reply["elapsed_s"])
        answered += 1
    return tripped_at, slowest, answered


def test_frozen_master_trips_the_breaker_then_lookups_and_stores_answer_at_once(
    cluster: Cluster, record_property: Any
) -> None:
    guarded, plain = start(cluster)
    master = cluster.world.master
    assert master is not None
    master.freeze()
    plain_lookup = plain.submit("lookup", seed=1, chunks=CHUNKS)
    try:
        sent = drive(guarded, FREEZE_S, seed=100)
    finally:
        master.thaw()
    thawed = time.monotonic()
    tripped_at, slowest, answered = open_answers(sent, 60)
    assert tripped_at < CONFIG.stuck_after_s + 2.0  # within a few seconds of the first stuck call
    assert answered >= 10 and slowest < OPEN_ANSWER_S
    wait_for(
        lambda: guarded.result("lookup", seed=1, chunks=CHUNKS) == FULL, 30, "lookups hitting again", 0.05
    )
    resume_s = time.monotonic() - thawed
    plain_s = plain_lookup.result(60)["elapsed_s"]
    record_property("frozen_trip_s", round(tripped_at, 2))
    record_property("frozen_open_answer_max_s", round(slowest, 3))
    record_property("frozen_resume_after_thaw_s", round(resume_s, 2))
    record_property("frozen_plain_lookup_s", round(plain_s, 2))
    print(
        f"frozen master: tripped {tripped_at:.2f} s after the freeze; {answered} requests answered while "
        f"open, slowest {slowest * 1e3:.0f} ms; resumed {resume_s:.2f} s after thaw; a worker without a "
        f"breaker waited {plain_s:.1f} s of the {FREEZE_S:.0f} s freeze"
    )
    assert plain_s > FREEZE_S - 1.0  # what the breaker replaces
    stats = guarded.result("breaker")
    assert stats["trips"] >= 1 and stats["state"] == "closed"
    assert stats["rejected"]["lookup"] > 0 and stats["rejected"]["store"] > 0


def test_killed_master_trips_the_breaker_and_a_restart_closes_it(
    cluster: Cluster, record_property: Any
) -> None:
    guarded, _ = start(cluster)
    master = cluster.world.master
    assert master is not None
    master.kill()
    sent = drive(guarded, 6.0, seed=200)
    replies = [(op, offset, future.result(60)) for op, offset, future in sent]
    errors = [reply for _, _, reply in replies if not reply["ok"]]
    # Before it trips, requests fail as without a breaker: an aiokv error, never a hang.
    assert all(reply["error"] == "BackendUnavailableError" for reply in errors), errors
    tripped_at, slowest, answered = open_answers(
        [(op, offset, future) for op, offset, future in sent if future.result()["ok"]], 1
    )
    assert answered >= 10 and slowest < OPEN_ANSWER_S
    assert guarded.result("breaker")["state"] != "closed"
    master.start()
    restarted = time.monotonic()
    # The restarted master has lost every key: a new store and a hit show the path is back.
    wait_for(
        lambda: (
            guarded.result("breaker")["state"] == "closed"
            and guarded.call("store", seed=2, chunks=CHUNKS, block_ids=blocks(0, CHUNKS))["ok"]
            and guarded.result("lookup", seed=2, chunks=CHUNKS) == FULL
        ),
        60,
        "stores and lookups working after the restart",
        0.2,
    )
    resume_s = time.monotonic() - restarted
    record_property("killed_trip_s", round(tripped_at, 2))
    record_property("killed_open_answer_max_s", round(slowest, 3))
    record_property("killed_resume_after_restart_s", round(resume_s, 2))
    print(
        f"killed master: {len(errors)} requests failed before the trip at {tripped_at:.2f} s; {answered} "
        f"answered while open, slowest {slowest * 1e3:.0f} ms; resumed {resume_s:.2f} s after the restart"
    )
