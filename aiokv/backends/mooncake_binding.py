"""Mooncake's Python binding, imported only when a backend is made: what to install when it will not
import, and the transport settings it must find in the environment before its setup."""

from __future__ import annotations

from typing import Any

from .mooncake_config import INSTALL_HINT

# Mooncake's TCP transport queues at most ~1024 slices per peer by default; a larger cross-process
# batch stalls 60 s and then fails -800. Mooncake reads these at setup, so they are set just before.
TCP_QUEUE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}


def import_hint(exc: ImportError) -> str:
    """What to install, from why ``mooncake.store`` would not import."""
    text = str(exc)
    if "libibverbs" in text:
        return (
            f"Mooncake's native library cannot load ({text}): install the system library with "
            "`apt-get install libibverbs1`"
        )
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mooncake":
        return f"MooncakeBackend needs the mooncake package: {INSTALL_HINT}"
    return f"cannot import mooncake.store ({text}); reinstall it: {INSTALL_HINT}"


def import_store() -> tuple[Any, Any]:
    """``MooncakeDistributedStore`` and ``ReplicateConfig``; an ``ImportError`` saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ImportError(import_hint(exc)) from exc
    return MooncakeDistributedStore, ReplicateConfig
