"""MooncakeBackend attached to Mooncake's client service (``mooncake_client``) through shared memory,
against the real service and master (no mocks): values staged through the shared buffer arrive whole
and where the caller's regions say, the answers are the multi-buffer form's, and a TCP client of the
same store reads what the attached one wrote (and the other way round).

Run inside a private network namespace, like every Mooncake test (tests/test_mooncake_backend.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiokv import Code
from aiokv.backends.mooncake import MooncakeBackend, MooncakeConfig
from aiokv.backends.mooncake_master import MooncakeMaster, client_service, free_ports
from aiokv.errors import BackendError, BackendUnavailableError

from .mooncake_support import CONFIG_BASE, WILD, random_bytes, registered, require_mooncake, unique_keys

pytestmark = pytest.mark.mooncake

MiB = 1 << 20
BASE = CONFIG_BASE


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[MooncakeMaster, str]]:
    """A master of this module's own and a client service holding its only segment."""
    require_mooncake()
    with MooncakeMaster() as master, client_service(master.address, "256MiB") as service:
        yield master, service


@pytest.fixture(scope="module")
def attached(store: tuple[MooncakeMaster, str]) -> Iterator[MooncakeBackend]:
    """A client attached to the service, with 16 MiB of staging (two lanes of 8 MiB)."""
    master, service = store
    backend = MooncakeBackend.from_master(
        master.address, global_segment_size=0, client_service=service, local_buffer_size=16 * MiB
    )
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture(scope="module")
def tcp_client(store: tuple[MooncakeMaster, str]) -> Iterator[MooncakeBackend]:
    """A pure client of the same store over TCP (as vLLM's connector is)."""
    backend = MooncakeBackend.from_master(store[0].address, global_segment_size=0)
    try:
        yield backend
    finally:
        backend.close()


def _scattered(base: int, keys: int, regions: int, size: int, seed: int) -> list[list[int]]:
    """Per key ``regions`` addresses of ``size`` bytes, in an order that is not the keys' order."""
    order = np.random.default_rng(seed).permutation(keys * regions).reshape(keys, regions)
    return [[base + int(slot) * size for slot in row] for row in order]


def _read(array: np.ndarray[Any, Any], base: int, addrs: list[list[int]], size: int) -> list[bytes]:
    return [b"".join(array[a - base : a - base + size].tobytes() for a in row) for row in addrs]


def test_values_put_and_got_through_the_service_land_in_the_callers_regions(
    attached: MooncakeBackend, tcp_client: MooncakeBackend
) -> None:
    keys, regions, size = 24, 6, 64 << 10
    source = random_bytes(keys * regions * size, seed=1)
    target = np.zeros_like(source)
    other = np.zeros_like(source)
    names = unique_keys(keys)
    with registered(attached, source) as src, registered(attached, target) as dst:
        put_addrs = _scattered(src, keys, regions, size, seed=2)
        sizes = [[size] * regions for _ in range(keys)]
        assert attached.batch_put(names, put_addrs, sizes) == [0] * keys
        get_addrs = _scattered(dst, keys, regions, size, seed=3)
        assert attached.batch_get(names, get_addrs, sizes) == [regions * size] * keys
        assert _read(target, dst, get_addrs, size) == _read(source, src, put_addrs, size)
        # A TCP client of the same store reads the same values.
        with registered(tcp_client, other) as tcp_dst:
            tcp_addrs = _scattered(tcp_dst, keys, regions, size, seed=4)
            assert tcp_client.batch_get(names, tcp_addrs, sizes) == [regions * size] * keys
            assert _read(other, tcp_dst, tcp_addrs, size) == _read(source, src, put_addrs, size)


def test_a_value_a_tcp_client_wrote_is_read_through_the_service(
    attached: MooncakeBackend, tcp_client: MooncakeBackend
) -> None:
    source = random_bytes(4 * MiB, seed=5)
    target = np.zeros_like(source)
    names = unique_keys(4)
    with registered(tcp_client, source) as src, registered(attached, target) as dst:
        assert tcp_client.batch_put(names, [[src + k * MiB] for k in range(4)], [[MiB]] * 4) == [0] * 4
        # Read back in reverse order into two regions a key.
        addrs = [[dst + (3 - k) * MiB + MiB // 2, dst + (3 - k) * MiB] for k in range(4)]
        assert attached.batch_get(names, addrs, [[MiB // 2, MiB // 2]] * 4) == [MiB] * 4
        for k in range(4):
            got = (
                target[(3 - k) * MiB + MiB // 2 : (4 - k) * MiB].tobytes()
                + target[(3 - k) * MiB : (3 - k) * MiB + MiB // 2].tobytes()
            )
            assert got == source[k * MiB : (k + 1) * MiB].tobytes()


def test_a_batch_larger_than_a_lane_moves_in_pieces(attached: MooncakeBackend) -> None:
    # 20 values of 1 MiB through lanes of 8 MiB: three pieces each way.
    source = random_bytes(20 * MiB, seed=6)
    target = np.zeros_like(source)
    names = unique_keys(20)
    with registered(attached, source) as src, registered(attached, target) as dst:
        assert attached.batch_put(names, [[src + k * MiB] for k in range(20)], [[MiB]] * 20) == [0] * 20
        assert attached.batch_get(names, [[dst + k * MiB] for k in range(20)], [[MiB]] * 20) == [MiB] * 20
    assert target.tobytes() == source.tobytes()


def test_a_value_larger_than_a_lane_is_refused_and_the_rest_of_its_batch_moves(
    attached: MooncakeBackend,
) -> None:
    source = random_bytes(10 * MiB, seed=7)
    names = unique_keys(2)
    with registered(attached, source) as src:
        codes = attached.batch_put(names, [[src], [src + 9 * MiB]], [[9 * MiB], [MiB]])
        assert codes == [int(Code.INVALID), 0]
        assert attached.batch_exists(names) == [False, True]


def test_regions_outside_registered_memory_are_refused_before_any_copy(attached: MooncakeBackend) -> None:
    source = random_bytes(MiB, seed=8)
    names = unique_keys(2)
    with registered(attached, source) as src:
        codes = attached.batch_put(names, [[WILD], [src]], [[4096], [4096]])
        assert codes == [int(Code.INVALID), 0]
        assert attached.batch_get(names[1:], [[WILD]], [[4096]]) == [int(Code.INVALID)]
        # One byte past the end of the registered buffer.
        assert attached.batch_get(names[1:], [[src + MiB - 4095]], [[4096]]) == [int(Code.INVALID)]


def test_answers_match_the_multi_buffer_form(attached: MooncakeBackend) -> None:
    source = random_bytes(MiB, seed=9)
    target = np.zeros(2 * MiB, dtype=np.uint8)
    (name,) = unique_keys(1)
    with registered(attached, source) as src, registered(attached, target) as dst:
        # A key given twice in one put keeps its first value.
        assert attached.batch_put([name, name], [[src], [src + 4096]], [[4096], [4096]]) == [0, 0]
        # Given twice in one get, both regions are filled.
        assert attached.batch_get([name, name], [[dst], [dst + 8192]], [[4096], [4096]]) == [4096, 4096]
        assert target[:4096].tobytes() == source[:4096].tobytes()
        assert target[8192 : 8192 + 4096].tobytes() == source[:4096].tobytes()
        # Regions larger than the value: -800; smaller: -600; a missing key: -704.
        assert attached.batch_get([name], [[dst]], [[8192]]) == [int(Code.TRANSFER_FAILED)]
        assert attached.batch_get([name], [[dst]], [[1024]]) == [int(Code.INVALID)]
        assert attached.batch_get(unique_keys(1), [[dst]], [[4096]]) == [int(Code.NOT_FOUND)]


def test_concurrent_transfers_share_the_lanes_without_mixing_bytes(attached: MooncakeBackend) -> None:
    threads, keys = 6, 6
    source = random_bytes(threads * keys * MiB, seed=10)
    target = np.zeros_like(source)
    names = [unique_keys(keys) for _ in range(threads)]
    failures: list[BaseException] = []
    with registered(attached, source) as src, registered(attached, target) as dst:

        def move(t: int) -> None:
            try:
                offsets = [(t * keys + k) * MiB for k in range(keys)]
                assert (
                    attached.batch_put(names[t], [[src + o] for o in offsets], [[MiB]] * keys) == [0] * keys
                )
                assert (
                    attached.batch_get(names[t], [[dst + o] for o in offsets], [[MiB]] * keys) == [MiB] * keys
                )
            except BaseException as exc:  # reported below, from the test's thread
                failures.append(exc)

        workers = [threading.Thread(target=move, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
    assert not failures, failures
    assert target.tobytes() == source.tobytes()


class _ShortAnswers:
    """The real store, with one answer too few from its batch get (a malfunction the service cannot be
    made to show)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_get_into(self, *args: Any) -> list[int]:
        return list(self._store.batch_get_into(*args))[:-1]


def test_a_get_answered_with_too_few_codes_raises_and_keeps_its_lane(
    attached: MooncakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = random_bytes(2 * MiB, seed=21)
    target = np.zeros(2 * MiB, dtype=np.uint8)
    with registered(attached, source) as src, registered(attached, target) as dst:
        names = unique_keys(2)
        assert attached.batch_put(names, [[src], [src + MiB]], [[MiB], [MiB]]) == [0, 0]
        monkeypatch.setattr(attached, "_store", _ShortAnswers(attached._store))
        with pytest.raises(BackendError, match="answered 1 codes for 2 keys"):
            attached.batch_get(names, [[dst], [dst + MiB]], [[MiB], [MiB]])
        assert not target.any(), "a refused answer scattered bytes"
        monkeypatch.undo()
        assert attached._staging is not None and attached._staging.live_lanes == 2
        assert attached.batch_get(names, [[dst], [dst + MiB]], [[MiB], [MiB]]) == [MiB, MiB]
        assert target.tobytes() == source.tobytes()


def test_attaching_to_no_service_raises_naming_it(store: tuple[MooncakeMaster, str]) -> None:
    (port,) = free_ports(1)
    with pytest.raises(BackendUnavailableError, match=f"127.0.0.1:{port}"):
        MooncakeBackend.from_master(
            store[0].address, global_segment_size=0, client_service=f"127.0.0.1:{port}"
        )


# -- configuration (no store needed) ---------------------------------------------------------------


def test_a_client_of_a_service_mounts_nothing() -> None:
    assert MooncakeConfig.from_dict({**BASE, "client_service": "127.0.0.1:50052"}).global_segment_size == 0
    with pytest.raises(ValueError, match="mounts no memory"):
        MooncakeConfig.from_dict({**BASE, "client_service": "127.0.0.1:50052", "global_segment_size": "1GB"})


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:", ":50052", "127.0.0.1:70000", "host:port"])
def test_a_service_address_must_be_host_and_port(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        MooncakeConfig.from_dict({**BASE, "client_service": address})


def test_a_services_staging_buffer_has_a_floor() -> None:
    with pytest.raises(ValueError, match="staging"):
        MooncakeConfig.from_dict({**BASE, "client_service": "127.0.0.1:50052", "local_buffer_size": "1MB"})


def test_a_killed_service_fails_calls_as_unavailable_retires_their_lanes_and_the_client_closes(
    store: tuple[MooncakeMaster, str],
) -> None:
    import signal
    import subprocess

    master = store[0]
    with client_service(master.address, 0) as service:  # killed: it must leave no segment listed
        backend = MooncakeBackend.from_master(
            master.address, global_segment_size=0, client_service=service, local_buffer_size=16 * MiB
        )
        source = random_bytes(MiB, seed=11)
        with registered(backend, source) as src:
            names = unique_keys(1)
            assert backend.batch_put(names, [[src]], [[MiB]]) == [0]
            port = service.rpartition(":")[2]
            pids = subprocess.run(
                ["pgrep", "-f", "--", f"mooncake_client.*--port={port}"], capture_output=True, text=True
            ).stdout
            assert pids.split(), f"no mooncake_client process on port {port}"
            for pid in pids.split():
                os.kill(int(pid), signal.SIGKILL)
            with pytest.raises(BackendUnavailableError, match=f"client service {service}"):
                backend.batch_exists(names)
            # Each failed call retires the staging lane it held (the service could still have used
            # it had it been alive but slow); with none left a call is refused before any RPC.
            for left in (1, 0):
                with pytest.raises(BackendUnavailableError, match=f"client service {service}"):
                    backend.batch_get(names, [[src]], [[MiB]])
                assert backend._staging is not None and backend._staging.live_lanes == left
            with pytest.raises(BackendUnavailableError, match="every staging lane was retired"):
                backend.batch_put(names, [[src]], [[MiB]])
        backend.close()
        assert backend.closed
