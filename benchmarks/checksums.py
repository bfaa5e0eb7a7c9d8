"""Checksum candidates for verified values against memcpy, on this machine.

``python -m benchmarks checksums [--mib 64] [--repeats 5]``. For each candidate installed (``crc32c``,
``google-crc32c``, ``xxhash``): GB/s over one large buffer and over 64 KiB pieces (a layer's page of a
chunk), both read in place through a memoryview (no copy), and whether the call releases the GIL: a
second Python thread counts while the first hashes the buffer, and its progress is compared with its
progress alone over the same time (about 1.0: released; near 0: held). memcpy is NumPy's ``copyto``
of the same buffer.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import threading
import time
from collections.abc import Callable

import numpy as np

Hasher = Callable[[memoryview], object]


def _candidates() -> dict[str, Hasher]:
    found: dict[str, Hasher] = {}
    try:
        crc32c = importlib.import_module("crc32c")
        found["crc32c (crc32c)"] = lambda view: crc32c.crc32c(view)
    except ImportError:
        pass
    try:
        google_crc32c = importlib.import_module("google_crc32c")
        # Its C extension takes only bytes (a memoryview, even read-only, is refused): a copy each call.
        found["google-crc32c (crc32c, bytes copy)"] = lambda view: google_crc32c.value(bytes(view))
    except ImportError:
        pass
    try:
        xxhash = importlib.import_module("xxhash")
        found["xxhash (xxh3_64)"] = lambda view: xxhash.xxh3_64_intdigest(view)
        found["xxhash (xxh3_128)"] = lambda view: xxhash.xxh3_128_intdigest(view)
    except ImportError:
        pass
    return found


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _counter_progress(seconds: float, busy: Callable[[], object] | None) -> float:
    """Increments a second thread makes in ``seconds`` while this thread runs ``busy`` (or sleeps)."""
    count = 0
    stop = threading.Event()

    def count_up() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=count_up)
    thread.start()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if busy is None:
            time.sleep(0.01)
        else:
            busy()
    stop.set()
    thread.join()
    return float(count)


def _each(hasher: Callable[[memoryview], object], pieces: list[memoryview]) -> None:
    for piece in pieces:
        hasher(piece)


def measure(mib: int, repeats: int) -> dict[str, dict[str, float]]:
    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    target = np.empty_like(data)
    view = memoryview(data.data)
    pieces = [view[i : i + (64 << 10)] for i in range(0, data.nbytes, 64 << 10)]
    results: dict[str, dict[str, float]] = {}
    memcpy_s = _best_s(lambda: np.copyto(target, data), repeats)
    results["memcpy (numpy copyto)"] = {"GB/s": data.nbytes / memcpy_s / 1e9}
    idle = _counter_progress(0.5, None)
    for name, hasher in _candidates().items():
        whole_s = _best_s(functools.partial(hasher, view), repeats)
        pieces_s = _best_s(functools.partial(_each, hasher, pieces), repeats)
        busy = _counter_progress(0.5, functools.partial(hasher, view))
        results[name] = {
            "GB/s": data.nbytes / whole_s / 1e9,
            "GB/s 64KiB pieces": data.nbytes / pieces_s / 1e9,
            "vs memcpy": memcpy_s / whole_s,
            "other thread's progress": busy / idle,
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks checksums", description=__doc__)
    parser.add_argument("--mib", type=int, default=64, help="buffer size in MiB (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs (default 5)")
    args = parser.parse_args(argv)
    results = measure(args.mib, args.repeats)
    width = max(map(len, results))
    for name, figures in results.items():
        line = ", ".join(f"{key} {value:.2f}" for key, value in figures.items())
        print(f"{name:<{width}}  {line}")
    print(json.dumps(results))
    return 0
