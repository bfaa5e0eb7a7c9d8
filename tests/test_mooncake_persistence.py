"""What Mooncake 0.3.13's own SSD offload does for aiokv, against a real master and client.

Measured (``python -m benchmarks.mooncake_persistence``, docs/benchmarks.md): with the master's
``--enable_offload=true``, the client's ``setup(..., enable_ssd_offload=True, ssd_offload_path=DIR)``
and ``file_per_key_storage_backend``, each value is written to DIR about one offload heartbeat after its
put, and a value evicted from the memory segment comes back from the disk with its bytes: the master
lists the disk copy as a LOCAL_DISK replica, and the get reads it through the client's offload RPC
server. (With the default ``bucket_storage_backend`` nothing is written until a bucket holds 500 keys or
256 MiB, so a few values are evicted without a disk copy: -704.) This pins the working configuration: if
an upgrade breaks it, this test fails and docs/backends.md ("Mooncake's own persistence") needs
revisiting. The client runs in a child process (the benchmark's own), which exits right after
``close()``: Mooncake's offload threads can crash a process after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.mooncake_persistence import MASTER_OFFLOAD_ARGS, offload_env
from tests.mooncake_support import unique_keys


def test_ssd_offload_brings_evicted_values_back(
    mooncake_master_factory: Callable[..., Any], tmp_path: Any
) -> None:
    master = mooncake_master_factory(extra_args=MASTER_OFFLOAD_ARGS)
    command = [
        sys.executable, "-m", "benchmarks.mooncake_persistence", "--phase", "on",
        "--address", master.address, "--work", str(tmp_path), "--prefix", unique_keys(1, "offload")[0],
        "--hot-mib", "8", "--segment-mib", "32", "--pressure", "3", "--batch", "4",
        "--offload-wait", "10",
    ]  # fmt: skip
    env = {**os.environ, **offload_env(str(tmp_path / "on")), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=90, check=False, env=env)
    rows = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
    assert rows, f"exit status {done.returncode}"
    row = json.loads(rows[-1][len("ROW ") :])
    assert row["offload_wait_s"] >= 0  # the 8 MiB reached the directory
    # Evicted from memory: every key's only replica is its disk copy ...
    assert row["replicas_after_eviction"] == {"memory": 0, "local_disk": 4, "disk": 0, "none": 0}
    # ... and the gets read it back with its bytes.
    assert row["after_eviction"]["codes"] == [2 << 20]
    assert row["after_eviction"]["same"] == 4
