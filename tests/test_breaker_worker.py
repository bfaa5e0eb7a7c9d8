"""The circuit breaker wired into KVWorker (docs/reliability.md, "Circuit breaker").

A real KVWorker on a real MemoryBackend behind aiokv.testing's FaultInjectingBackend: existence checks
that hang trip it and it answers at once while open; -900 answers trip it; per-key codes never do;
a probe resumes it; a disabled or removed breaker keeps the old behaviour (calls wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

import pytest

from aiokv import BackendUnavailableError, Code, KVWorker
from aiokv.breaker import BreakerConfig
from aiokv.testing import FaultRule
from tests.helpers import wait_until
from tests.rig import CHUNK, SAFETY_S, Rig

# Short timers so a test trips and resumes in about a second.
FAST = BreakerConfig(stuck_after_s=0.4, backoff_initial_s=0.2, backoff_max_s=0.4, probe_timeout_s=0.4)
# "At once" while open: generous for a loaded 2-core machine, far below the hang it replaces.
PROMPT_S = 1.0


def breaker_state(worker: KVWorker) -> str:
    return str(worker.stats()["breaker"]["state"])


async def tripping_lookup(worker: KVWorker, tokens: Any) -> None:
    """The lookup whose failed call trips the breaker: it fails with the error, or is answered 0 when
    the watcher (woken by the failure) answers it before the failed call's result reaches it."""
    with contextlib.suppress(BackendUnavailableError):
        assert await worker.lookup(tokens) == 0


async def timed(awaitable: Awaitable[Any]) -> tuple[Any, float]:
    start = time.monotonic()
    result = await asyncio.wait_for(awaitable, SAFETY_S)
    return result, time.monotonic() - start


@pytest.mark.asyncio
async def test_hanging_exists_trips_it_then_requests_answer_at_once_and_a_probe_resumes_it() -> None:
    rig = Rig(seed=41)
    stored, fresh = rig.prompt(3), rig.prompt(2)
    src = rig.blocks(3, source=True)
    async with rig.worker(breaker=FAST) as worker:
        assert (await worker.store(stored, src)).stored == 3
        gate = rig.backend.block("exists", max_wait_s=SAFETY_S)
        try:
            # Issued before the trip: the lookup waits on a stuck exists call; answered 0 once tripped.
            started = time.monotonic()
            lookup = asyncio.ensure_future(worker.lookup(stored))
            store = worker.store(fresh, rig.blocks(2, source=True))
            assert await asyncio.wait_for(lookup, SAFETY_S) == 0
            tripped_after = time.monotonic() - started
            assert tripped_after < FAST.stuck_after_s + 2.0  # trips within ~stuck_after_s
            result = await asyncio.wait_for(store, SAFETY_S)
            assert (result.stored, result.failed) == (0, 2)
            assert dict(result.errors) == {Code.UNAVAILABLE: 2 * 2}  # every (chunk, group) pair
            assert breaker_state(worker) in ("open", "half_open")
            # While open: answered without a backend call, blocks untouched.
            calls = rig.backend.count("exists", "put", "get")
            dst = rig.blocks(3, source=False)
            answer, took = await timed(worker.lookup(stored))
            assert answer == 0 and took < PROMPT_S
            load, took = await timed(worker.load(stored, dst))
            assert load.loaded_tokens == 0 and took < PROMPT_S
            assert [len(ids) for ids in load.failed_block_ids] == [len(ids) for ids in dst]
            assert all(rig.cache[g].untouched(dst[g]) for g in range(2))
            refused, took = await timed(worker.store(rig.prompt(1), rig.blocks(1, source=True)))
            assert refused.failed == 1 and dict(refused.errors) == {Code.UNAVAILABLE: 2}
            assert took < PROMPT_S
            assert rig.backend.count("exists", "put", "get") == calls
            snapshot = worker.stats()["breaker"]
            assert snapshot["trips"] == 1 and snapshot["stuck_calls"] >= 1
            assert snapshot["rejected"]["lookup"] >= 2 and snapshot["rejected"]["store"] >= 2
            assert snapshot["rejected"]["load"] == 1
        finally:
            gate.set()
            rig.backend.release("exists")
        # Resumes after a probe: the store is answered again, with real bytes.
        await wait_until(lambda: breaker_state(worker) == "closed")
        assert await worker.lookup(stored) == 3 * CHUNK
        dst = rig.blocks(3, source=False)
        assert (await worker.load(stored, dst)).loaded_tokens == 3 * CHUNK
        assert all(rig.same_bytes(g, dst[g], src[g]) for g in range(2))
        assert worker.stats()["breaker"]["probes"] >= 1


@pytest.mark.asyncio
async def test_unavailable_answers_trip_it_and_later_stores_are_not_sent() -> None:
    rig = Rig(seed=42)
    rule = rig.backend.add_rule(FaultRule(op="put", code=Code.UNAVAILABLE))
    # An existence check that answers resets the count (the master answered), so here one failed
    # store is enough: failure_threshold=1.
    async with rig.worker(breaker=replace(FAST, failure_threshold=1)) as worker:
        result = await worker.store(rig.prompt(2), rig.blocks(2, source=True))
        assert result.failed == 2 and dict(result.errors) == {Code.UNAVAILABLE: 4}
        assert breaker_state(worker) != "closed"
        puts = rig.backend.count("put")
        refused = await worker.store(rig.prompt(2), rig.blocks(2, source=True))
        assert refused.failed == 2 and dict(refused.errors) == {Code.UNAVAILABLE: 4}
        assert rig.backend.count("put") == puts  # not sent
        rig.backend.remove_rule(rule)
        await wait_until(lambda: breaker_state(worker) == "closed")
        tokens, src = rig.prompt(2), rig.blocks(2, source=True)
        assert (await worker.store(tokens, src)).stored == 2
        snapshot = worker.stats()["breaker"]
    assert snapshot["trips"] == 1 and snapshot["failures"] >= 1
    # The refused store, and the tripping store itself when its other group's call was still waiting.
    assert set(snapshot["rejected"]) == {"store"} and 1 <= snapshot["rejected"]["store"] <= 2


@pytest.mark.asyncio
async def test_consecutive_unavailable_errors_trip_the_default_breaker() -> None:
    rig = Rig(seed=48)
    lost = BackendUnavailableError("master unreachable", code=Code.UNAVAILABLE)
    rule = rig.backend.add_rule(FaultRule(op="exists", exception=lost))
    tokens = rig.prompt(2)
    async with rig.worker() as worker:
        threshold = worker.breaker.config.failure_threshold  # type: ignore[union-attr]
        for _ in range(threshold - 1):
            with pytest.raises(BackendUnavailableError):
                await worker.lookup(tokens)
        await tripping_lookup(worker, tokens)
        assert breaker_state(worker) != "closed"
        calls = rig.backend.count("exists")
        answer, took = await timed(worker.lookup(tokens))
        assert answer == 0 and took < PROMPT_S and rig.backend.count("exists") == calls
        rig.backend.remove_rule(rule)
        await wait_until(lambda: breaker_state(worker) == "closed")
        assert await worker.lookup(tokens) == 0  # answered by the store again (nothing stored)
        assert rig.backend.count("exists") > calls


@pytest.mark.asyncio
async def test_per_key_codes_never_trip_it() -> None:
    rig = Rig(seed=43)
    for code in (Code.NOT_FOUND, Code.TRANSFER_FAILED, Code.NO_SPACE):
        rig.backend.add_rule(FaultRule(op="put", code=code, times=2))
    rig.backend.add_rule(FaultRule(op="get", code=Code.TRANSFER_FAILED))
    async with rig.worker() as worker:  # the default breaker
        for _ in range(4):
            await worker.store(rig.prompt(2), rig.blocks(2, source=True))
        tokens = rig.prompt(2)
        await worker.store(tokens, rig.blocks(2, source=True))
        for _ in range(3):
            loaded = await worker.load(tokens, rig.blocks(2, source=False))
            assert loaded.loaded_tokens == 0  # every read failed -800: per key, not the store
        snapshot = worker.stats()["breaker"]
    assert rig.backend.count("put") >= 6
    assert snapshot["state"] == "closed" and snapshot["trips"] == 0 and snapshot["rejected_total"] == 0


@pytest.mark.asyncio
async def test_a_long_put_does_not_trip_it_and_a_store_inside_a_put_waits_for_it_while_open() -> None:
    rig = Rig(seed=44)
    tokens, src = rig.prompt(2), rig.blocks(2, source=True)
    present = rig.prompt(1)
    async with rig.worker(breaker=FAST) as worker:
        await worker.store(present, rig.blocks(1, source=True))
        with rig.backend.blocked("put"):
            store = worker.store(tokens, src)
            await rig.backend.wait_hanging_async(1)
            await asyncio.sleep(2 * FAST.stuck_after_s)
            # A transfer may rightly run long: only existence checks count as stuck.
            assert breaker_state(worker) == "closed"
            assert await worker.lookup(present) == CHUNK
            with rig.backend.blocked("exists"):
                answer, took = await timed(worker.lookup(present))
                assert answer == 0 and took < FAST.stuck_after_s + 2.0  # tripped by the stuck check
                assert breaker_state(worker) != "closed"
                assert not store.done()  # its memory is in use by the running put
        result = await asyncio.wait_for(store, SAFETY_S)
        # The calls that were running finish as they answer; a call of it not yet started then may
        # have been refused.
        assert result.stored + result.failed == 2
        assert set(result.errors) <= {Code.UNAVAILABLE}
        await wait_until(lambda: breaker_state(worker) == "closed")
        assert await worker.lookup(present) == CHUNK


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "config", [None, BreakerConfig(enabled=False, stuck_after_s=0.2)], ids=["none", "off"]
)
async def test_without_a_breaker_requests_wait_for_the_store_as_before(config: BreakerConfig | None) -> None:
    rig = Rig(seed=45)
    tokens, src = rig.prompt(2), rig.blocks(2, source=True)
    async with rig.worker(breaker=config) as worker:
        await worker.store(tokens, src)
        with rig.backend.blocked("exists"):
            lookup = asyncio.ensure_future(worker.lookup(tokens))
            await rig.backend.wait_hanging_async(1)
            await asyncio.sleep(0.6)
            assert not lookup.done()
        assert await asyncio.wait_for(lookup, SAFETY_S) == 2 * CHUNK
        snapshot = worker.stats()["breaker"]
    if config is None:
        assert snapshot is None
    else:
        assert snapshot["enabled"] is False and snapshot["rejected_total"] == 0
        assert snapshot["stuck_calls"] >= 1  # counted, not acted on


@pytest.mark.asyncio
async def test_close_does_not_wait_for_a_stuck_probe() -> None:
    rig = Rig(seed=46)
    tokens = rig.prompt(2)
    worker = rig.worker(breaker=FAST)
    await worker.start()
    gate = rig.backend.block("exists", max_wait_s=SAFETY_S)
    try:
        assert await asyncio.wait_for(worker.lookup(tokens), SAFETY_S) == 0
        await wait_until(lambda: worker.stats()["breaker"]["probes"] >= 1)  # a probe hangs now
        _, took = await timed(worker.close(timeout=0.5))
        assert worker.closed and took < 0.5 + PROMPT_S
    finally:
        gate.set()
        rig.backend.release("exists")


def test_the_option_is_checked() -> None:
    rig = Rig(seed=47)
    with pytest.raises(TypeError, match="breaker"):
        rig.worker(breaker={"enabled": False})
    assert rig.worker().breaker is not None and rig.worker(breaker=None).breaker is None


@pytest.mark.asyncio
async def test_breaker_figures_are_exported_to_prometheus() -> None:
    prometheus = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from aiokv.metrics import PrometheusExporter

    rig = Rig(seed=49)
    registry = prometheus.CollectorRegistry()
    lost = BackendUnavailableError("master unreachable", code=Code.UNAVAILABLE)
    async with rig.worker(
        breaker=replace(FAST, failure_threshold=1, backoff_initial_s=30, backoff_max_s=30)
    ) as worker:
        PrometheusExporter(worker, registry)
        rig.backend.add_rule(FaultRule(op="exists", exception=lost))
        await tripping_lookup(worker, rig.prompt(1))
        rejected = worker.stats()["breaker"]["rejected"].get("lookup", 0)
        assert await worker.lookup(rig.prompt(1)) == 0  # refused
        text = prometheus.generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("aiokv_breaker_state", (("state", "open"),))] == 1
    assert samples[("aiokv_breaker_state", (("state", "closed"),))] == 0
    assert samples[("aiokv_breaker_trips_total", ())] == 1
    assert samples[("aiokv_breaker_failures_total", ())] == 1
    assert samples[("aiokv_breaker_rejected_total", (("kind", "lookup"),))] == rejected + 1
    assert samples[("aiokv_breaker_rejected_total", (("kind", "store"),))] == 0
