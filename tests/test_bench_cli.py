"""Smoke tests of ``python -m benchmarks`` at tiny sizes: exit code, table, JSON, PNG, Mooncake.

The figures themselves are timings, so only their presence and sign are checked; what is checked
exactly is the structure, the parameters echoed back, and that bad bytes are caught.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokv.backends.base import Regions
from aiokv.backends.memory import MemoryBackend
from benchmarks import cli
from benchmarks.e2e import run_e2e_benchmark
from benchmarks.geometry import Geometry, choose_block_bytes, working_set_bytes

from .mooncake_support import require_mooncake

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--tokens", "2048", "--regions", "4", "--block-size", "16", "--chunk-tokens", "64",
        "--concurrency", "2", "--rounds", "1", "--block-bytes", "256"]  # fmt: skip
TABLE_MARKERS = (
    "1. prepare_values",
    "scalar reference",
    "vectorised baseline (lists)",
    "aiokv prepare_values, same lists",
    "2. loop lag and framework CPU",
    "baseline (thread per request)",
    "3. end to end on the",
    "worker/direct",
    "store x1",
    "load x2",
    "goals",
)


def _check_report(report: dict[str, Any], backend: str) -> None:
    assert set(report) >= {"machine", "versions", "parameters", "prepare", "loop_lag", "e2e", "goals"}
    assert report["machine"]["cpu_count"] >= 1
    assert report["machine"]["python"] and report["machine"]["platform"]
    assert report["versions"]["aiokv"] and report["versions"]["numpy"] == np.__version__
    params = report["parameters"]
    assert (params["tokens"], params["regions"], params["block_size"]) == (2048, 4, 16)
    assert (params["chunk_tokens"], params["concurrency"], params["block_bytes"]) == (64, 2, 256)
    assert params["backend"] == backend and params["block_bytes_auto"] is False

    timings = report["prepare"]["timings"]
    assert set(timings) == {
        "scalar_reference",
        "writeup_vectorised",
        "prepare_values_lists",
        "prepare_values_arrays",
        "chunk_hashes_int64_array",
        "chunk_hashes_list",
    }
    assert all(t["best_ms"] > 0 and t["median_ms"] >= t["best_ms"] for t in timings.values())
    assert report["prepare"]["config"]["chunks"] == 2048 // 64

    designs = {(f["design"], f["tokens_as"]) for f in report["loop_lag"]}
    assert designs == {
        ("aiokv", "int64 array"),
        ("aiokv", "list"),
        ("aiokv", "HashedPrompt"),
        ("baseline (thread per request)", "list"),
    }
    assert all(f["cpu_per_request_ms"] > 0 and f["wall_ms"] > 0 for f in report["loop_lag"])

    e2e = report["e2e"]
    geometry = e2e["geometry"]
    assert geometry["prompt_bytes"] == (2048 // 16) * 4 * 256
    # Store -> load and direct get were both compared byte for byte before timing.
    assert e2e["verified_bytes"] == 2 * geometry["prompt_bytes"]
    assert [(level["op"], level["concurrency"]) for level in e2e["levels"]] == [
        ("store", 1),
        ("load", 1),
        ("store", 2),
        ("load", 2),
    ]
    for level in e2e["levels"]:
        for path in ("worker", "direct"):
            figures = level[path]
            assert figures["wall_best_ms"] > 0 and figures["gbps_best"] > 0
            assert figures["cpu_per_request_ms"] > 0 and figures["lag_samples"] >= 0
            assert figures["lag_max_ms"] >= figures["lag_p99_ms"] >= figures["lag_p50_ms"]
        assert level["ratio_best"] == pytest.approx(
            level["worker"]["gbps_best"] / level["direct"]["gbps_best"]
        )
    names = [goal["goal"] for goal in report["goals"]]
    assert "prepare_values (lists) vs scalar reference" in names
    assert f"e2e {backend} store x2: worker / direct throughput" in names
    assert all(goal["value"] > 0 for goal in report["goals"])


def test_bench_in_process_writes_table_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path, png_path = tmp_path / "out" / "bench.json", tmp_path / "bench.png"
    assert cli.main([*TINY, "--json", str(json_path), "--plot", str(png_path)]) == 0
    captured = capsys.readouterr()
    for marker in TABLE_MARKERS:
        assert marker in captured.out, marker
    # A progress line per phase on stderr, none of it in the table.
    for phase in ("1/3 prepare_values", "2/3 loop lag", "3/3 end to end", "e2e: bytes verified"):
        assert phase in captured.err, phase
    assert "[aiokv bench" not in captured.out

    report = json.loads(json_path.read_text())
    _check_report(report, "memory")
    assert report["e2e"]["gil"] is None  # the GIL breakdown is for the Mooncake path
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE
    assert png_path.stat().st_size > 10_000


def test_bench_quick_from_the_command_line(tmp_path: Path) -> None:
    json_path = tmp_path / "quick.json"
    command = [sys.executable, "-m", "benchmarks", "--quick", *TINY, "--json", str(json_path)]
    # From the checkout's root, as documented: the benchmarks are not installed with the package.
    checkout = Path(__file__).resolve().parent.parent
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=checkout)
    assert result.returncode == 0, result.stderr
    for marker in TABLE_MARKERS:
        assert marker in result.stdout, marker
    report = json.loads(json_path.read_text())
    assert report["parameters"]["quick"] is True
    _check_report(report, "memory")


def test_quick_preset_and_auto_block_bytes() -> None:
    args = cli._resolve(["--quick"])
    assert (args.tokens, args.regions, args.rounds) == (32 * 1024, 32, 2)
    assert args.block_bytes_auto and args.block_bytes == 16 << 10
    assert cli._resolve(["--quick", "--tokens", "4096"]).tokens == 4096  # explicit options win
    full = cli._resolve([])
    assert (full.tokens, full.regions, full.block_size, full.chunk_tokens) == (289 * 1024, 96, 128, 128)
    # The long-prompt scenario: 1 KiB blocks keep the e2e working set near 2 GB (16 KiB would be ~33 GB).
    assert full.block_bytes == 1024
    assert working_set_bytes(289 * 1024, 128, 96, 128, 4, 1024) == 9 * 2312 * 96 * 1024
    assert choose_block_bytes(289 * 1024, 128, 96, 128, 4, budget_bytes=1) == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunk-tokens", "100"], "must be a multiple of --block-size"),
        (["--tokens", "64"], "hold no whole chunk"),
        (["--master", "127.0.0.1:1"], "--master is for --backend mooncake"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--backend", "redis"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*TINY, "--plot", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert "pip install 'aiokv[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


class CorruptingBackend(MemoryBackend):
    """Flips the first byte every get writes: the benchmark must refuse to time a wrong transfer."""

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        codes = super().batch_get(keys, addrs, sizes)
        first = ctypes.c_uint8.from_address(int(addrs[0][0]))
        first.value ^= 0xFF
        return codes


def test_e2e_refuses_to_time_wrong_bytes() -> None:
    geometry = Geometry(512, 16, 2, 64, 128, 1)
    with pytest.raises(RuntimeError, match="bytes differ"):
        run_e2e_benchmark(CorruptingBackend(), geometry, rounds=1)


@pytest.mark.mooncake
def test_bench_on_mooncake_starts_and_stops_its_own_master(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_mooncake()
    json_path = tmp_path / "mooncake.json"
    assert cli.main([*TINY, "--backend", "mooncake", "--json", str(json_path)]) == 0
    captured = capsys.readouterr()
    assert "3. end to end on the mooncake backend" in captured.out
    assert "GIL-held per request on the Mooncake path" in captured.out
    assert "started mooncake_master pid" in captured.err
    assert "client closed, master stopped" in captured.err
    report = json.loads(json_path.read_text())
    _check_report(report, "mooncake")
    gil = report["e2e"]["gil"]
    assert gil["calls_per_request"] >= 1
    assert gil["calls_ms"] > 0 and gil["prepare_ms"] > 0
    assert gil["total_ms"] == pytest.approx(gil["prepare_ms"] + gil["calls_ms"])
    assert gil["longest_call_ms"] <= gil["calls_ms"]
    assert gil["max_regions_per_call"] == report["e2e"]["max_regions_per_call"]
    assert report["versions"]["mooncake"]


def test_verify_cost_on_the_embedded_store_reports_on_off_ratios_and_the_wrapper_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "verify-cost.json"
    argv = ["verify-cost", "--backend", "memory", "--tokens", "512", "--layers", "2", "--rounds", "2"]
    assert cli.main([*argv, "--wrapper-keys", "64", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert "load_cpu_s" in out and "wrapper alone, one get of 64 keys x 2 x 1024 B" in out
    summary = json.loads(json_path.read_text())["summary"]
    for figure in ("store_wall_s", "store_cpu_s", "load_wall_s", "load_cpu_s"):
        assert summary[figure]["on"] > 0 and summary[figure]["off"] > 0
    assert summary["wrapper_cpu_s_per_get"] > 0
