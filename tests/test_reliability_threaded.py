"""Every ThreadedKVWorker call racing close() returns or raises WorkerClosedError, close() on the
worker's own loop thread is refused and leaves it intact, a closed worker never breaks a Prometheus
scrape, and a worker refuses calls from a second event loop.

Real workers on a real MemoryBackend behind aiokv.testing's FaultInjectingBackend; the close() race
runs in a child process so that a thread blocked forever cannot outlive the test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from aiokv import AiokvError
from aiokv.testing import FaultRule
from tests.helpers import aiokv_threads, read_value
from tests.rig import OneGroupRig

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on every platform it supports
    uvloop = None  # type: ignore[assignment]

pytestmark = pytest.mark.usefixtures("no_cyclic_gc_until_teardown")

BOUND_S = 3.0  # "finishes within this instead of hanging"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- ThreadedKVWorker races ---------------------------------------------------------------------------


_RACE_SCRIPT = """
import json, sys, threading, time
import numpy as np
from aiokv import KVLayout, MemoryBackend, ThreadedKVWorker, WorkerClosedError

report = []
for round_ in range(int(sys.argv[1])):
    region = np.zeros((16, 64), dtype=np.uint8)
    layout = KVLayout([region.ctypes.data], [64], 4, 16)
    worker = ThreadedKVWorker(layout, MemoryBackend(1 << 20), namespace="race", chunk_tokens=8)
    start = threading.Barrier(17)
    outcomes = []

    def hammer(call):
        start.wait()
        while True:
            try:
                call()
            except WorkerClosedError:
                outcomes.append("closed")
                return
            except BaseException as exc:
                outcomes.append(repr(exc))
                return

    calls = [worker.stats, lambda: worker.lookup(list(range(16)))]  # a plain call, and a coroutine
    threads = [threading.Thread(target=hammer, args=(calls[i % 2],), daemon=True) for i in range(16)]
    for thread in threads:
        thread.start()
    start.wait()
    time.sleep(0.0005 * round_)
    worker.close()
    deadline = time.monotonic() + 10
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    report.append({"stuck": sum(t.is_alive() for t in threads), "outcomes": sorted(set(outcomes))})
    if report[-1]["stuck"]:
        break
print(json.dumps(report), flush=True)
"""


def test_stats_racing_close_from_sixteen_threads_always_returns_or_raises_closed() -> None:
    """Each ThreadedKVWorker stats()/lookup() racing close() in 16 threads returns or raises closed."""
    # In a child process: threads that do block forever must not outlive the test.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-c", _RACE_SCRIPT, "20"], env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout)
    for round_, outcome in enumerate(report):
        assert outcome["stuck"] == 0, f"round {round_}: {outcome['stuck']} of 16 threads blocked"
        assert outcome["outcomes"] == ["closed"], outcome
    assert len(report) == 20


def test_close_from_a_done_callback_is_refused_clearly_and_leaves_the_worker_intact() -> None:
    """close()/terminate() on the loop thread (done callback) raise RuntimeError; the worker serves on."""
    rig = OneGroupRig(seed=10)
    worker = rig.threaded()
    errors: list[BaseException] = []
    called = threading.Event()

    def close_in_callback(_: concurrent.futures.Future[Any]) -> None:
        for method in (worker.close, worker.terminate):
            try:
                method()
            except BaseException as exc:
                errors.append(exc)
        called.set()

    tokens, src = rig.prompt(2), rig.blocks(2, source=True)
    release = threading.Event()
    rig.backend.add_rule(FaultRule(op="put", hang=release, times=1))
    first = worker.store(tokens, [src])
    first.add_done_callback(close_in_callback)  # attached while the store hangs: runs on the loop thread
    release.set()
    assert first.result(timeout=10).stored == 2
    assert called.wait(10)
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) for e in errors), errors
    for error in errors:
        message = str(error)
        assert "cannot join" not in message and "another thread" in message, message
    # The worker is intact: a second store finishes with its bytes in the store.
    more_tokens, more_src = rig.prompt(2), rig.blocks(2, source=True)
    assert worker.store(more_tokens, [more_src]).result(timeout=10).stored == 2
    for c, key in enumerate(rig.keys(more_tokens)):
        want = rig.chunk_bytes(more_src, c)
        assert read_value(rig.inner, key, len(want)) == want
    worker.close()
    assert not aiokv_threads()


def test_a_closed_threaded_worker_does_not_break_a_prometheus_scrape() -> None:
    """A closed ThreadedKVWorker's collector yields its last scraped values or nothing; scrapes succeed."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from aiokv.metrics import PrometheusExporter

    def stored_line(text: str) -> list[float]:
        prefix = 'aiokv_chunks_total{outcome="stored"}'
        return [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]

    registry = prometheus_client.CollectorRegistry()
    other = prometheus_client.Counter("other_total", "another component's metric", registry=registry)
    other.inc(3)
    rig = OneGroupRig(seed=11)
    worker = rig.threaded()
    PrometheusExporter(worker, registry)
    assert worker.store(rig.prompt(2), [rig.blocks(2, source=True)]).result(timeout=10).stored == 2
    assert stored_line(prometheus_client.generate_latest(registry).decode()) == [2.0]
    worker.close()
    text = prometheus_client.generate_latest(registry).decode()
    assert "other_total 3.0" in text
    assert stored_line(text) == [2.0]  # the last values
    # Never scraped before its close: nothing of it, the rest of the registry still exported.
    fresh = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("other_total", "another component's metric", registry=fresh).inc(1)
    unscraped = rig.threaded()
    PrometheusExporter(unscraped, fresh)
    unscraped.close()
    text = prometheus_client.generate_latest(fresh).decode()
    assert "other_total 1.0" in text and stored_line(text) == []


# -- a worker refuses calls from another event loop ----------------------------------------------------


LOOP_FACTORIES: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [
    ("asyncio", asyncio.new_event_loop)
] + ([("uvloop", uvloop.new_event_loop)] if uvloop is not None else [])


def _use_from_two_loops(factory: Callable[[], asyncio.AbstractEventLoop]) -> list[BaseException]:
    rig = OneGroupRig(seed=12)
    worker = rig.worker()
    tokens, src = rig.prompt(2), rig.blocks(2, source=True)

    async def first_run() -> int:
        await worker.start()
        return (await worker.store(tokens, [src])).stored

    async def second_run() -> list[BaseException]:
        errors: list[BaseException] = []
        for call in (
            lambda: worker.store(tokens, [src]),
            lambda: worker.load(tokens, [rig.blocks(2, source=False)]),
        ):
            try:
                future = call()
            except (AiokvError, RuntimeError) as exc:
                errors.append(exc)
            else:
                future.cancel()
                errors.append(AssertionError("accepted a request on a dead loop"))
        try:
            await asyncio.wait_for(worker.lookup(tokens), BOUND_S)
        except (AiokvError, RuntimeError, TimeoutError) as exc:
            errors.append(exc)
        return errors

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(first_run()) == 2
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(second_run())


@pytest.mark.parametrize("factory", [f for _, f in LOOP_FACTORIES], ids=[n for n, _ in LOOP_FACTORIES])
def test_a_worker_used_from_a_second_event_loop_refuses_at_the_call(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """store/load/lookup on a worker whose loop is gone (a second asyncio.run) raise at the call."""
    # Kept as text: the exceptions' tracebacks would keep the abandoned worker alive.
    errors = [(type(exc), str(exc)) for exc in _use_from_two_loops(factory)]
    # The abandoned worker's idle executor threads end once it is collected: none outlives the test.
    gc.collect()
    deadline = time.monotonic() + 10
    while aiokv_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(errors) == 3, errors
    for kind, message in errors:
        assert issubclass(kind, (AiokvError, RuntimeError)) and "loop" in message, (kind, message)
    assert not aiokv_threads(), "the abandoned worker's threads outlived it"
