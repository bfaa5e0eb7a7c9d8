"""GIL-held time of one request on the Mooncake path, through aiokv's public API only.

The request is stored once through a :class:`~aiokv.KVWorker` on the backend wrapped in
:class:`~aiokv.testing.FaultInjectingBackend`, whose records give the exact calls the worker makes
(how many, and each call's region tables), whatever rule the worker splits by. Then each recorded
region table is passed, in isolation, to a public ``batch_get`` of keys the store does not hold: the
backend checks the regions, builds and converts the arguments, and the store answers "not found"
without moving a byte. Its wall time bounds the GIL-held time of that call from above (the master's
answer is included). ``prepare`` is ``KVLayout.regions_for_chunks`` for the request's chunks.

The finer split of a call (bounds checks, list building, the binding's own conversion) needs the
backend's internals: ``python -m benchmarks mooncake-conversion`` measures it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiokv import KVWorker
from aiokv._arrays import IntArray
from aiokv.backends.base import Backend
from aiokv.keys import HashedPrompt, KeyNamespace
from aiokv.layout import KVLayout
from aiokv.testing import Call, FaultInjectingBackend


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in ms."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


async def mooncake_gil_breakdown(
    backend: Backend,
    layout: KVLayout,
    prompt: HashedPrompt,
    block_ids: IntArray,
    *,
    namespace: KeyNamespace | str,
    worker_options: dict[str, Any],
    repeats: int,
) -> tuple[dict[str, Any], list[str]]:
    """Store ``prompt`` from ``block_ids`` through a worker on a recording wrapper of ``backend``, then
    time each of its recorded puts' region tables in an absent-key get (see the module docstring).

    Returns the figures (``prepare_ms``, ``calls_ms``, ``total_ms``, ``calls_per_request``,
    ``longest_call_ms``, ``max_regions_per_call``; best of ``repeats`` each, in ms) and the keys the
    store wrote, for the caller to remove.
    """
    recorder = FaultInjectingBackend(backend)
    async with KVWorker(
        layout, recorder, namespace=namespace, chunk_tokens=prompt.chunk_tokens, **worker_options
    ) as worker:
        result = await worker.store(prompt, [block_ids])
        if not result.ok:
            raise RuntimeError(f"the recorded store failed: {result}")
        calls = recorder.calls_of("put")
        matrix = block_ids.reshape(len(prompt.hashes), -1)
        # While the worker is open its memory is registered, so the backend accepts the tables.
        figures = await asyncio.to_thread(_time_calls, backend, layout, matrix, calls, repeats)
        figures["max_regions_per_call"] = worker.max_regions_per_call
    return figures, recorder.sent_keys("put")


def _time_calls(
    backend: Backend, layout: KVLayout, matrix: IntArray, calls: Sequence[Call], repeats: int
) -> dict[str, Any]:
    prepare_ms = best_ms(lambda: layout.regions_for_chunks(matrix), repeats)
    probe = f"aiokv-bench-gil-probe-{uuid.uuid4().hex}"
    call_times = []
    for number, call in enumerate(calls):
        if call.addrs is None or call.sizes is None:
            raise RuntimeError("a recorded put has no region table")
        keys = [f"{probe}-{number}-{i}" for i in range(len(call.keys))]

        def absent_get(keys: list[str] = keys, call: Call = call) -> None:
            codes = backend.batch_get(keys, call.addrs, call.sizes)  # type: ignore[arg-type]
            if len(codes) != len(keys) or max(codes) >= 0:
                raise RuntimeError(f"a get of absent keys answered {sorted(set(codes))[:5]}")

        call_times.append(best_ms(absent_get, repeats))
    calls_ms = float(np.sum(call_times)) if call_times else 0.0
    return {
        "prepare_ms": prepare_ms,
        "calls_ms": calls_ms,
        "total_ms": prepare_ms + calls_ms,
        "calls_per_request": len(call_times),
        "longest_call_ms": max(call_times, default=0.0),
    }
