"""A chunk found by ``worker.lookup`` must still be there when ``worker.load`` reads it.

Mooncake never evicts (nor removes without ``force``) an object within its read lease
(``default_kv_lease_ttl``), and its existence check, ``batch_is_exist``, which ``worker.lookup`` uses,
grants that lease to every key it finds (the master's ``BatchExistKey`` calls ``GrantLease``). Both
tests go through the node's ``lookup`` op, i.e. ``worker.lookup`` on another node than the writer's:

- the lease itself, deterministically: right after the lookup a non-forced remove of the found keys
  answers -706 (``OBJECT_HAS_LEASE``), once the lease is over it succeeds; keys nobody looked up are
  removable at once;
- under memory pressure: per round one prompt looked up and one not (the control), then competing
  stores that make the master evict, then both loaded. A looked-up chunk is never gone at a load within
  its lease; the control shows the pressure evicts; never a wrong byte either way;
- leases never starve eviction: a store nearly full, a reader looking up everything again and again.
  Without a lease budget its leases pin every chunk and a new prompt cannot be stored for as long as the
  lookups go on (the control); once they stop (the requests aborted, nothing loaded) the leases run out
  and the same store succeeds; with the worker's default kind of bound (``LeaseBudget``) the same
  lookups pin at most the budget and the store succeeds while they go on.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait
from typing import Any

from .support import CHUNK_TOKENS, REQUEST_BOUND_S, NodeClient, blocks, check_honest_load, cluster_world

OBJECT_HAS_LEASE = -706


def test_a_chunk_found_by_the_workers_lookup_holds_the_read_lease() -> None:
    lease_s = 2.0
    with cluster_world(3, master_args=(f"--default_kv_lease_ttl={int(lease_s * 1000)}",)) as cluster:
        cluster.node(0, segment_size=64 << 20)
        reader, writer = cluster.node(1), cluster.node(2)
        chunks = 8
        looked_up, control = 1, 2
        for seed, first in ((looked_up, 0), (control, 16)):
            assert writer.result("store", seed=seed, chunks=chunks, block_ids=blocks(first, chunks))["stored"]
        time.sleep(lease_s * 1.25)  # the leases the writer's own existence checks granted are over
        assert reader.result("lookup", seed=looked_up, chunks=chunks) == chunks * CHUNK_TOKENS
        held = writer.result("remove", seed=looked_up, chunks=chunks, force=False)[:chunks]
        unheld = writer.result("remove", seed=control, chunks=chunks, force=False)[:chunks]
        assert held == [OBJECT_HAS_LEASE] * chunks, "the worker's lookup granted no read lease"
        assert unheld == [0] * chunks, "keys nobody looked up were held too: the test shows nothing"
        time.sleep(lease_s * 1.25)
        assert writer.result("remove", seed=looked_up, chunks=chunks, force=False)[:chunks] == [0] * chunks


LEASE_MS = 1000
CHUNKS = 32  # 4 MiB per prompt; the 32 MiB segment evicts above 60 %
MASTER_ARGS = (
    f"--default_kv_lease_ttl={LEASE_MS}",
    "--eviction_high_watermark_ratio=0.6",
    "--eviction_ratio=0.1",
)
ROUNDS = 12
PRESSURE_STORES = 6


def lost_chunks(reply: dict[str, Any], block_ids: list[int], expected: int) -> int:
    """Of the first ``expected`` chunks, how many the (honest) load did not load."""
    loaded = set(check_honest_load(reply, block_ids))
    return sum(1 for chunk in range(expected) if chunk not in loaded)


def test_chunks_found_by_lookup_survive_eviction_until_the_load(record_property: Any) -> None:
    with cluster_world(3, master_args=MASTER_ARGS) as cluster:
        cluster.node(0, segment_size=32 << 20)
        reader = cluster.node(1, default_kv_lease_ttl=LEASE_MS)
        writer = cluster.node(2, worker={"pressure_backoff_s": 0.0})
        found_total = lost_in_lease = lost_after_lease = control_lost = rounds_in_lease = refused = 0
        for round_ in range(ROUNDS):
            looked_up, control = 1000 + round_, 2000 + round_
            writer.result("store", seed=looked_up, chunks=CHUNKS, block_ids=blocks(0, CHUNKS))
            writer.result("store", seed=control, chunks=CHUNKS, block_ids=blocks(CHUNKS, CHUNKS))
            # The leases the writer's existence checks granted (it confirms its puts) run out: both evictable.
            time.sleep(LEASE_MS / 1000 * 1.2)
            started = time.monotonic()
            found = reader.result("lookup", seed=looked_up, chunks=CHUNKS) // CHUNK_TOKENS
            pressure_seeds = [5000 + 10 * round_ + j for j in range(PRESSURE_STORES)]
            pressure = [
                writer.submit("store", seed=seed, chunks=CHUNKS, block_ids=blocks(64 + j * CHUNKS, CHUNKS))
                for j, seed in enumerate(pressure_seeds)
            ]
            wait(pressure, REQUEST_BOUND_S * 2)
            refused += sum(future.result()["result"]["failed"] for future in pressure)
            target = blocks(200, CHUNKS)
            loaded = reader.result(
                "load", seed=looked_up, chunks=CHUNKS, block_ids=target, timeout=REQUEST_BOUND_S
            )
            within_lease = time.monotonic() - started < LEASE_MS / 1000
            lost = lost_chunks(loaded, target, found)  # also: every chunk right or reported failed
            control_reply = reader.result(
                "load", seed=control, chunks=CHUNKS, block_ids=target, timeout=REQUEST_BOUND_S
            )
            control_lost += lost_chunks(control_reply, target, CHUNKS)
            if within_lease:
                assert lost == 0, f"round {round_}: {lost} chunks under the lookup's read lease were evicted"
            # Emptied for the next round: its prompts are then the oldest objects, the first evicted.
            for seed in (looked_up, control, *pressure_seeds):
                writer.result("remove", seed=seed, chunks=CHUNKS)
            found_total += found
            rounds_in_lease += within_lease
            lost_in_lease += lost if within_lease else 0
            lost_after_lease += 0 if within_lease else lost
        figures = {
            "looked_up_chunks": found_total,
            "rounds_loaded_within_lease": rounds_in_lease,
            "lost_within_lease": lost_in_lease,
            "lost_after_lease": lost_after_lease,
            "control_lost": control_lost,
            "pressure_chunks_refused": refused,
        }
        for name, value in figures.items():
            record_property(name, value)
        print(f"leases: {figures} (of {ROUNDS} rounds x {CHUNKS} chunks)")
        assert found_total > 0
        # The pressure evicted chunks nobody held: a lease was what kept the looked-up ones.
        assert control_lost > 0, f"no control chunk was evicted: the rounds measured nothing ({figures})"


STARVE_LEASE_MS = 2000
STARVE_ARGS = (
    f"--default_kv_lease_ttl={STARVE_LEASE_MS}",
    "--eviction_high_watermark_ratio=0.95",  # no eviction ahead of need: only a full store evicts
    "--eviction_ratio=0.1",
)
FILL_SEEDS = range(7000, 7007)  # 7 x 4 MiB of the 32 MiB segment
BIG_CHUNKS = 64  # 8 MiB: fits only once at least 4 MiB of the fill is evicted
STORE_BOUND_S = 6.0  # how long the writer keeps trying (three lease lengths)


class LookupLoop:
    """A reader looking up every fill prompt, round after round, on a thread of the test's own."""

    def __init__(self, reader: NodeClient) -> None:
        self.reader = reader
        self.lookups = 0
        self.found_chunks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lookup-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for seed in FILL_SEEDS:
                self.found_chunks += self.reader.result("lookup", seed=seed, chunks=CHUNKS) // CHUNK_TOKENS
                self.lookups += 1
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(REQUEST_BOUND_S)


def fill(writer: NodeClient) -> None:
    for j, seed in enumerate(FILL_SEEDS):
        stored = writer.result("store", seed=seed, chunks=CHUNKS, block_ids=blocks(j * CHUNKS, CHUNKS))
        assert stored["stored"] + stored["skipped"] == CHUNKS, f"the fill itself failed: {stored}"


def store_big(writer: NodeClient, seed: int) -> tuple[bool, int]:
    """Store the 8 MiB prompt, again for its failed chunks, until it is whole or STORE_BOUND_S passed;
    (whole, attempts). Whole: the last store failed nothing and every key reads back present."""
    deadline = time.monotonic() + STORE_BOUND_S
    attempts = 0
    while True:
        attempts += 1
        result = writer.result("store", seed=seed, chunks=BIG_CHUNKS, block_ids=blocks(0, BIG_CHUNKS))
        if result["failed"] == 0 and all(writer.result("exists", seed=seed, chunks=BIG_CHUNKS)):
            return True, attempts
        if time.monotonic() > deadline:
            return False, attempts
        time.sleep(0.2)


def test_many_lookups_never_starve_eviction_and_an_aborted_lookup_holds_only_its_lease(
    record_property: Any,
) -> None:
    lease_s = STARVE_LEASE_MS / 1000
    with cluster_world(4, master_args=STARVE_ARGS) as cluster:
        cluster.node(0, segment_size=32 << 20)
        bounded = cluster.node(
            1, default_kv_lease_ttl=STARVE_LEASE_MS, worker={"lease_budget": {"max_bytes": 8 << 20}}
        )
        writer = cluster.node(2, worker={"pressure_backoff_s": 0.0})
        unbounded = cluster.node(3, default_kv_lease_ttl=STARVE_LEASE_MS, worker={"lease_budget": None})
        figures: dict[str, Any] = {}

        # 1. The control: an unbounded reader's lookups pin the whole fill; the big prompt never fits.
        loop = LookupLoop(unbounded)
        fill(writer)
        time.sleep(lease_s * 1.2)  # the leases the writer's own existence checks granted are over
        starved, attempts = store_big(writer, 1)
        loop.stop()
        figures.update(unbounded_lookups=loop.lookups, unbounded_found=loop.found_chunks)
        figures.update(unbounded_stored=starved, unbounded_attempts=attempts)
        assert loop.found_chunks >= len(FILL_SEEDS) * CHUNKS, "the lookups found too little to pin anything"
        assert not starved, f"the control stored the prompt: its leases pinned nothing ({figures})"

        # 2. The lookups stop (their requests aborted, nothing loaded): one lease later nothing is pinned.
        time.sleep(lease_s * 1.2)
        released, attempts = store_big(writer, 2)
        figures.update(after_abort_stored=released, after_abort_attempts=attempts)
        assert released, f"leases of aborted lookups still blocked eviction after their lease ({figures})"

        # 3. The same lookups through a worker with a lease budget (8 MiB): the store succeeds meanwhile.
        for seed in (*FILL_SEEDS, 1, 2):
            writer.result("remove", seed=seed, chunks=BIG_CHUNKS)
        loop = LookupLoop(bounded)
        fill(writer)
        time.sleep(lease_s * 1.2)
        stored, attempts = store_big(writer, 3)
        loop.stop()
        leases = bounded.result("stats")["leases"]
        figures.update(bounded_lookups=loop.lookups, bounded_found=loop.found_chunks)
        figures.update(bounded_stored=stored, bounded_attempts=attempts, bounded_ledger=leases)
        for name, value in figures.items():
            record_property(name, value)
        print(f"starvation: {figures}")
        assert leases["max_chunks"] == (8 << 20) // (128 << 10)
        assert loop.found_chunks > 0, "the bounded reader found nothing: no lookup was answered"
        assert leases["trimmed_lookups"] > 0, "the budget never bit: the rounds showed nothing"
        assert stored, f"lookups within the budget still starved the store ({figures})"
