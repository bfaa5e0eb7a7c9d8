"""The circuit breaker (aiokv.breaker) against a real master, frozen (SIGSTOP) and killed, through the
wiring prototype aiokv.bench.guarded: time to "no cache" and time to resume. The worker's own lookup is
measured alongside: without a breaker it waits out the whole freeze."""

from __future__ import annotations

import time
from typing import Any

from aiokv.breaker import BreakerConfig

from .support import Cluster, blocks, wait_for

STUCK_AFTER_S = BreakerConfig().stuck_after_s
FREEZE_S = 5.0
FULL = 8 * 16


def start(cluster: Cluster) -> Any:
    cluster.node(0, segment_size=64 << 20)
    client = cluster.node(1)
    assert client.result("store", seed=1, chunks=8, block_ids=blocks(0, 8))["stored"] == 8
    assert client.result("guarded_lookup", seed=1, chunks=8) == FULL
    return client


def test_frozen_master_trips_the_breaker_and_lookups_answer_no_cache_at_once(
    cluster: Cluster, record_property: Any
) -> None:
    client = start(cluster)
    master = cluster.world.master
    assert master is not None
    master.freeze()
    frozen = time.monotonic()
    plain = client.submit("lookup", seed=1, chunks=8)
    sent = []
    while time.monotonic() - frozen < FREEZE_S:
        sent.append((time.monotonic() - frozen, client.submit("guarded_lookup", seed=1, chunks=8)))
        time.sleep(0.25)
    master.thaw()
    thawed = time.monotonic()
    for offset, future in sent:
        reply = future.result(30)
        assert reply["ok"], reply
        assert reply["result"] in (0, FULL)
        # No guarded lookup waits much past the stuck threshold; once tripped, they answer at once.
        assert reply["elapsed_s"] < STUCK_AFTER_S + 1.0
        if offset > STUCK_AFTER_S + 0.5:
            assert reply["result"] == 0 and reply["elapsed_s"] < 0.5
    plain_reply = plain.result(30)
    record_property("plain_lookup_during_freeze_s", round(plain_reply["elapsed_s"], 2))
    resume_s = wait_for(
        lambda: client.result("guarded_lookup", seed=1, chunks=8) == FULL, 15, "lookups hitting again", 0.05
    )
    record_property("resume_after_thaw_s", round(time.monotonic() - thawed, 2))
    print(
        f"plain lookup waited {plain_reply['elapsed_s']:.1f} s of a {FREEZE_S:.0f} s freeze; "
        f"resumed {resume_s:.2f} s after thaw"
    )
    stats = client.result("breaker")
    assert stats["trips"] == 1 and stats["state"] == "closed" and stats["rejected"]["lookup"] > 0


def test_killed_master_trips_the_breaker_and_a_restart_closes_it(cluster: Cluster) -> None:
    client = start(cluster)
    master = cluster.world.master
    assert master is not None
    master.kill()
    errors = 0
    for _ in range(10):
        reply = client.call("guarded_lookup", seed=1, chunks=8, wait_s=30)
        assert reply["elapsed_s"] < STUCK_AFTER_S + 1.0
        if not reply["ok"]:
            assert reply["error"] == "BackendUnavailableError"
            errors += 1
        else:
            assert reply["result"] == 0
    assert errors <= BreakerConfig().failure_threshold  # then it is open: "no cache", no error
    assert client.result("breaker")["state"] != "closed"
    master.start()
    # The restarted master has lost every key; a new store and a guarded hit show the path is back.
    wait_for(
        lambda: (
            client.call("store", seed=2, chunks=8, block_ids=blocks(0, 8))["ok"]
            and client.result("guarded_lookup", seed=2, chunks=8) == FULL
        ),
        30,
        "stores and guarded lookups working after the restart",
        0.2,
    )
