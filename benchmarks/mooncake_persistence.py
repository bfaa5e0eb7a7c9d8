"""Mooncake's own SSD offload (``enable_ssd_offload``) against the same store with it off.

``python -m benchmarks.mooncake_persistence [--dir /tmp] [--value-mib 2] [--hot-mib 64]
[--segment-mib 128] [--pressure 3]`` starts a loopback ``mooncake_master`` per mode (``off``: plain;
``on``: master ``--enable_offload=true``, client ``setup(..., enable_ssd_offload=True,
ssd_offload_path=DIR)``, offload heartbeat 1 s) and, with one client whose segment holds the values:

1. puts ``--hot-mib`` of ``--value-mib`` values and gets them back (put / get GB/s, bytes checked);
2. puts ``--pressure`` times the segment size of other values (retrying while the store is full), so
   the first values are evicted from memory, then gets the first values again (get-after-eviction GB/s
   when every one comes back with its bytes; the page cache of the offload files is dropped first);
3. closes the client and reads the first values from a new client process on the same offload
   directory (client restart), then restarts the master and does that again (master restart).

CPU s/GB is this process's CPU time (every thread, user and system) over the bytes of steps 1-2.
Prints a table and a JSON dict. Mooncake's sockets are kept on loopback by running in a private network
namespace: outside one, the module re-runs itself under ``unshare -rn`` (as scripts/test.sh does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from aiokv.backends.mooncake_master import HOST, MooncakeMaster
from benchmarks.cli import _private_namespace
from benchmarks.disk import _buffer, _drop_cache, file_system

STORE_FULL = -200
OFFLOAD_ENV = {
    "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(256 << 20),
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
}
# Short read leases, so the first get's leases do not keep the measured values from eviction.
MASTER_ARGS = ("--default_kv_lease_ttl=500",)
MASTER_OFFLOAD_ARGS = (*MASTER_ARGS, "--enable_offload=true")
LOCAL_BUFFER = 64 << 20


def values(count: int, value_bytes: int, seed: int) -> npt.NDArray[np.uint8]:
    """``count`` values of ``value_bytes`` random bytes each, one page-aligned buffer."""
    array = _buffer(count * value_bytes)
    array[:] = np.random.default_rng(seed).integers(0, 256, count * value_bytes, dtype=np.uint8)
    return array


def offload_env(offload_dir: str) -> dict[str, str]:
    """The environment the client's SSD offload reads (set before :func:`connect`)."""
    return {**OFFLOAD_ENV, "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": offload_dir}


def connect(address: str, segment_bytes: int, offload_dir: str | None) -> Any:
    """A Mooncake client (``mooncake.store``) of ``address``; SSD offload on when ``offload_dir``
    (its environment, :func:`offload_env`, must already be set)."""
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]

    store = MooncakeDistributedStore()
    rc = store.setup(
        HOST,
        "P2PHANDSHAKE",
        segment_bytes,
        LOCAL_BUFFER,
        "tcp",
        "",
        address,
        enable_ssd_offload=offload_dir is not None,
        ssd_offload_path=offload_dir or "",
    )
    if rc != 0:
        raise RuntimeError(
            f"MooncakeDistributedStore.setup(enable_ssd_offload={offload_dir is not None}) -> {rc}"
        )
    return store


def put(store: Any, keys: list[str], buf: npt.NDArray[np.uint8], value_bytes: int, batch: int) -> list[int]:
    base = int(buf.ctypes.data)
    codes: list[int] = []
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        ptrs = [base + (start + i) * value_bytes for i in range(len(part))]
        codes += store.batch_put_from(part, ptrs, [value_bytes] * len(part))
    return codes


def get(store: Any, keys: list[str], buf: npt.NDArray[np.uint8], value_bytes: int, batch: int) -> list[int]:
    base = int(buf.ctypes.data)
    codes: list[int] = []
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        ptrs = [base + (start + i) * value_bytes for i in range(len(part))]
        codes += store.batch_get_into(part, ptrs, [value_bytes] * len(part))
    return codes


def read_back(
    store: Any, keys: list[str], expected: npt.NDArray[np.uint8], value_bytes: int, batch: int
) -> dict[str, Any]:
    """Get ``keys`` into a zeroed buffer: how many came back with their bytes, the codes, GB/s."""
    out = _buffer(expected.nbytes)
    store.register_buffer(int(out.ctypes.data), out.nbytes)
    started, cpu = time.perf_counter(), time.process_time()
    codes = get(store, keys, out, value_bytes, batch)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    store.unregister_buffer(int(out.ctypes.data))
    same = sum(
        1
        for i, code in enumerate(codes)
        if code == value_bytes
        and np.array_equal(
            out[i * value_bytes : (i + 1) * value_bytes], expected[i * value_bytes : (i + 1) * value_bytes]
        )
    )
    return {
        "same": same,
        "of": len(keys),
        "codes": sorted(set(codes)),
        "gbps": expected.nbytes / seconds / 1e9,
        "cpu_s": cpu,
    }


def _probe(args: argparse.Namespace) -> int:
    """Child process: a new client on the same offload directory reads the first values back."""
    expected = values(args.count, args.value_bytes, args.seed)
    keys = [f"{args.prefix}-{i}" for i in range(args.count)]
    if args.offload_dir:
        os.environ.update(offload_env(args.offload_dir))
    store = connect(args.address, args.segment_bytes, args.offload_dir or None)
    time.sleep(args.settle)  # the offload backend scans its files and reports them to the master
    result = read_back(store, keys, expected, args.value_bytes, args.batch)
    store.close()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # the client's threads are gone after close(); skip interpreter teardown


def probe(
    address: str, offload_dir: str | None, prefix: str, count: int, value_bytes: int, seed: int, settle: float
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "benchmarks.mooncake_persistence", "--probe",
        "--address", address, "--offload-dir", offload_dir or "", "--prefix", prefix,
        "--count", str(count), "--value-bytes", str(value_bytes), "--seed", str(seed),
        "--settle", str(settle), "--segment-bytes", str(64 << 20),
    ]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=180, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    return {"same": 0, "of": count, "error": f"exit status {done.returncode} (its log went to stderr)"}


def wait_offloaded(directory: str, nbytes: int, timeout: float) -> float:
    """Seconds until files under ``directory`` hold ``nbytes`` (or ``timeout``); -1 on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        total = 0
        for root, _, names in os.walk(directory):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(root, name))
        if total >= nbytes:
            return time.monotonic() - started
        time.sleep(0.1)
    return -1.0


def run_mode(mode: str, args: argparse.Namespace, work: str) -> dict[str, Any]:
    on = mode == "on"
    value_bytes = int(args.value_mib * (1 << 20))
    count = max(1, (args.hot_mib << 20) // value_bytes)
    segment = args.segment_mib << 20
    offload_dir = os.path.join(work, mode) if on else None
    if offload_dir is not None:
        os.makedirs(offload_dir)
    prefix = f"persist-{mode}-{os.getpid()}"
    keys = [f"{prefix}-{i}" for i in range(count)]
    hot = values(count, value_bytes, args.seed)
    row: dict[str, Any] = {"mode": mode}
    master = MooncakeMaster(extra_args=MASTER_OFFLOAD_ARGS if on else MASTER_ARGS)
    with master:
        if offload_dir is not None:
            os.environ.update(offload_env(offload_dir))
        try:
            store = connect(master.address, segment, offload_dir)
        except Exception as exc:
            row["error"] = f"{exc}; client log: see stderr"
            return row
        store.register_buffer(int(hot.ctypes.data), hot.nbytes)
        # Warm-up: the segment's pages are faulted in once, as in a long-running store.
        warm = [f"{prefix}-warm-{i}" for i in range(count)]
        put(store, warm, hot, value_bytes, args.batch)
        store.batch_remove(warm, True)
        cpu0, moved = time.process_time(), 0
        started = time.perf_counter()
        codes = put(store, keys, hot, value_bytes, args.batch)
        row["put_gbps"] = hot.nbytes / (time.perf_counter() - started) / 1e9
        moved += hot.nbytes
        if any(code != 0 for code in codes):
            row["error"] = f"put codes {sorted(set(codes))}"
        first = read_back(store, keys, hot, value_bytes, args.batch)
        row["get_gbps"] = first["gbps"]
        moved += hot.nbytes
        if on and offload_dir is not None:
            row["offload_wait_s"] = wait_offloaded(offload_dir, hot.nbytes, timeout=args.offload_wait)
            row["offload_files"] = sorted(os.listdir(offload_dir))[:6]
        time.sleep(1)  # the first get's leases (500 ms) have expired
        # Pressure: other values until the segment has been refilled ``--pressure`` times.
        filler = _buffer(args.batch * value_bytes)
        store.register_buffer(int(filler.ctypes.data), filler.nbytes)
        fill_keys = [f"{prefix}-fill-{i}" for i in range(int(args.pressure * segment // value_bytes))]
        full_retries, deadline = 0, time.monotonic() + 60
        for start in range(0, len(fill_keys), args.batch):
            part = fill_keys[start : start + args.batch]
            while True:
                got = put(store, part, filler, value_bytes, args.batch)
                moved += sum(value_bytes for code in got if code == 0)
                if all(code != STORE_FULL for code in got) or time.monotonic() > deadline:
                    break
                part = [key for key, code in zip(part, got, strict=True) if code == STORE_FULL]
                full_retries += 1
                time.sleep(0.05)
        row["full_retries"] = full_retries
        if offload_dir is not None:
            _drop_cache(offload_dir)
        after = read_back(store, keys, hot, value_bytes, args.batch)
        moved += after["same"] * value_bytes
        row["cpu_s_per_gb"] = (time.process_time() - cpu0) / (moved / 1e9)
        row["after_eviction"] = after
        row["survives_eviction"] = after["same"] == count
        if row["survives_eviction"]:
            row["get_after_eviction_gbps"] = after["gbps"]
        store.unregister_buffer(int(filler.ctypes.data))
        store.unregister_buffer(int(hot.ctypes.data))
        store.close()
        row["client_restart"] = probe(master.address, offload_dir, prefix, count, value_bytes, args.seed, 3.0)
        row["survives_client_restart"] = row["client_restart"]["same"] == count
        master.stop()
        master.start()
        row["master_restart"] = probe(master.address, offload_dir, prefix, count, value_bytes, args.seed, 3.0)
        row["survives_master_restart"] = row["master_restart"]["same"] == count
    return row


def table(rows: list[dict[str, Any]]) -> str:
    def num(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.2f}" if key in row else "-"

    def yes(row: dict[str, Any], key: str) -> str:
        return {True: "yes", False: "no"}.get(row.get(key), "-")  # type: ignore[arg-type]

    lines = [
        "| mode | put GB/s | get GB/s | get-after-eviction GB/s | survives eviction | client restart "
        "| master restart | CPU s/GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {num(row, 'put_gbps')} | {num(row, 'get_gbps')} "
            f"| {num(row, 'get_after_eviction_gbps')} | {yes(row, 'survives_eviction')} "
            f"| {yes(row, 'survives_client_restart')} | {yes(row, 'survives_master_restart')} "
            f"| {num(row, 'cpu_s_per_gb')} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def workdir(parent: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="mooncake-persistence-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mooncake_persistence", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dir", default="/tmp", help="offload files go to a fresh directory inside it")
    parser.add_argument("--value-mib", type=float, default=2)
    parser.add_argument("--hot-mib", type=int, default=64, help="bytes of the values measured and evicted")
    parser.add_argument("--segment-mib", type=int, default=128, help="the client's memory segment")
    parser.add_argument("--pressure", type=float, default=3, help="segments' worth of other values put")
    parser.add_argument("--batch", type=int, default=8, help="keys per call")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--modes", default="off,on")
    parser.add_argument("--offload-wait", type=float, default=15, help="seconds to wait for offload files")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    for name in ("--address", "--offload-dir", "--prefix"):
        parser.add_argument(name, default="", help=argparse.SUPPRESS)
    for name in ("--count", "--value-bytes", "--segment-bytes"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--settle", type=float, default=3.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return _probe(args)
    if not _private_namespace() and shutil.which("unshare"):
        script = 'ip link set lo up && exec "$0" -m benchmarks.mooncake_persistence "$@"'
        os.execvp("unshare", ["unshare", "-rn", "sh", "-c", script, sys.executable, *(argv or sys.argv[1:])])
    rows = []
    with workdir(args.dir) as work:
        for mode in args.modes.split(","):
            rows.append(run_mode(mode.strip(), args, work))
    print(table(rows))
    print(json.dumps({"file_system": file_system(args.dir), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
