"""Pytest fixtures that run a real ``mooncake_master`` and real Mooncake clients (no mocks).

Registered from ``tests/conftest.py``. The Mooncake tests need the ``mooncake`` package and a private
network namespace (some Mooncake sockets listen on all interfaces). Where either is missing they skip
with the reason, except under CI (``CI`` set), where they fail: CI must never skip them silently.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from aiokv.backends.mooncake_master import MooncakeMaster, find_master_executable

NAMESPACE_HINT = (
    "run inside a private network namespace: unshare -rn sh -c 'ip link set lo up && python -m pytest tests'"
)


# The required keys of a Mooncake config, for config tests that never connect.
CONFIG_BASE = {
    "local_hostname": "127.0.0.1",
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": "127.0.0.1:1",
}
# A mapped-nowhere address: Mooncake (or a copy into it) would SIGSEGV on it, so reaching native code
# kills the test run.
WILD = 1 << 46


def network_interfaces() -> set[str]:
    """Interface names this process's network namespace has (from ``/proc/net/dev``)."""
    with open("/proc/net/dev") as dev:
        lines = dev.read().splitlines()[2:]  # two header lines
    return {line.split(":", 1)[0].strip() for line in lines if ":" in line}


@functools.cache
def mooncake_unavailable_reason() -> str | None:
    """Why the Mooncake tests cannot run here, or None when they can."""
    from aiokv.backends.mooncake_binding import import_store  # its ImportError says what to install

    try:
        import_store()
        find_master_executable()
    except (ImportError, FileNotFoundError) as exc:
        return f"Mooncake is not usable here: {exc}"
    try:
        interfaces = network_interfaces()
    except OSError as exc:
        return f"{NAMESPACE_HINT} (cannot read /proc/net/dev: {exc})"
    if interfaces != {"lo"}:
        return f"{NAMESPACE_HINT} (this namespace has {', '.join(sorted(interfaces))})"
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_mooncake() -> None:
    """Skip the calling test (fail it under CI) unless a real master can run here."""
    reason = mooncake_unavailable_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI must run the Mooncake tests, but: {reason}", pytrace=False)
    pytest.skip(reason)


def unique_keys(count: int, prefix: str = "t") -> list[str]:
    """Keys no other test uses (tests share one master)."""
    tag = uuid.uuid4().hex[:12]
    return [f"{prefix}-{tag}-{i}" for i in range(count)]


@contextlib.contextmanager
def registered(backend: Any, array: npt.NDArray[Any]) -> Iterator[int]:
    """Register ``array``'s memory with ``backend`` for the block; yields its address."""
    addr = int(array.ctypes.data)
    backend.register_buffer(addr, array.nbytes)
    try:
        yield addr
    finally:
        # Unregistered before the array can be freed, so a later buffer at the same address is new.
        if not backend.closed:
            backend.unregister_buffer(addr)


def random_bytes(nbytes: int, seed: int | None = None) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


MOONCAKE_FIXTURES = frozenset(
    {"mooncake_master", "mooncake_master_factory", "mooncake_backend", "mooncake_backend_factory"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a real master ``mooncake``, so ``-m 'not mooncake'`` leaves them out."""
    for item in items:
        if MOONCAKE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.mooncake)


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """One master for the session; tests that kill or fill a master start their own."""
    require_mooncake()
    master = MooncakeMaster()
    try:
        master.start()
        yield master
    finally:
        master.stop()


@pytest.fixture
def mooncake_master_factory() -> Iterator[Callable[..., MooncakeMaster]]:
    """Start masters of the test's own; all are stopped at teardown."""
    require_mooncake()
    masters: list[MooncakeMaster] = []

    def start(**kwargs: Any) -> MooncakeMaster:
        master = MooncakeMaster(**kwargs)
        masters.append(master)
        return master.start()

    try:
        yield start
    finally:
        for master in masters:
            master.stop()


@pytest.fixture
def mooncake_backend_factory() -> Iterator[Callable[..., Any]]:
    """``MooncakeBackend.from_master(address, **overrides)``; all are closed at teardown."""
    require_mooncake()
    from aiokv.backends.mooncake import MooncakeBackend

    backends: list[MooncakeBackend] = []

    def connect(address: str, **overrides: Any) -> MooncakeBackend:
        backend = MooncakeBackend.from_master(address, **overrides)
        backends.append(backend)
        return backend

    try:
        yield connect
    finally:
        for backend in backends:
            backend.close()


@pytest.fixture(scope="module")
def mooncake_backend(mooncake_master: MooncakeMaster) -> Iterator[Any]:
    """A client of the session master, shared by a module's tests (closing one takes 1-2 s)."""
    from aiokv.backends.mooncake import MooncakeBackend

    backend = MooncakeBackend.from_master(mooncake_master.address)
    try:
        yield backend
    finally:
        backend.close()
