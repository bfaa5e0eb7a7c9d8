"""Mooncake's own disk tiers (SSD offload, ``--root_fs_dir``) against the same store without them.

``python -m benchmarks.mooncake_persistence [--dir /tmp] [--value-mib 2] [--hot-mib 64]
[--segment-mib 128] [--pressure 3] [--modes off,on,legacy]`` starts a loopback ``mooncake_master`` per
mode (``off``: plain; ``on``: SSD offload, master ``--enable_offload=true``, client
``setup(..., enable_ssd_offload=True, ssd_offload_path=DIR)``, ``--backend`` (default
``file_per_key_storage_backend``), offload heartbeat 1 s; ``legacy``: master ``--root_fs_dir=DIR``,
which clients read from the master) and, with one client process whose segment holds the values:

1. puts ``--hot-mib`` of ``--value-mib`` values and gets them back (put / get GB/s, bytes checked),
   then waits up to ``--offload-wait`` s for the disk directory to hold their bytes;
2. puts ``--pressure`` times the segment size of other values (retrying while the store is full), so
   the first values are evicted from memory ("evicted": the master lists none of them with a memory
   replica any more), then gets the first values again (get-after-eviction GB/s when every one comes
   back with its bytes; the page cache of the disk files is dropped first);
3. closes the client and reads the first values from a new client process on the same directory
   (client restart), then restarts the master and does that again (master restart).

Variants of ``on``: ``--offload-on-evict`` / ``--offload-force-evict`` (master flags),
``--backend bucket_storage_backend`` with ``--bucket-keys N`` (``MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT``),
``--offload-wait``, ``--settle`` (seconds a restarted client waits before its gets); ``--logs DIR`` keeps
the masters' logs. CPU s/GB is the first client process's CPU time (every thread, user and system) over
the bytes of steps 1-2. Prints a table and a JSON dict. Mooncake's sockets are kept on loopback by running
in a private network namespace: outside one, the module re-runs itself under ``unshare -rn`` (as
scripts/test.sh does).
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
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(256 << 20),
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
}
# Short read leases, so the first get's leases do not keep the measured values from eviction.
MASTER_ARGS = ("--default_kv_lease_ttl=500",)
MASTER_OFFLOAD_ARGS = (*MASTER_ARGS, "--enable_offload=true")
LOCAL_BUFFER = 64 << 20
# Writes each offloaded key at once. The default ``bucket_storage_backend`` holds offloaded keys back,
# unwritten, until a bucket has 500 keys or 256 MiB (``MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT``,
# ``MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES``): fewer values than that are evicted without a disk copy.
BACKEND = "file_per_key_storage_backend"


def values(count: int, value_bytes: int, seed: int) -> npt.NDArray[np.uint8]:
    """``count`` values of ``value_bytes`` random bytes each, one page-aligned buffer."""
    array = _buffer(count * value_bytes)
    array[:] = np.random.default_rng(seed).integers(0, 256, count * value_bytes, dtype=np.uint8)
    return array


def offload_env(offload_dir: str, backend: str = BACKEND, bucket_keys: int = 0) -> dict[str, str]:
    """The environment the client's SSD offload reads (set before :func:`connect`).

    ``bucket_keys`` > 0 sets ``MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT`` (keys per bucket file; the bucket
    backend holds offloaded keys back, unwritten, until a bucket has that many or 256 MiB)."""
    env = {
        **OFFLOAD_ENV,
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": backend,
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": offload_dir,
    }
    if bucket_keys > 0:
        env["MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT"] = str(bucket_keys)
    return env


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
        for name, value in offload_env(args.offload_dir).items():
            os.environ.setdefault(name, value)  # the parent's settings (backend, bucket keys) win
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


def disk_bytes(directory: str) -> int:
    """Bytes of the files under ``directory``."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def wait_offloaded(directory: str, nbytes: int, timeout: float) -> float:
    """Seconds until files under ``directory`` hold ``nbytes`` (or ``timeout``); -1 on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if disk_bytes(directory) >= nbytes:
            return time.monotonic() - started
        time.sleep(0.1)
    return -1.0


def replica_kinds(store: Any, keys: list[str]) -> dict[str, int]:
    """How many of ``keys`` the master lists with a memory replica, a LOCAL_DISK (SSD offload) replica,
    a disk (``--root_fs_dir``) replica, or none."""
    kinds = {"memory": 0, "local_disk": 0, "disk": 0, "none": 0}
    for key in keys:
        replicas = store.get_replica_desc(key)
        kinds["memory"] += any(r.is_memory_replica() for r in replicas)
        kinds["local_disk"] += any(r.is_local_disk_replica() for r in replicas)
        kinds["disk"] += any(r.is_disk_replica() for r in replicas)
        kinds["none"] += not replicas
    return kinds


def master_args(mode: str, args: argparse.Namespace, work: str) -> tuple[str, ...]:
    """The master's flags for ``mode``: ``off`` plain, ``on`` SSD offload (``--enable_offload``, with
    ``--offload_on_evict`` / ``--offload_force_evict`` when asked), ``legacy`` ``--root_fs_dir``."""
    if mode == "on":
        extra: tuple[str, ...] = ("--offload_on_evict=true",) if args.offload_on_evict else ()
        extra += ("--offload_force_evict=true",) if args.offload_force_evict else ()
        return (*MASTER_OFFLOAD_ARGS, *extra)
    if mode == "legacy":
        return (*MASTER_ARGS, f"--root_fs_dir={os.path.join(work, 'legacy')}")
    return MASTER_ARGS


def first_client(mode: str, args: argparse.Namespace, work: str, address: str) -> dict[str, Any]:
    """Steps 1-2 with one client of the master at ``address``; run in a child process (``--phase``),
    which exits right after ``close()``: Mooncake's offload threads can crash a process after it."""
    on = mode == "on"
    value_bytes = int(args.value_mib * (1 << 20))
    count = max(1, (args.hot_mib << 20) // value_bytes)
    segment = args.segment_mib << 20
    offload_dir = os.path.join(work, mode) if on else None
    watched = os.path.join(work, mode) if mode in ("on", "legacy") else None
    if watched is not None:
        os.makedirs(watched)
    prefix = args.prefix
    keys = [f"{prefix}-{i}" for i in range(count)]
    hot = values(count, value_bytes, args.seed)
    row: dict[str, Any] = {"mode": mode}
    if offload_dir is not None:
        os.environ.update(offload_env(offload_dir, args.backend, args.bucket_keys))
    try:
        store = connect(address, segment, offload_dir)
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
    if watched is not None:
        row["offload_wait_s"] = wait_offloaded(watched, hot.nbytes, timeout=args.offload_wait)
        row["offload_bytes"] = disk_bytes(watched)
        row["offload_files"] = sorted(os.listdir(watched))[:6]
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
    row["offload_bytes_after_pressure"] = disk_bytes(watched) if watched is not None else 0
    row["replicas_after_eviction"] = replica_kinds(store, keys)
    row["evicted"] = row["replicas_after_eviction"]["memory"] == 0
    if watched is not None:
        _drop_cache(watched)
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
    return row


def run_mode(mode: str, args: argparse.Namespace, work: str) -> dict[str, Any]:
    value_bytes = int(args.value_mib * (1 << 20))
    count = max(1, (args.hot_mib << 20) // value_bytes)
    offload_dir = os.path.join(work, mode) if mode == "on" else None
    prefix = f"persist-{mode}-{os.getpid()}"
    if offload_dir is not None:  # inherited by the child processes
        os.environ.update(offload_env(offload_dir, args.backend, args.bucket_keys))
    log = os.path.join(args.logs, f"master-{mode}.log") if args.logs else None
    with MooncakeMaster(extra_args=master_args(mode, args, work), log_path=log) as master:
        argv = [f"--modes={mode}" if a.startswith("--modes=") else a for a in sys.argv[1:]]
        argv = [mode if prev == "--modes" else a for prev, a in zip(["", *argv], argv, strict=False)]
        command = [
            sys.executable, "-m", "benchmarks.mooncake_persistence", *argv, "--phase", mode,
            "--address", master.address, "--work", work, "--prefix", prefix,
        ]  # fmt: skip
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=600, check=False)
        rows = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if not rows:
            return {"mode": mode, "error": f"first client: exit status {done.returncode} (log on stderr)"}
        row: dict[str, Any] = json.loads(rows[-1][len("ROW ") :])
        row["client_restart"] = probe(
            master.address, offload_dir, prefix, count, value_bytes, args.seed, args.settle
        )
        row["survives_client_restart"] = row["client_restart"]["same"] == count
        progress(row)
        master.stop()
        master.start()
        row["master_restart"] = probe(
            master.address, offload_dir, prefix, count, value_bytes, args.seed, args.settle
        )
        row["survives_master_restart"] = row["master_restart"]["same"] == count
    return row


def progress(row: dict[str, Any]) -> None:
    """The row so far, on stderr."""
    print("ROW " + json.dumps(row), file=sys.stderr, flush=True)


def table(rows: list[dict[str, Any]]) -> str:
    def num(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.2f}" if key in row else "-"

    def yes(row: dict[str, Any], key: str) -> str:
        return {True: "yes", False: "no"}.get(row.get(key), "-")  # type: ignore[arg-type]

    lines = [
        "| mode | put GB/s | get GB/s | evicted | get-after-eviction GB/s | survives eviction "
        "| client restart | master restart | CPU s/GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {num(row, 'put_gbps')} | {num(row, 'get_gbps')} | {yes(row, 'evicted')} "
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
    parser.add_argument("--modes", default="off,on,legacy")
    parser.add_argument("--offload-wait", type=float, default=15, help="seconds to wait for offload files")
    parser.add_argument(
        "--backend",
        default=BACKEND,
        help="MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR (file_per_key_storage_backend, ...)",
    )
    parser.add_argument("--bucket-keys", type=int, default=0, help="MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT")
    parser.add_argument("--offload-on-evict", action="store_true", help="master --offload_on_evict=true")
    parser.add_argument("--offload-force-evict", action="store_true", help="master --offload_force_evict")
    parser.add_argument("--logs", default="", help="keep the masters' logs in this directory")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    for name in ("--address", "--offload-dir", "--prefix", "--phase", "--work"):
        parser.add_argument(name, default="", help=argparse.SUPPRESS)
    for name in ("--count", "--value-bytes", "--segment-bytes"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--settle", type=float, default=3.0, help="seconds a restarted client waits before its gets"
    )
    args = parser.parse_args(argv)
    if args.probe:
        return _probe(args)
    if args.phase:
        row = first_client(args.phase, args, args.work, args.address)
        print("ROW " + json.dumps(row), flush=True)
        os._exit(0)  # before the closed client's threads can crash the process
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
