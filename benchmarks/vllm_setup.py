"""What the vLLM benchmarks share: the store they start, the connector configurations they compare, and
the re-run inside a private network namespace (Mooncake must not listen outside this machine)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("benchmarks.vllm")


def mooncake_config(master_address: str) -> dict[str, Any]:
    """The JSON vLLM users give ``MOONCAKE_CONFIG_PATH``: standalone-store, the engines mount nothing."""
    return {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master_address,
        "protocol": "tcp",
        "device_name": "",
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": 256 << 20,
    }


def kv_transfer_config(
    name: str, store_config: dict[str, Any], aiokv_extra: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    common = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    if name == "recompute":
        return None
    if name == "vllm":
        return {"kv_connector": "MooncakeStoreConnector", **common}
    key_format = "vllm" if name == "aiokv-vllm-keys" else "aiokv"
    unverified = {"verify_values": False} if name == "aiokv-unverified" else {}
    full_blocks = {"store_prompt_tails": False} if name == "aiokv-full-blocks" else {}
    return {
        "kv_connector": "AiokvConnector",
        "kv_connector_module_path": "aiokv.integrations.vllm",
        "kv_connector_extra_config": {
            "backend": "mooncake",
            "mooncake_config": store_config,
            "key_format": key_format,
            **unverified,
            **full_blocks,
            **(aiokv_extra or {}),
        },
        **common,
    }


@contextlib.contextmanager
def mooncake_store(segment_bytes: int) -> Iterator[str]:
    """A fresh master and a holder process mounting ``segment_bytes``; yields the master's address."""
    from aiokv.backends.mooncake_master import MooncakeMaster, segment_holder

    with MooncakeMaster() as master, segment_holder(master.address, segment_bytes):
        yield master.address


@contextlib.contextmanager
def service_store(segment_bytes: int, log_path: Path | None = None) -> Iterator[tuple[str, str, int]]:
    """A fresh master and Mooncake's client service (``mooncake_client``) mounting ``segment_bytes``:
    the store every connector of a run uses. Yields the master's address, the service's (for clients
    that attach to it) and the service's pid (its CPU counts with the server's)."""
    from aiokv.backends.mooncake_master import MooncakeMaster, client_service

    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster())
        service = stack.enter_context(client_service(master.address, segment_bytes, log_path=log_path))
        yield master.address, service, service_pid(service)


def service_pid(address: str) -> int:
    """The pid of the process listening on the loopback TCP ``address`` (from /proc/net/tcp)."""
    port = int(address.rpartition(":")[2])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:  # LISTEN
            inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        return int(pid)
    raise RuntimeError(f"no process listens on {address}")


def rerun_in_namespace(argv: list[str]) -> int:
    if shutil.which("unshare") is None:
        logger.error("not in a private network namespace and unshare is missing")
        return 2
    logger.info("re-running under unshare -rn (Mooncake must not listen outside this machine)")
    command = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable]
    return subprocess.run([*command, "-m", "benchmarks.vllm", *argv, "--no-unshare"], check=False).returncode
