"""What Mooncake 0.3.13's own SSD offload does for aiokv, against a real master and client.

Measured (``python -m benchmarks.mooncake_persistence``, docs/benchmarks.md): with the master's
``--enable_offload=true`` and the client's ``setup(..., enable_ssd_offload=True, ssd_offload_path=DIR)``
setup succeeds, but a value evicted from the memory segment answers -704 (not found) instead of being
read back from the disk. This pins that: if a Mooncake upgrade makes evicted values come back, this test
fails, and docs/backends.md ("Mooncake's own persistence") should be revisited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.mooncake_persistence import (
    MASTER_OFFLOAD_ARGS,
    STORE_FULL,
    connect,
    get,
    offload_env,
    put,
    values,
)
from tests.mooncake_support import unique_keys

VALUE = 2 << 20
SEGMENT = 32 << 20
NOT_FOUND = -704


def test_ssd_offload_does_not_bring_evicted_values_back(
    mooncake_master_factory: Callable[..., Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    master = mooncake_master_factory(extra_args=MASTER_OFFLOAD_ARGS)
    for name, value in offload_env(str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    store = connect(master.address, SEGMENT, str(tmp_path))  # setup answers 0 with offload on
    try:
        hot = values(4, VALUE, seed=3)
        keys = unique_keys(4, "offload")
        store.register_buffer(int(hot.ctypes.data), hot.nbytes)
        assert put(store, keys, hot, VALUE, 4) == [0] * 4
        out = values(4, VALUE, seed=4)
        assert get(store, keys, out, VALUE, 4) == [VALUE] * 4
        assert (out == hot).all()
        time.sleep(2.5)  # offload heartbeats (1 s) have had their turn
        # Three segments' worth of other values: the first ones are evicted from memory.
        filler = unique_keys(3 * SEGMENT // VALUE, "fill")
        deadline = time.monotonic() + 15
        for start in range(0, len(filler), 4):
            part = filler[start : start + 4]
            while part and time.monotonic() < deadline:
                codes = put(store, part, hot, VALUE, 4)
                part = [key for key, code in zip(part, codes, strict=True) if code == STORE_FULL]
                if part:
                    time.sleep(0.05)
        assert get(store, keys, out, VALUE, 4) == [NOT_FOUND] * 4
        store.unregister_buffer(int(hot.ctypes.data))
    finally:
        store.close()
