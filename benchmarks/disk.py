"""DiskBackend against the raw file system it stores on.

``python -m benchmarks.disk DIR [--total-mib 1024] [--value-mib 4] [--regions 16]`` prints one JSON
dict: the file system under ``DIR`` (type, device, whether it takes ``O_DIRECT``), the backend's put and
get GB/s and CPU seconds per GB (the whole process: user and system time) for values whose regions
are page-aligned (moved in place) and for regions that are not (moved through the staging buffer),
and ``dd``'s sequential write and read of the same bytes in value-sized blocks, with ``oflag=direct``
/ ``iflag=direct`` where the file system takes them. ``memory_level``: the same values through
``MemoryDiskBackend`` (a memory level holding them all in front of the disk): put, a first get from the
disk (each value promoted into memory), a second get from memory (``get2``).

Each value is ``--regions`` regions of a source buffer, the regions of different values interleaved
(as a KV cache's per-layer pages are), so no value is one contiguous range. Gets start cold: written
with ``O_DIRECT`` nothing is cached; written through the page cache, the files' cached pages are
dropped first (``posix_fadvise``), except on tmpfs where the page cache is the storage. Everything is
written under a fresh directory inside ``DIR``, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from aiokv import MemoryDiskBackend
from aiokv.backends.disk import DiskBackend
from aiokv.backends.disk_format import ALIGN, file_bytes

UNALIGNED_SKEW = 64  # cache-line aligned, not page-aligned: what the staging path exists for
SLOTS = 8  # values' worth of distinct source memory (values reuse it round-robin)


def file_system(directory: str) -> dict[str, str]:
    """The type, device and mount point of the file system holding ``directory`` (``/proc/mounts``, the
    longest mount point containing it; ``stat -f`` where that is unreadable)."""
    path = os.path.realpath(directory)
    best: dict[str, str] = {}
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                device, mount, kind = (_unescape(field) for field in line.split()[:3])
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best.get("mount", "")):
                    best = {"type": kind, "device": device, "mount": mount}
    except OSError:
        pass
    if best:
        return best
    answer = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=False)
    return {"type": answer.stdout.strip() or "unknown", "device": "unknown", "mount": "unknown"}


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def run(
    directory: str,
    total_bytes: int = 1 << 30,
    value_bytes: int = 4 << 20,
    *,
    regions: int = 16,
    keys_per_call: int = 4,
    threads: int = 1,
    direct_io: bool | None = None,
) -> dict[str, Any]:
    """Measure DiskBackend and ``dd`` under ``directory``; the results as a JSON-ready dict.
    ``direct_io``: as DiskBackend's (None: ``O_DIRECT`` where the file system takes it)."""
    if value_bytes <= 0 or value_bytes % (regions * ALIGN):
        raise ValueError(f"value_bytes must be a positive multiple of regions * {ALIGN}, got {value_bytes}")
    if total_bytes < value_bytes:
        raise ValueError(f"total_bytes ({total_bytes}) must hold at least one value ({value_bytes})")
    count = total_bytes // value_bytes
    work = tempfile.mkdtemp(prefix="aiokv-disk-bench-", dir=directory)
    try:
        fs = file_system(work)
        capacity = 2 * count * file_bytes(32, value_bytes)
        results: dict[str, Any] = {
            "directory": os.path.realpath(directory),
            "file_system": fs,
            "total_bytes": count * value_bytes,
            "value_bytes": value_bytes,
            "regions_per_value": regions,
            "keys_per_call": keys_per_call,
            "threads": threads,
        }
        with DiskBackend(os.path.join(work, "store"), capacity, direct_io=direct_io) as backend:
            results["direct_io"] = backend.direct_io
            cached = not backend.direct_io and fs["type"] != "tmpfs"
            results["backend"] = {
                layout: _measure_backend(
                    backend, count, value_bytes, regions, keys_per_call, threads, skew, cached
                )
                for layout, skew in (("aligned", 0), ("unaligned", UNALIGNED_SKEW))
            }
        # The memory level in front (MemoryDiskBackend): gets from the disk promote, the next ones hit
        # memory; the level holds every value.
        # The gets run on a restarted backend: its memory level starts empty.
        memory = count * value_bytes + (64 << 20)
        levels_dir = os.path.join(work, "levels")

        def restarted(old: DiskBackend | MemoryDiskBackend) -> MemoryDiskBackend:
            old.close()
            return MemoryDiskBackend(levels_dir, capacity, memory, direct_io=direct_io)

        levels = MemoryDiskBackend(levels_dir, capacity, memory, direct_io=direct_io)
        results["memory_level"] = _measure_backend(
            levels, count, value_bytes, regions, keys_per_call, threads, 0, cached, gets=2, restart=restarted
        )
        results["dd"] = _measure_dd(work, count, value_bytes, direct=results["direct_io"], cached=cached)
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure_backend(
    backend: DiskBackend | MemoryDiskBackend,
    count: int,
    value_bytes: int,
    regions: int,
    keys_per_call: int,
    threads: int,
    skew: int,
    cached: bool,
    *,
    gets: int = 1,
    restart: Callable[[DiskBackend | MemoryDiskBackend], DiskBackend | MemoryDiskBackend] | None = None,
) -> dict[str, float | bool]:
    """Put every value, then get every value ``gets`` times (the page cache of the files dropped
    first: a get reads the device, or the memory level); ``restart``: the backend closed and opened
    again between the puts and the gets (it is then closed here)."""
    piece = value_bytes // regions
    src = _buffer(SLOTS * value_bytes + skew)
    dst = _buffer(SLOTS * value_bytes + skew)
    src[:] = np.random.default_rng(0).integers(0, 256, size=src.size, dtype=np.uint8)
    for buf in (src, dst):
        backend.register_buffer(int(buf.ctypes.data), buf.nbytes)

    def regions_of(buf: npt.NDArray[np.uint8], k: int) -> list[int]:
        # Region r of slot s at (r * SLOTS + s) * piece: one value's regions are never adjacent.
        base = int(buf.ctypes.data) + skew
        return [base + (r * SLOTS + k % SLOTS) * piece for r in range(regions)]

    keys = [f"bench-{skew}-{k}" for k in range(count)]
    sizes = [piece] * regions

    def calls(buf: npt.NDArray[np.uint8], call: Callable[..., list[int]]) -> None:
        """Every key, ``keys_per_call`` a call, the calls spread over ``threads`` threads (as the
        worker's transfer threads make them)."""

        def one(first: int) -> None:
            part = range(first, min(count, first + keys_per_call))
            codes = call([keys[k] for k in part], [regions_of(buf, k) for k in part], [sizes] * len(part))
            if any(code < 0 for code in codes):
                raise RuntimeError(f"{call.__name__} answered {codes}")

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, count, keys_per_call)))

    try:
        put_s, put_cpu = _timed(lambda: calls(src, backend.batch_put))
        if restart is not None:
            for buf in (src, dst):
                backend.unregister_buffer(int(buf.ctypes.data))
            backend = restart(backend)
            for buf in (src, dst):
                backend.register_buffer(int(buf.ctypes.data), buf.nbytes)
        if cached:
            _drop_cache(backend.directory)
        get_s, get_cpu = _timed(lambda: calls(dst, backend.batch_get))
        again = [_timed(lambda: calls(dst, backend.batch_get)) for _ in range(gets - 1)]
        last = count - 1
        loaded = all(
            np.array_equal(src[a - int(src.ctypes.data) :][:piece], dst[b - int(dst.ctypes.data) :][:piece])
            for a, b in zip(regions_of(src, last), regions_of(dst, last), strict=True)
        )
        backend.batch_remove(keys, force=True)
    finally:
        for buf in (src, dst):
            backend.unregister_buffer(int(buf.ctypes.data))
        if restart is not None:
            backend.close()
    gigabytes = count * value_bytes / 1e9
    figures: dict[str, float | bool] = {
        "put_gbps": round(gigabytes / put_s, 3),
        "put_cpu_s_per_gb": round(put_cpu / gigabytes, 3),
        "get_gbps": round(gigabytes / get_s, 3),
        "get_cpu_s_per_gb": round(get_cpu / gigabytes, 3),
        "loaded_bytes_checked": loaded,
    }
    for n, (seconds, cpu) in enumerate(again, start=2):
        figures[f"get{n}_gbps"] = round(gigabytes / seconds, 3)
        figures[f"get{n}_cpu_s_per_gb"] = round(cpu / gigabytes, 3)
    return figures


def restart_scan(
    directory: str, chunks: int, value_bytes: int = 4096, *, keys_per_call: int = 256
) -> dict[str, Any]:
    """What a restart costs: ``chunks`` values of ``value_bytes`` written by one DiskBackend, closed,
    the files' cached pages dropped, then a new DiskBackend opened on the directory (its index rebuilt
    from the files' headers) and timed, wall and CPU; the values it found counted."""
    work = tempfile.mkdtemp(prefix="aiokv-disk-restart-", dir=directory)
    try:
        path = os.path.join(work, "store")
        capacity = 2 * chunks * file_bytes(32, value_bytes)
        src = _buffer(value_bytes)
        src[:] = 7
        with DiskBackend(path, capacity) as backend:
            backend.register_buffer(int(src.ctypes.data), src.nbytes)
            for first in range(0, chunks, keys_per_call):
                keys = [f"restart-{k:09d}" for k in range(first, min(chunks, first + keys_per_call))]
                codes = backend.batch_put(
                    keys, [[int(src.ctypes.data)]] * len(keys), [[value_bytes]] * len(keys)
                )
                if any(code < 0 for code in codes):
                    raise RuntimeError(f"batch_put answered {codes}")
            backend.unregister_buffer(int(src.ctypes.data))
        _drop_cache(path)
        opened: list[DiskBackend] = []
        seconds, cpu = _timed(lambda: opened.append(DiskBackend(path, capacity)))
        with opened[0] as backend:
            found = len(backend)
        return {
            "file_system": file_system(work),
            "chunks": chunks,
            "value_bytes": value_bytes,
            "found": found,
            "open_s": round(seconds, 3),
            "open_cpu_s": round(cpu, 3),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure_dd(work: str, count: int, value_bytes: int, *, direct: bool, cached: bool) -> dict[str, Any]:
    """``dd`` of the same bytes in value-sized blocks: from /dev/zero to a file, then back."""
    target = os.path.join(work, "dd.bin")
    write_flags = ["oflag=direct"] if direct else []
    read_flags = ["iflag=direct"] if direct else []
    block = f"bs={value_bytes}"
    write_s, write_cpu = _dd(["if=/dev/zero", f"of={target}", block, f"count={count}", *write_flags])
    if cached:
        _drop_cache(work)
    read_s, read_cpu = _dd([f"if={target}", "of=/dev/null", block, *read_flags])
    os.unlink(target)
    gigabytes = count * value_bytes / 1e9
    return {
        "write_gbps": round(gigabytes / write_s, 3),
        "write_cpu_s_per_gb": round(write_cpu / gigabytes, 3),
        "read_gbps": round(gigabytes / read_s, 3),
        "read_cpu_s_per_gb": round(read_cpu / gigabytes, 3),
        "flags": " ".join([*write_flags, *read_flags]) or "buffered",
    }


def _dd(arguments: list[str]) -> tuple[float, float]:
    """Run ``dd``; its own elapsed seconds (from its report) and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    answer = subprocess.run(
        ["dd", *arguments], capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"}
    )
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    reported = re.search(r"copied, ([0-9.e+-]+) s", answer.stderr)
    seconds = float(reported[1]) if reported else elapsed
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu


def _timed(work: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (every thread, user and system) of ``work``."""
    started, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - started, time.process_time() - cpu


def _buffer(size: int) -> npt.NDArray[np.uint8]:
    """Page-aligned memory, its pages faulted in (a KV cache's are)."""
    array = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    array[:] = 0
    return array


def _drop_cache(directory: str) -> None:
    """Drop the cached pages of every file under ``directory``: the next reads come from the disk."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk", description=__doc__.split("\n")[0])
    parser.add_argument("directory", help="where to write (a fresh directory inside it, removed after)")
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes written per measurement")
    parser.add_argument("--value-mib", type=float, default=4, help="size of one value")
    parser.add_argument("--regions", type=int, default=16, help="regions per value")
    parser.add_argument("--keys-per-call", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="threads making the calls")
    parser.add_argument("--buffered", action="store_true", help="never O_DIRECT (backend and dd)")
    parser.add_argument(
        "--restart-chunks",
        type=int,
        metavar="N",
        help="instead: write N small values, then time a new DiskBackend opening on them (a restart)",
    )
    args = parser.parse_args(argv)
    if args.restart_chunks:
        print(json.dumps(restart_scan(args.directory, args.restart_chunks), indent=2))
        return 0
    results = run(
        args.directory,
        total_bytes=args.total_mib << 20,
        value_bytes=int(args.value_mib * (1 << 20)),
        regions=args.regions,
        keys_per_call=args.keys_per_call,
        threads=args.threads,
        direct_io=False if args.buffered else None,
    )
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
