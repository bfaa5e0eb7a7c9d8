"""aiokv: move KV-cache chunks between a paged KV cache and a KV store, from asyncio.

Everything a user needs is exported here; the submodules are the implementation. Two subpackages are
public on their own: :mod:`aiokv.testing` (test doubles) and :mod:`aiokv.integrations.vllm` (the vLLM
KV connector, loaded by vLLM from its module path).

The Mooncake names (``MooncakeBackend``, ``MooncakeConfig``, ``MooncakeMaster``, ``parse_size``,
``segment_holder``) are imported lazily so that ``import aiokv`` never imports ``mooncake``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from ._lifecycle import WorkerState
from ._validate import BlockIds
from .backends.base import (
    DEFAULT_REGIONS_PER_CALL,
    MAX_KEYS_PER_CALL,
    Backend,
    BackendTraits,
    Regions,
    RegionTable,
    RegisteredMemory,
    backend_traits,
    check_backend,
    keys_per_call,
)
from .backends.disk import DiskBackend
from .backends.memory import MemoryBackend
from .backends.memory_disk import MemoryDiskBackend
from .backends.verified import VerifiedBackend
from .breaker import BreakerConfig, BreakerState, CircuitBreaker
from .codes import PUBLIC_ERROR_CODES, Code, code_name
from .errors import (
    AiokvError,
    BackendError,
    BackendUnavailableError,
    InvalidRequestError,
    TransferTimeoutError,
    WorkerClosedError,
)
from .futures import TransferFuture
from .keys import HashedPrompt, KeyNamespace, TokenIds, chunk_hashes
from .layout import KVLayout
from .leases import LeaseBudget
from .results import LoadResult, StoreResult
from .runner import loop_factory, run
from .stats import ChunkOutcome, Kind, Op, StatName
from .threaded import SyncTransferFuture, ThreadedKVWorker
from .tier_events import TierEvent, TierEventStream, TierListener
from .worker import KVWorker

if TYPE_CHECKING:
    from .backends.mooncake import MooncakeBackend
    from .backends.mooncake_config import MooncakeConfig, parse_size
    from .backends.mooncake_master import MooncakeMaster, segment_holder

try:  # one version, pyproject.toml's, as installed
    __version__ = importlib.metadata.version("aiokv")
except importlib.metadata.PackageNotFoundError:  # a source tree not installed
    __version__ = "0+unknown"

# name -> the module that defines it, imported on first use.
_LAZY = {
    "MooncakeBackend": ".backends.mooncake",
    "MooncakeConfig": ".backends.mooncake_config",
    "parse_size": ".backends.mooncake_config",
    "MooncakeMaster": ".backends.mooncake_master",
    "segment_holder": ".backends.mooncake_master",
}

__all__ = [
    "DEFAULT_REGIONS_PER_CALL",
    "MAX_KEYS_PER_CALL",
    "PUBLIC_ERROR_CODES",
    "AiokvError",
    "Backend",
    "BackendError",
    "BackendTraits",
    "BackendUnavailableError",
    "BlockIds",
    "BreakerConfig",
    "BreakerState",
    "ChunkOutcome",
    "CircuitBreaker",
    "Code",
    "DiskBackend",
    "HashedPrompt",
    "InvalidRequestError",
    "KVLayout",
    "KVWorker",
    "KeyNamespace",
    "Kind",
    "LeaseBudget",
    "LoadResult",
    "MemoryBackend",
    "MemoryDiskBackend",
    "MooncakeBackend",
    "MooncakeConfig",
    "MooncakeMaster",
    "Op",
    "RegionTable",
    "Regions",
    "RegisteredMemory",
    "StatName",
    "StoreResult",
    "SyncTransferFuture",
    "ThreadedKVWorker",
    "TierEvent",
    "TierEventStream",
    "TierListener",
    "TokenIds",
    "TransferFuture",
    "TransferTimeoutError",
    "VerifiedBackend",
    "WorkerClosedError",
    "WorkerState",
    "backend_traits",
    "check_backend",
    "chunk_hashes",
    "code_name",
    "keys_per_call",
    "loop_factory",
    "parse_size",
    "run",
    "segment_holder",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'aiokv' has no attribute {name!r}")
