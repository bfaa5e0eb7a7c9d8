"""aiokv: move KV-cache chunks between a paged KV cache and a KV store, from asyncio.

``MooncakeBackend`` is imported lazily so that ``import aiokv`` never imports ``mooncake``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backends.base import Backend
from .backends.memory import MemoryBackend
from .breaker import BreakerConfig
from .errors import (
    AiokvError,
    BackendError,
    BackendUnavailableError,
    InvalidRequestError,
    TransferTimeoutError,
    WorkerClosedError,
)
from .futures import TransferFuture
from .keys import HashedPrompt, KeyNamespace, chunk_hashes
from .layout import KVLayout
from .results import LoadResult, StoreResult
from .runner import run
from .threaded import SyncTransferFuture, ThreadedKVWorker
from .worker import KVWorker, WorkerState

if TYPE_CHECKING:
    from .backends.mooncake import MooncakeBackend

__version__ = "0.1.0"

__all__ = [
    "AiokvError",
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "BreakerConfig",
    "HashedPrompt",
    "InvalidRequestError",
    "KVLayout",
    "KVWorker",
    "KeyNamespace",
    "LoadResult",
    "MemoryBackend",
    "MooncakeBackend",
    "StoreResult",
    "SyncTransferFuture",
    "ThreadedKVWorker",
    "TransferFuture",
    "TransferTimeoutError",
    "WorkerClosedError",
    "WorkerState",
    "chunk_hashes",
    "run",
]


def __getattr__(name: str) -> Any:
    if name == "MooncakeBackend":
        from .backends.mooncake import MooncakeBackend

        return MooncakeBackend
    raise AttributeError(f"module 'aiokv' has no attribute {name!r}")
