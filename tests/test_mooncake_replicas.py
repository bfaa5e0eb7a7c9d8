"""MooncakeBackend's extras beyond the protocol, against a real master on loopback: reads straight from a
replica (``read_from_replicas``), replica endpoints, ``health_check``. The node-loss case
(a replica's node SIGKILLed) is in tests/cluster/test_replicas.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiokv import Code
from aiokv.backends.mooncake import MooncakeBackend
from aiokv.backends.mooncake_master import MooncakeMaster
from aiokv.backends.mooncake_replicas import engine_hostname
from aiokv.errors import BackendError, InvalidRequestError

from .mooncake_support import random_bytes, registered, unique_keys

KiB = 1 << 10
Factory = Callable[..., MooncakeBackend]


@pytest.fixture
def backend(mooncake_master: MooncakeMaster, mooncake_backend_factory: Factory) -> MooncakeBackend:
    """A client of its own: its replica reader (a second transfer engine) is made and closed here."""
    return mooncake_backend_factory(mooncake_master.address)


def test_read_from_replicas_reads_the_stored_bytes_into_other_regions(backend: MooncakeBackend) -> None:
    src, dst = random_bytes(256 * KiB, seed=11), np.zeros(256 * KiB, np.uint8)
    keys = unique_keys(3)
    with registered(backend, src) as s, registered(backend, dst) as d:
        sizes = [[16 * KiB, 4 * KiB]] * 3
        assert (
            backend.batch_put(
                keys, [[s + k * 32 * KiB, s + 200 * KiB + k * 4 * KiB] for k in range(3)], sizes
            )
            == [Code.OK] * 3
        )
        # Read back split differently (totals equal): 20 KiB per key into two other regions.
        get_addrs = [[d + k * 64 * KiB, d + k * 64 * KiB + 40 * KiB] for k in range(3)]
        get_sizes = [[12 * KiB, 8 * KiB]] * 3
        assert backend.read_from_replicas(keys, get_addrs, get_sizes) == [20 * KiB] * 3
    for k in range(3):
        expected = np.concatenate(
            [src[k * 32 * KiB : k * 32 * KiB + 16 * KiB], src[200 * KiB + k * 4 * KiB :][: 4 * KiB]]
        )
        actual = np.concatenate([dst[k * 64 * KiB :][: 12 * KiB], dst[k * 64 * KiB + 40 * KiB :][: 8 * KiB]])
        assert np.array_equal(actual, expected), k


def test_size_mismatch_and_missing_keys_are_answered_without_writing(backend: MooncakeBackend) -> None:
    src, dst = random_bytes(64 * KiB, seed=12), np.full(64 * KiB, 0xEE, np.uint8)
    present, absent = unique_keys(2)
    with registered(backend, src) as s, registered(backend, dst) as d:
        assert backend.batch_put([present], [[s]], [[8 * KiB]]) == [Code.OK]
        codes = backend.read_from_replicas(
            [present, present, absent, present],
            [[d], [d + 16 * KiB], [d + 32 * KiB], [d + 48 * KiB]],
            [[8 * KiB - 1], [8 * KiB + 1], [8 * KiB], [8 * KiB]],
        )
        assert codes == [Code.INVALID, Code.INVALID, Code.NOT_FOUND, 8 * KiB]
    assert (dst[: 48 * KiB] == 0xEE).all()  # a smaller, a larger value region and an absent key: untouched
    assert np.array_equal(dst[48 * KiB : 56 * KiB], src[: 8 * KiB])


def test_unregistered_memory_never_reaches_native_code(backend: MooncakeBackend) -> None:
    src = random_bytes(16 * KiB, seed=13)
    other = np.full(16 * KiB, 0xEE, np.uint8)  # real memory, never registered
    (key,) = unique_keys(1)
    with registered(backend, src) as s:
        assert backend.batch_put([key], [[s]], [[4 * KiB]]) == [Code.OK]
        assert (
            backend.read_from_replicas(
                [key, key], [[int(other.ctypes.data)], [s + 15 * KiB]], [[4 * KiB]] * 2
            )
            == [Code.INVALID] * 2
        )
        # No key was proven: neither the master nor a transfer engine was asked (none was even made).
        assert backend._replica_reader is None
    assert (other == 0xEE).all()


def test_bad_arguments_and_a_closed_backend_raise(
    mooncake_master: MooncakeMaster, mooncake_backend_factory: Factory
) -> None:
    backend = mooncake_backend_factory(mooncake_master.address)
    with pytest.raises(InvalidRequestError):
        backend.read_from_replicas(["a", "b"], [[1]], [[1]])
    with pytest.raises(TypeError):
        backend.read_from_replicas("ab", [[1], [2]], [[1], [1]])  # type: ignore[arg-type]
    assert backend.read_from_replicas([], [], []) == []
    backend.close()
    for call in (
        lambda: backend.read_from_replicas(["a"], [[1]], [[1]]),
        backend.health_check,
        lambda: backend.replica_endpoints(["a"]),
    ):
        with pytest.raises(BackendError, match="closed"):
            call()


def test_endpoints_and_health(backend: MooncakeBackend) -> None:
    src = random_bytes(8 * KiB, seed=14)
    present, absent = unique_keys(2)
    with registered(backend, src) as s:
        assert backend.batch_put([present], [[s]], [[4 * KiB]]) == [Code.OK]
    where = backend.replica_endpoints([present, absent])
    assert where[absent] == [] and len(where[present]) == 1
    assert where[present][0].startswith("127.0.0.1:")
    assert backend.health_check() == 0


def test_a_shared_metadata_server_is_refused_before_making_an_engine(
    backend: MooncakeBackend, monkeypatch: Any
) -> None:
    # A second engine would publish a segment under the store's own name there.
    shared = dataclasses.replace(backend.config, metadata_server="http://127.0.0.1:1/metadata")
    monkeypatch.setattr(backend, "config", shared)
    buf = np.zeros(4 * KiB, np.uint8)
    with registered(backend, buf) as b, pytest.raises(BackendError, match="P2PHANDSHAKE"):
        backend.read_from_replicas(["k"], [[b]], [[4 * KiB]])
    assert backend._replica_reader is None


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("10.0.0.1", "10.0.0.1"),
        ("10.0.0.1:12345", "10.0.0.1"),
        ("node-a:80", "node-a"),
        ("fe80::1", "fe80::1"),
    ],
)
def test_engine_hostname_drops_only_a_port(given: str, expected: str) -> None:
    assert engine_hostname(given) == expected
