"""MooncakeBackend against a real mooncake_master (no mocks), plus its configuration and imports.

Tests that need the store skip (fail under CI) outside a private network namespace; run them with
    unshare -rn sh -c 'ip link set lo up && python -m pytest tests/test_mooncake_backend.py'
The config and import tests run anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from aiokv import Code
from aiokv.backends.mooncake import MooncakeBackend, MooncakeConfig, parse_size
from aiokv.backends.mooncake_binding import import_hint
from aiokv.backends.mooncake_calls import CallForm, call_form, prove
from aiokv.backends.mooncake_master import MooncakeMaster, free_ports, segment_holder
from aiokv.errors import BackendError, BackendUnavailableError, InvalidRequestError

from .mooncake_support import CONFIG_BASE, WILD, random_bytes, registered, require_mooncake, unique_keys

MiB = 1 << 20
BASE = CONFIG_BASE


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


# -- imports ------------------------------------------------------------------------------------


def test_import_aiokv_never_imports_mooncake() -> None:
    result = _run_python(
        "import sys, aiokv, aiokv.backends.mooncake, aiokv.backends.mooncake_master\n"
        "assert aiokv.MooncakeBackend is aiokv.backends.mooncake.MooncakeBackend\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mooncake'))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_missing_mooncake_package_says_what_to_install() -> None:
    result = _run_python(
        "import sys\n"
        "sys.modules['mooncake'] = None  # as if the package were not installed\n"
        "from aiokv import MooncakeBackend\n"
        "try:\n"
        "    MooncakeBackend.from_master('127.0.0.1:1')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'aiokv[mooncake-cpu]'" in result.stdout
    assert "mooncake-gpu" in result.stdout


def test_missing_libibverbs_says_what_to_install() -> None:
    error = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    assert "apt-get install libibverbs1" in import_hint(error)


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        ("1048576", MiB),
        ("512MB", 512 * MiB),
        ("512mb", 512 * MiB),
        ("4GiB", 4 << 30),
        ("1.5 GB", 3 << 29),
        ("64 KiB", 64 << 10),
        ("2g", 2 << 30),
        ("100B", 100),
        (" 16M ", 16 * MiB),
    ],
)
def test_size_strings(text: object, expected: int) -> None:
    assert parse_size(text, "local_buffer_size") == expected


@pytest.mark.parametrize(
    ("value", "error"),
    [("12 parsecs", ValueError), ("MB", ValueError), ("-1MB", ValueError), (-5, ValueError),
     ("0.3B", ValueError), (1.5e9, TypeError), (True, TypeError), (None, TypeError)],
)  # fmt: skip
def test_bad_sizes_name_the_key(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="local_buffer_size"):
        MooncakeConfig.from_dict({**BASE, "local_buffer_size": value})


def test_config_from_dict() -> None:
    config = MooncakeConfig.from_dict(
        {**BASE, "protocol": "TCP", "device_name": None, "global_segment_size": "1GB", "local_buffer_size": 0,
         "replica_num": 2, "preferred_segments": ["a:1", "b:2"], "prefer_alloc_in_same_node": True}
    )  # fmt: skip
    assert config.protocol == "tcp"  # Mooncake matches protocol names in lower case
    assert config.device_name == ""
    assert (config.global_segment_size, config.local_buffer_size) == (1 << 30, 0)
    assert config.replica_num == 2
    assert config.preferred_segments == ("a:1", "b:2")
    assert config.prefer_alloc_in_same_node is True
    assert MooncakeConfig.load(config) is config


def test_config_defaults_are_mooncakes() -> None:
    config = MooncakeConfig.from_dict(BASE)
    assert (config.protocol, config.device_name, config.replica_num) == ("tcp", "", 1)
    assert config.global_segment_size == 3355443200
    assert config.local_buffer_size == 1 << 30


def test_unknown_key_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="replicas_num"):
        MooncakeConfig.from_dict({**BASE, "replicas_num": 2})


def test_missing_required_key_is_named() -> None:
    config = dict(BASE)
    del config["master_server_address"]
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeConfig.from_dict(config)


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("master_server_address", "", ValueError),
        ("local_hostname", 5, TypeError),
        ("metadata_server", "  ", ValueError),
        ("protocol", "", ValueError),
        ("device_name", 0, TypeError),
        ("global_segment_size", "1MB", ValueError),  # under Mooncake's 16 MiB minimum
        ("replica_num", 0, ValueError),
        ("replica_num", "2", TypeError),
        ("replica_num", True, TypeError),
        ("preferred_segment", 3, TypeError),
        ("preferred_segments", "a:1", TypeError),
        ("preferred_segments", ["a:1", ""], ValueError),
        ("prefer_alloc_in_same_node", "yes", TypeError),
        ("with_hard_pin", 1, TypeError),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=key):
        MooncakeConfig.from_dict({**BASE, key: value})


def test_backend_refuses_a_bad_config_before_connecting() -> None:
    with pytest.raises(ValueError, match="bogus"):
        MooncakeBackend({**BASE, "bogus": 1})


def test_config_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**BASE, "global_segment_size": "3GB", "local_buffer_size": 1 << 20}))
    config = MooncakeConfig.load(str(path))
    assert config.global_segment_size == 3 << 30
    assert MooncakeConfig.load(path) == config

    path.write_text(json.dumps({**BASE, "replica_num": -1}))
    with pytest.raises(ValueError, match=r"mooncake\.json.*replica_num"):
        MooncakeConfig.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        MooncakeConfig.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match="JSON object"):
        MooncakeConfig.load(path)
    with pytest.raises(FileNotFoundError):
        MooncakeConfig.load(tmp_path / "absent.json")


def test_config_from_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**BASE, "master_server_address": "10.0.0.1:50051"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    assert MooncakeConfig.load(None).master_server_address == "10.0.0.1:50051"
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    with pytest.raises(ValueError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeConfig.load(None)
    with pytest.raises(TypeError, match="dict"):
        MooncakeConfig.load(42)  # type: ignore[arg-type]


# -- the master ---------------------------------------------------------------------------------


def test_master_serves_metrics_stops_by_pid_and_restarts(
    mooncake_master_factory: Callable[..., MooncakeMaster],
) -> None:
    master = mooncake_master_factory()
    assert master.address.startswith("127.0.0.1:")
    with urllib.request.urlopen(master.metrics_url, timeout=5) as response:
        assert response.status == 200
        assert "master" in response.read().decode()
    pid, log = master.pid, master.log_path
    assert pid is not None and log is not None and log.exists()
    master.stop()
    assert not master.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie
    assert not log.exists()
    address = master.address
    master.start()  # a restart keeps its ports, so clients can reconnect
    assert master.running and master.address == address and master.pid != pid


# -- data path against the session master -------------------------------------------------------


def test_round_trip_two_dimensional_arrays(mooncake_backend: MooncakeBackend) -> None:
    """Scattered regions of unequal sizes, read back into a different scattering."""
    keys_n, regions, slot = 8, 12, 4096
    region_sizes = np.random.default_rng(1).integers(1, slot, regions) // 8 * 8 + 8
    src, dst = random_bytes(keys_n * regions * slot, seed=2), np.zeros(keys_n * regions * slot, np.uint8)
    keys = unique_keys(keys_n)
    with registered(mooncake_backend, src) as src_addr, registered(mooncake_backend, dst) as dst_addr:
        put_slots = np.random.default_rng(3).permutation(keys_n * regions).reshape(keys_n, regions)
        get_slots = np.random.default_rng(4).permutation(keys_n * regions).reshape(keys_n, regions)
        sizes = np.broadcast_to(region_sizes, (keys_n, regions))  # read-only, stride 0, as the worker passes
        assert sizes.strides[0] == 0
        assert mooncake_backend.batch_put(keys, src_addr + put_slots * slot, sizes) == [Code.OK] * keys_n
        total = int(region_sizes.sum())
        assert mooncake_backend.batch_get(keys, dst_addr + get_slots * slot, sizes) == [total] * keys_n
    for k in range(keys_n):
        for r in range(regions):
            n = int(region_sizes[r])
            put_at, get_at = int(put_slots[k, r]) * slot, int(get_slots[k, r]) * slot
            assert np.array_equal(dst[get_at : get_at + n], src[put_at : put_at + n]), (k, r)


def test_round_trip_lists_of_lists_ragged(mooncake_backend: MooncakeBackend) -> None:
    src, dst = random_bytes(MiB, seed=5), np.zeros(MiB, np.uint8)
    keys = unique_keys(3)
    with registered(mooncake_backend, src) as s, registered(mooncake_backend, dst) as d:
        put_addrs = [[s], [s + 1000, s + 5000], [s + 9000, s + 20000, s + 30000]]
        sizes = [[100], [64, 300], [1, 2, 4096]]
        assert mooncake_backend.batch_put(keys, put_addrs, sizes) == [Code.OK] * 3
        # Same totals, split differently on the way back: Mooncake only needs the totals to match.
        get_addrs = [[d + 100], [d + 2000], [d + 40000, d + 50000]]
        get_sizes = [[100], [364], [3, 4096]]
        assert mooncake_backend.batch_get(keys, get_addrs, get_sizes) == [100, 364, 4099]
    expected = np.concatenate([src[9000:9001], src[20000:20002], src[30000:34096]])
    assert np.array_equal(np.concatenate([dst[40000:40003], dst[50000:54096]]), expected)
    assert np.array_equal(dst[2000:2364], np.concatenate([src[1000:1064], src[5000:5300]]))
    assert np.array_equal(dst[100:200], src[0:100])


def test_exists_missing_key_and_size_mismatch(mooncake_backend: MooncakeBackend) -> None:
    buf = random_bytes(64 << 10, seed=6)
    present, absent = unique_keys(2)
    with registered(mooncake_backend, buf) as a:
        assert mooncake_backend.batch_exists([present, absent]) == [False, False]
        assert mooncake_backend.batch_put([present], [[a]], [[4096]]) == [Code.OK]
        assert mooncake_backend.batch_exists([absent, present]) == [False, True]
        codes = mooncake_backend.batch_get([present, absent, present], [[a + 8192]] * 3, [[4096]] * 3)
        assert codes == [4096, Code.NOT_FOUND, 4096]
        # Mooncake's own codes pass through: regions smaller (-600) or larger (-800) than the value.
        assert mooncake_backend.batch_get([present], [[a + 8192]], [[4000]]) == [Code.INVALID]
        assert mooncake_backend.batch_get([present], [[a + 8192]], [[5000]]) == [Code.TRANSFER_FAILED]


def test_existing_key_keeps_its_old_value(mooncake_backend: MooncakeBackend) -> None:
    buf = random_bytes(3 * 4096, seed=7)
    (key,) = unique_keys(1)
    with registered(mooncake_backend, buf) as a:
        assert mooncake_backend.batch_put([key], [[a]], [[4096]]) == [Code.OK]
        assert mooncake_backend.batch_put([key], [[a + 4096]], [[4096]]) == [Code.OK]  # reports success...
        assert mooncake_backend.batch_get([key], [[a + 8192]], [[4096]]) == [4096]
    assert np.array_equal(buf[8192:], buf[:4096])  # ...but the first value stays


def test_regions_outside_registered_memory_never_reach_mooncake(mooncake_backend: MooncakeBackend) -> None:
    """A wild pointer would SIGSEGV the process inside Mooncake: surviving this test is the check."""
    buf = random_bytes(64 << 10, seed=8)
    good, wild, past_end, no_regions, unregistered = unique_keys(5)
    keys = [good, wild, past_end, no_regions, unregistered]
    other = np.zeros(4096, np.uint8)  # real memory, but never registered
    with registered(mooncake_backend, buf) as a:
        addrs = [[a], [a, WILD], [a + (64 << 10) - 100], [], [int(other.ctypes.data)]]
        sizes = [[4096], [16, 16], [4096], [], [16]]
        assert mooncake_backend.batch_put(keys, addrs, sizes) == [
            Code.OK,
            Code.INVALID,
            Code.INVALID,
            Code.INVALID,
            Code.INVALID,
        ]
        assert mooncake_backend.batch_exists(keys) == [True, False, False, False, False]
        # A batch with no valid key at all makes no native call.
        assert (
            mooncake_backend.batch_get([good, good], [[WILD], [a - 4096]], [[4096], [4096]])
            == [Code.INVALID] * 2
        )
        assert mooncake_backend.batch_get([good], [[a]], [[0]]) == [Code.INVALID]
        assert mooncake_backend.batch_get([good], [[a + 4096]], [[4096]]) == [4096]
    # Unregistered now: the same address is refused.
    assert mooncake_backend.batch_get([good], [[a]], [[4096]]) == [Code.INVALID]
    assert np.array_equal(buf[4096:8192], buf[:4096])


def test_invalid_rows_of_a_two_dimensional_batch_are_left_out(mooncake_backend: MooncakeBackend) -> None:
    """The 2-D path with a subset of rows, and rows whose sizes differ."""
    src, dst = random_bytes(64 << 10, seed=12), np.zeros(64 << 10, np.uint8)
    keys = unique_keys(4)
    with registered(mooncake_backend, src) as s, registered(mooncake_backend, dst) as d:
        offsets = np.array([[0, 4096], [8192, 12288], [16384, 20480], [24576, 28672]])
        sizes = np.array([[100, 200], [300, 400], [500, 600], [700, 800]])
        addrs = s + offsets
        addrs[1, 1] = WILD
        assert mooncake_backend.batch_put(keys, addrs, sizes) == [Code.OK, Code.INVALID, Code.OK, Code.OK]
        assert mooncake_backend.batch_exists(keys) == [True, False, True, True]
        get_addrs = d + offsets
        get_addrs[2, 0] = s - 8192  # not registered: -600, the rest still read
        assert mooncake_backend.batch_get(keys, get_addrs, sizes) == [300, Code.NOT_FOUND, Code.INVALID, 1500]
    for k in (0, 3):
        for r in range(2):
            at, n = int(offsets[k, r]), int(sizes[k, r])
            assert np.array_equal(dst[at : at + n], src[at : at + n])
    assert not dst[16384:24576].any()


def test_bad_arguments_are_refused_before_mooncake(mooncake_backend: MooncakeBackend) -> None:
    with pytest.raises(InvalidRequestError):
        mooncake_backend.batch_exists(["ok", ""])
    with pytest.raises(TypeError):
        mooncake_backend.batch_exists("one-string")
    with pytest.raises(InvalidRequestError):
        mooncake_backend.batch_put(["a", "b"], [[1]], [[1]])  # one row for two keys
    with pytest.raises(TypeError):
        mooncake_backend.batch_get(["a"], [[1.5]], [[8]])
    assert mooncake_backend.batch_exists([]) == []
    assert mooncake_backend.batch_put([], [], []) == []
    assert mooncake_backend.batch_get([], np.empty((0, 4), np.int64), np.empty((0, 4), np.int64)) == []
    buf = np.zeros(8192, np.uint8)
    with registered(mooncake_backend, buf) as a, pytest.raises(InvalidRequestError, match="overlaps"):
        mooncake_backend.register_buffer(a + 4096, 8192)
    with pytest.raises(InvalidRequestError):
        mooncake_backend.unregister_buffer(a)  # no longer registered


def test_concurrent_calls_from_threads(mooncake_backend: MooncakeBackend) -> None:
    threads_n, keys_n, size = 4, 16, 2048
    src = random_bytes(threads_n * keys_n * size, seed=9)
    dst = np.zeros_like(src)
    errors: list[BaseException] = []

    def work(t: int, src_addr: int, dst_addr: int) -> None:
        try:
            keys = unique_keys(keys_n, prefix=f"thread{t}")
            offsets = (t * keys_n + np.arange(keys_n)).reshape(keys_n, 1) * size
            sizes = np.full((keys_n, 1), size)
            for _ in range(5):
                assert mooncake_backend.batch_put(keys, src_addr + offsets, sizes) == [Code.OK] * keys_n
                assert mooncake_backend.batch_exists(keys) == [True] * keys_n
                assert mooncake_backend.batch_get(keys, dst_addr + offsets, sizes) == [size] * keys_n
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with registered(mooncake_backend, src) as s, registered(mooncake_backend, dst) as d:
        threads = [threading.Thread(target=work, args=(t, s, d)) for t in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert not errors, errors
    assert np.array_equal(src, dst)


def test_large_batch_into_another_process_segment(
    mooncake_master_factory: Callable[..., MooncakeMaster],
    mooncake_backend_factory: Callable[..., MooncakeBackend],
) -> None:
    """16K slices to one peer over TCP: stalls 60 s and fails -800 unless the queue limits are raised."""
    master = mooncake_master_factory()  # its own: the other process's segment is the only one
    with segment_holder(master.address, graceful=True) as holder:
        backend = mooncake_backend_factory(master.address, global_segment_size=0)  # stores nothing itself
        keys_n, regions, size = 64, 256, 1024
        src = random_bytes(keys_n * regions * size, seed=13)
        dst = np.zeros_like(src)
        offsets = np.arange(keys_n * regions).reshape(keys_n, regions) * size
        sizes = np.broadcast_to(np.int64(size), (keys_n, regions))
        keys = unique_keys(keys_n)
        with registered(backend, src) as s, registered(backend, dst) as d:
            # Without the raised queue limits these stall 60 s and answer -800 (TRANSFER_FAILED).
            assert backend.batch_put(keys, s + offsets, sizes) == [Code.OK] * keys_n
            assert backend.batch_get(keys, d + offsets, sizes) == [regions * size] * keys_n
        assert np.array_equal(src, dst)
    assert holder.returncode == 0


# -- call forms: flat lists when every key has one region (aiokv.backends.mooncake_calls) ---------


class _RecordingStore:
    """The real store, recording the name of every transfer method the backend calls on it."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.called: list[str] = []

    def __getattr__(self, name: str) -> object:
        if name.startswith(("batch_put", "batch_get_into")):
            self.called.append(name)
        return getattr(self._store, name)


def _record_calls(backend: MooncakeBackend) -> _RecordingStore:
    recorder = _RecordingStore(backend._store)
    backend._store = recorder
    return recorder


def _forms(backend: MooncakeBackend, op: str, keys: list[str], addrs: list[int], sizes: list[int]):  # type: ignore[no-untyped-def]
    """Both call forms of a one-region-per-key batch, after the backend's own proof."""
    batch = prove(backend._memory, op, keys, [[a] for a in addrs], [[n] for n in sizes])
    assert batch.subset is None, "every region must be proven for this comparison"
    flat = call_form(batch, op, prefer_same_node=False)
    multi = CallForm(False, *batch.region_lists())
    assert flat.flat and flat.addrs == addrs and flat.sizes == sizes and multi.addrs == [[a] for a in addrs]
    return batch.keys, flat, multi


def test_both_call_forms_answer_alike(mooncake_backend: MooncakeBackend) -> None:
    """The flat and the multi-buffer calls, on the real store: same codes for every case the worker
    meets (once the flat get's answer for a too-large region is mapped), same bytes."""
    src, dst = random_bytes(64 << 10, seed=21), np.zeros(64 << 10, np.uint8)
    flat_keys, multi_keys = unique_keys(3, "flat"), unique_keys(3, "multi")
    sizes = [4096, 1000, 8]
    replicate = mooncake_backend._replicate
    with (
        registered(mooncake_backend, src) as s,
        registered(mooncake_backend, dst) as d,
        mooncake_backend._native() as store,
    ):
        put_at = [s, s + 8192, s + 16384]
        keys, flat, _ = _forms(mooncake_backend, "put", flat_keys, put_at, sizes)
        assert list(flat.put(store, keys, replicate)) == [Code.OK] * 3
        keys, _, multi = _forms(mooncake_backend, "put", multi_keys, put_at, sizes)
        assert list(multi.put(store, keys, replicate)) == [Code.OK] * 3
        for stored_by, half in ((flat_keys, 0), (multi_keys, 32 << 10)):
            get_at = [d + half + 20000, d + half + 4096, d + half]
            # Each stored form read back through each get form: the sizes, then the same bytes.
            for pick in (1, 2):
                dst[half : half + (32 << 10)] = 0
                keys, *forms = _forms(mooncake_backend, "get", stored_by, get_at, sizes)
                assert forms[pick - 1].get_answers(forms[pick - 1].get(store, keys, False)) == sizes
                for at, src_at, n in zip(get_at, put_at, sizes, strict=True):
                    assert np.array_equal(dst[at - d : at - d + n], src[src_at - s : src_at - s + n])
        present, (absent,) = flat_keys[0], unique_keys(1)
        cases = {
            "missing key": ([present, absent], [d, d + 8192], [4096, 4096], [4096, Code.NOT_FOUND]),
            "region smaller than the value": ([present], [d], [4000], [Code.INVALID]),
            "region larger than the value": ([present], [d], [5000], [Code.TRANSFER_FAILED]),
        }
        for case, (case_keys, at, case_sizes, expected) in cases.items():
            keys, flat, multi = _forms(mooncake_backend, "get", case_keys, at, case_sizes)
            assert multi.get_answers(multi.get(store, keys, False)) == expected, case
            assert flat.get_answers(flat.get(store, keys, False)) == expected, case


def test_one_region_per_key_takes_the_flat_calls(
    mooncake_master: MooncakeMaster, mooncake_backend_factory: Callable[..., MooncakeBackend]
) -> None:
    backend = mooncake_backend_factory(mooncake_master.address)
    calls = _record_calls(backend)
    src, dst = random_bytes(64 << 10, seed=22), np.zeros(64 << 10, np.uint8)
    keys = unique_keys(4)
    with registered(backend, src) as s, registered(backend, dst) as d:
        offsets = np.arange(4).reshape(4, 1) * 8192
        sizes = np.full((4, 1), 4096)
        assert backend.batch_put(keys, s + offsets, sizes) == [Code.OK] * 4
        get_addrs = d + offsets[::-1]
        get_addrs[1, 0] = WILD  # left out (-600), the rest still one flat call
        assert backend.batch_get(keys, get_addrs, sizes) == [4096, Code.INVALID, 4096, 4096]
        assert backend.batch_get(keys, [[d + 40000]] * 4, [[5000]] * 4) == [Code.TRANSFER_FAILED] * 4
        assert calls.called == ["batch_put_from", "batch_get_into", "batch_get_into"]
        for k in (0, 2, 3):
            assert np.array_equal(
                dst[(3 - k) * 8192 : (3 - k) * 8192 + 4096], src[k * 8192 : k * 8192 + 4096]
            )
        calls.called.clear()
        # Two regions for one key: the whole batch takes the multi-buffer calls.
        assert backend.batch_get(keys[:2], [[d], [d + 100, d + 8192]], [[4096], [100, 3996]]) == [4096] * 2
        # A key twice in one put: the multi-buffer form, whose first value wins as before.
        (twice,) = unique_keys(1)
        assert backend.batch_put([twice, twice], [[s], [s + 8192]], [[4096], [4096]]) == [Code.OK, Code.OK]
        assert backend.batch_get([twice], [[d + 50000]], [[4096]]) == [4096]
        assert np.array_equal(dst[50000:54096], src[:4096])
        assert calls.called == [
            "batch_get_into_multi_buffers",
            "batch_put_from_multi_buffers",
            "batch_get_into",
        ]


@pytest.mark.parametrize("regions_per_key", [1, 2], ids=["flat", "multi-buffer"])
def test_a_key_repeated_in_one_get_fills_every_region(
    mooncake_backend: MooncakeBackend, regions_per_key: int
) -> None:
    """Mooncake alone fills only the last region of a key given twice in one get and answers success for
    both; the backend makes one call per repetition instead."""
    src, dst = random_bytes(16 << 10, seed=24), np.zeros(64 << 10, np.uint8)
    a, b = unique_keys(2)
    split = [1000, 3096] if regions_per_key == 2 else [4096]
    with registered(mooncake_backend, src) as s, registered(mooncake_backend, dst) as d:
        assert mooncake_backend.batch_put([a, b], [[s], [s + 8192]], [[4096], [4096]]) == [Code.OK, Code.OK]
        keys = [a, b, a, a, b]
        addrs = [[d + i * 8192 + sum(split[:j]) for j in range(len(split))] for i in range(5)]
        assert mooncake_backend.batch_get(keys, addrs, [split] * 5) == [4096] * 5
    for i, key in enumerate(keys):
        at = 8192 * (key == b)
        assert np.array_equal(dst[i * 8192 : i * 8192 + 4096], src[at : at + 4096]), i


def test_prefer_alloc_in_same_node_keeps_the_multi_buffer_calls(
    mooncake_master: MooncakeMaster, mooncake_backend_factory: Callable[..., MooncakeBackend]
) -> None:
    """The flat put refuses this option (-600) and the flat get has no such argument."""
    backend = mooncake_backend_factory(mooncake_master.address, prefer_alloc_in_same_node=True)
    calls = _record_calls(backend)
    buf = random_bytes(3 * 4096, seed=23)
    (key,) = unique_keys(1)
    with registered(backend, buf) as a:
        assert backend.batch_put([key], [[a]], [[4096]]) == [Code.OK]
        assert backend.batch_get([key], [[a + 8192]], [[4096]]) == [4096]
    assert np.array_equal(buf[8192:], buf[:4096])
    assert calls.called == ["batch_put_from_multi_buffers", "batch_get_into_multi_buffers"]


# -- lifecycle and faults (backends and masters of their own) -----------------------------------


def test_close_is_safe_against_calls_in_flight_and_after(
    mooncake_master: MooncakeMaster, mooncake_backend_factory: Callable[..., MooncakeBackend]
) -> None:
    backend = mooncake_backend_factory(
        mooncake_master.address, replica_num=1, preferred_segments=[], with_hard_pin=False
    )
    buf = random_bytes(256 << 10, seed=10)
    addr = int(buf.ctypes.data)
    backend.register_buffer(addr, buf.nbytes)
    keys = unique_keys(32)
    addrs = addr + np.arange(32).reshape(32, 1) * 4096
    sizes = np.full((32, 1), 4096)
    assert backend.batch_put(keys, addrs, sizes) == [Code.OK] * 32
    outcomes: list[str] = []
    running = threading.Barrier(4)

    def hammer() -> None:
        running.wait()
        try:
            while True:
                backend.batch_get(keys, addrs + (128 << 10), sizes)
                backend.batch_exists(keys)
        except BackendError as exc:
            outcomes.append("closed" if "closed" in str(exc) else repr(exc))
        except BaseException as exc:
            outcomes.append(repr(exc))

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for thread in threads:
        thread.start()
    running.wait()
    time.sleep(0.2)  # let calls be in flight
    closers = [threading.Thread(target=backend.close) for _ in range(2)]  # concurrent closes
    for closer in closers:
        closer.start()
    for thread in [*closers, *threads]:
        thread.join(30)
    assert outcomes == ["closed"] * 3
    assert backend.closed
    backend.close()  # idempotent
    calls: list[Callable[[], object]] = [
        lambda: backend.batch_exists(keys),
        lambda: backend.batch_exists([]),
        lambda: backend.batch_put(keys, addrs, sizes),
        lambda: backend.batch_get(keys, addrs, sizes),
        lambda: backend.batch_get([], [], []),
        lambda: backend.batch_remove(keys),
        lambda: backend.register_buffer(addr + (512 << 10), 4096),
        lambda: backend.unregister_buffer(addr),
    ]
    for call in calls:
        with pytest.raises(BackendError, match="closed"):
            call()


def test_full_store_answers_no_space(
    mooncake_master_factory: Callable[..., MooncakeMaster],
    mooncake_backend_factory: Callable[..., MooncakeBackend],
) -> None:
    master = mooncake_master_factory()  # its own: only this client's 16 MiB segment is in the pool
    backend = mooncake_backend_factory(master.address, global_segment_size="16MiB")
    keys_n = 24
    buf = random_bytes(keys_n * MiB, seed=11)
    keys = unique_keys(keys_n)
    with registered(backend, buf) as a:
        codes = backend.batch_put(
            keys, a + np.arange(keys_n).reshape(keys_n, 1) * MiB, np.full((keys_n, 1), MiB)
        )
    assert set(codes) == {Code.OK, Code.NO_SPACE}, codes
    assert codes.count(Code.NO_SPACE) >= keys_n - 16


def test_master_killed_raises_unavailable_within_bounded_time(
    mooncake_master_factory: Callable[..., MooncakeMaster],
    mooncake_backend_factory: Callable[..., MooncakeBackend],
) -> None:
    master = mooncake_master_factory()
    # A pure client (no segment): its close does not wait on unmounting from the dead master.
    backend = mooncake_backend_factory(master.address, global_segment_size=0)
    buf = np.zeros(8192, np.uint8)
    keys = unique_keys(2)
    backend.register_buffer(int(buf.ctypes.data), buf.nbytes)
    assert backend.batch_exists(keys) == [False, False]
    master.kill()

    started = time.monotonic()
    with pytest.raises(BackendUnavailableError) as raised:
        backend.batch_exists(keys)
    assert time.monotonic() - started < 5
    assert raised.value.address == master.address
    assert master.address in str(raised.value)

    calls: list[Callable[[], object]] = [
        lambda: backend.batch_get(keys, [[int(buf.ctypes.data)]] * 2, [[64]] * 2),
        lambda: backend.batch_put(keys, [[int(buf.ctypes.data)]] * 2, [[64]] * 2),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError, match=master.address.replace(".", r"\.")):
            call()
        assert time.monotonic() - started < 15  # measured ~4.3 s
    started = time.monotonic()
    backend.close()
    assert time.monotonic() - started < 10


@pytest.mark.mooncake
def test_setup_without_a_master_fails_fast_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    require_mooncake()
    monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # else Mooncake retries for ~90 s
    address = f"127.0.0.1:{free_ports(1)[0]}"
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError) as raised:
        MooncakeBackend.from_master(address)
    assert time.monotonic() - started < 20  # measured ~4.4 s
    assert raised.value.address == address
    assert address in str(raised.value)
