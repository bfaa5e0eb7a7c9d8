"""``python -m benchmarks.disk`` on a small scale: every figure present and every loaded byte checked,
the memory level's gets after a restart, and the restart scan's count."""

from __future__ import annotations

from pathlib import Path

from benchmarks import disk


def test_the_disk_benchmark_measures_the_backend_the_memory_level_and_dd(tmp_path: Path) -> None:
    results = disk.run(str(tmp_path), total_bytes=2 << 20, value_bytes=1 << 20, regions=16, keys_per_call=1)
    for figures in (*results["backend"].values(), results["memory_level"]):
        assert figures["loaded_bytes_checked"] is True
        assert figures["put_gbps"] > 0 and figures["get_gbps"] > 0
    assert results["memory_level"]["get2_gbps"] > 0  # the second get, from memory
    assert results["dd"]
    assert not list(tmp_path.iterdir())  # its work directory removed


def test_the_restart_scan_finds_every_value(tmp_path: Path) -> None:
    results = disk.restart_scan(str(tmp_path), 40, keys_per_call=16)
    assert results["found"] == 40 and results["open_s"] >= 0
    assert not list(tmp_path.iterdir())
