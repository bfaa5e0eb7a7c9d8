"""The layouts benchmark's plumbing and counts (not its timings): tiny scenarios, real bytes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from aiokv.backends.mooncake_master import MooncakeMaster
from benchmarks.layout_caches import KINDS, LayoutCache, Scenario, chunk_token_table, pairs_per_request
from benchmarks.layouts import main, print_report, run_layouts_benchmark

TINY = Scenario(tokens=4096, block_size=128, regions=8, block_bytes=64, concurrency=2, rounds=1)


@pytest.mark.parametrize("kind", KINDS)
def test_caches_share_geometry_and_count_pairs(kind: str) -> None:
    cache = LayoutCache(
        kind, regions=8, block_bytes=64, block_size=128, prompt_blocks=32, blocks_per_chunk=2, sets=3
    )
    sets = cache.block_sets
    assert [s.size for s in sets] == [32, 32, 32]
    assert len(set(np.concatenate(sets).tolist())) == 96  # disjoint
    assert (np.diff(sets[1].reshape(16, 2), axis=1) == 1).all()  # chunks physically consecutive
    matrix = sets[0].reshape(16, 2)
    expected = {"layer_major": 16 * 8, "block_major": 16 * 8 * 2, "cross_layer": 16}[kind]
    assert pairs_per_request(cache.layout, matrix) == expected
    layer = LayoutCache("layer_major", regions=8, block_bytes=64, block_size=128, prompt_blocks=32,
                        blocks_per_chunk=2, sets=3)  # fmt: skip
    if kind == "block_major":
        assert cache.layout.fingerprint == layer.layout.fingerprint
    assert cache.same_blocks(sets[0], sets[0]) and not cache.same_blocks(sets[0], sets[1])


def test_chunk_token_table_counts() -> None:
    rows = {r["chunk_tokens"]: r for r in chunk_token_table(Scenario())}
    assert rows[128]["keys"] == 2312
    assert rows[128]["layer_major"]["pairs"] == 2312 * 96
    assert rows[128]["block_major"]["pairs"] == rows[128]["cross_layer"]["pairs"] == 2312
    assert rows[1024]["cross_layer"] == {"pairs_per_key": 1, "pairs": 289, "pair_bytes": 8 * 96 * 256}
    assert rows[1024]["block_major"]["pairs_per_key"] == 8 * 96  # strided views cannot merge blocks


def test_benchmark_runs_on_the_embedded_backend_and_reports(tmp_path: Path) -> None:
    result = run_layouts_benchmark(TINY)
    assert set(result["layouts"]) == set(KINDS)
    layer, block = result["layouts"]["layer_major"], result["layouts"]["block_major"]
    assert (layer["pairs_per_chunk"], block["pairs_per_chunk"]) == (8, 1)
    assert layer["pairs_per_request"] == 32 * 8 and block["pairs_per_request"] == 32
    assert layer["gil"]["conversion_ms"] is None  # the binding's conversion is Mooncake's only
    for figures in result["layouts"].values():
        assert figures["store"]["gbps_best"] > 0 and figures["load"]["gbps_best"] > 0
    assert result["ratios_layer_major_over"]["block_major"]["pairs_per_request"] == 8
    out = io.StringIO()
    print_report(result, out)
    assert "layer_major" in out.getvalue() and "chunk_tokens" in out.getvalue()
    path = tmp_path / "layouts.json"
    assert (
        main(
            [
                "--tokens",
                "2048",
                "--regions",
                "4",
                "--block-bytes",
                "64",
                "--rounds",
                "1",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    assert json.loads(path.read_text())["scenario"]["tokens"] == 2048


def test_benchmark_on_mooncake_times_the_call_form_the_backend_takes(mooncake_master: MooncakeMaster) -> None:
    """One pair per chunk: the flat calls, with the multi-buffer form timed beside them as the baseline;
    the conversion probe's -600 answers are checked inside (a wrong answer raises)."""
    result = run_layouts_benchmark(TINY, backend="mooncake", master=mooncake_master.address)
    for kind, figures in result["layouts"].items():
        gil = figures["gil"]
        assert gil["flat"] == (kind != "layer_major") and gil["multi_flat"] is False
        assert gil["conversion_ms"] > 0 and gil["multi_conversion_ms"] > 0
        assert gil["total_ms"] == pytest.approx(gil["prepare_ms"] + gil["backend_ms"] + gil["conversion_ms"])
        assert figures["store"]["busy_p99_ms"] >= 0 and figures["idle_lag_p99_ms"] >= 0
        assert figures["load"]["worst_busy_ms"] is not None  # the loop thread's CPU is always known
    out = io.StringIO()
    print_report(result, out)
    assert "busy99" in out.getvalue()


def test_cross_process_benchmark_moves_verified_bytes(mooncake_master: MooncakeMaster) -> None:
    from benchmarks.layouts_xproc import XScenario, print_xproc_report, run_xproc_benchmark

    xs = XScenario(tokens=1024, layers=2, heads=1, head_dim=16, multi_chunk_tokens=64, rounds=1)
    result = run_xproc_benchmark(xs, master=mooncake_master.address)
    labels = [c["label"] for c in result["configurations"]]
    assert labels == [label for label, _, _ in xs.configurations()]
    pairs = [c["pairs_per_key"] for c in result["configurations"]]
    assert pairs == [4, 4, 4, 4, 1, 1]
    out = io.StringIO()
    print_xproc_report(result, out)
    assert "best store" in out.getvalue()
