"""Backends for the connector: built with bounded waits, shared by both roles of an in-process engine.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the scheduler-side and worker-side connectors live in one
process: they share one backend (one Mooncake client). Otherwise each process has its own client; the
scheduler's is a pure client (no segment). The host-memory tier (``"memory"``, ``"tiered"``) is not a
shared backend: each worker holds its own (:mod:`..worker_side.tier_worker`).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ....backends.base import Backend
from .connector_config import ConnectorConfig, mooncake_client_config

logger = logging.getLogger("aiokv.vllm")

_lock = threading.Lock()
_shared: dict[str, list[Any]] = {}  # engine id -> [backend, users]


def new_mooncake_backend(config: ConnectorConfig, *, pure_client: bool) -> Backend:
    """A Mooncake client from the connector's ``mooncake_config`` (or ``MOONCAKE_CONFIG_PATH``)."""
    from ....backends.mooncake import MooncakeBackend

    client_config = mooncake_client_config(config.mooncake_config, pure_client=pure_client)
    # Mooncake retries a missing master for ~90 s by default; an engine must not sit that long.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(config.setup_retries))
    return MooncakeBackend(client_config)


def _new_backend(config: ConnectorConfig, *, pure_client: bool) -> Backend:
    if ":" in config.backend:
        # "package.module:factory": a backend of the user's own, factory(config, pure_client=...).
        module_name, _, attr = config.backend.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        backend: Backend = factory(config, pure_client=pure_client)
        return backend
    if not config.remote:
        raise ValueError("backend 'memory' is the host tier alone: there is no store to connect to")
    return new_mooncake_backend(config, pure_client=pure_client)


def acquire_backend(engine_id: str, config: ConnectorConfig, *, pure_client: bool) -> Backend | None:
    """This process's backend for ``engine_id``, or None (logged) when the store cannot be reached:
    the engine then runs without the cache instead of failing or hanging."""
    with _lock:
        entry = _shared.get(engine_id)
        if entry is not None:
            entry[1] += 1
            return entry[0]
        try:
            backend = _new_backend(config, pure_client=pure_client)
        except (ImportError, ValueError, TypeError):
            raise  # a configuration or installation error: the user must fix it
        except Exception as exc:
            logger.error("aiokv: the KV store is unreachable (%s); this engine runs without it", exc)
            return None
        _shared[engine_id] = [backend, 1]
        return backend


def release_backend(engine_id: str, backend: Backend) -> None:
    """Drop one user; the last one closes the backend."""
    with _lock:
        entry = _shared.get(engine_id)
        if entry is None or entry[0] is not backend:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _shared[engine_id]
    try:
        backend.close()
    except Exception:
        logger.exception("aiokv: closing the backend failed")


def shared_backend(engine_id: str) -> Backend | None:
    """The backend another role of this engine already holds in this process, if any."""
    with _lock:
        entry = _shared.get(engine_id)
        return entry[0] if entry is not None else None


def at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the interpreter exits, before ``concurrent.futures`` refuses new work (which
    happens before ``atexit`` handlers run, and vLLM shuts connectors down from those)."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn)
        return
    try:
        register(fn)
    except RuntimeError:  # already shutting down
        atexit.register(fn)


def safe_call(what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; log and swallow its exception (teardown paths must not raise into vLLM)."""
    try:
        return fn()
    except Exception:
        logger.exception("aiokv: %s failed", what)
        return None
