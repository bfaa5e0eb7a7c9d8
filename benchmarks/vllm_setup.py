"""What the vLLM benchmarks share: the store they start, the connector configurations they compare, and
the re-run inside a private network namespace (Mooncake must not listen outside this machine)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


def rerun_in_namespace(argv: list[str]) -> int:
    if shutil.which("unshare") is None:
        logger.error("not in a private network namespace and unshare is missing")
        return 2
    logger.info("re-running under unshare -rn (Mooncake must not listen outside this machine)")
    command = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable]
    return subprocess.run([*command, "-m", "benchmarks.vllm", *argv, "--no-unshare"], check=False).returncode
