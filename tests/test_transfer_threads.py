"""Transfer threads take their next call themselves (aiokv/_engine/transfer_threads.py): a thread whose
call returned starts the next queued call while the event loop is busy. (That a call of a request
cancelled while it waits never starts: tests/test_reliability_shutdown.py and tests/test_lifecycle.py.)

Real KVWorker, real MemoryBackend behind aiokv.testing's FaultInjectingBackend (tests/rig.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiokv.testing import FaultRule
from tests.rig import SAFETY_S, Rig


@pytest.mark.asyncio
async def test_a_thread_starts_its_next_call_while_the_loop_is_busy() -> None:
    rig = Rig(seed=41)
    tokens, blocks = rig.prompt(3), rig.blocks(3, source=True)
    release = threading.Event()
    # One thread, one key per call: the store's puts queue behind each other; the first one hangs.
    async with rig.worker(executor_threads=1, max_regions_per_call=1) as worker:
        rig.backend.add_rule(FaultRule(op="put", hang=release, times=1, max_hang_s=SAFETY_S))
        store = worker.store(tokens, blocks)
        await rig.backend.wait_hanging_async(1, timeout=SAFETY_S)
        assert rig.backend.count("put") == 1
        threading.Timer(0.05, release.set).start()
        time.sleep(0.5)  # the loop is held: nothing on it runs until this returns
        puts_while_held = rig.backend.count("put")
        result = await asyncio.wait_for(store, SAFETY_S)
    assert puts_while_held >= 2, "the thread waited for the loop to start its next call"
    assert result.stored == 3 and result.failed == 0
