"""The cross-node benchmark runs end to end (a small prompt, one round; figures are not judged here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cluster import main

from .support import require_cluster


def test_cluster_benchmark_runs_and_reports_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_cluster()
    out = tmp_path / "cluster.json"
    assert main(["--mib", "8", "--rounds", "1", "--skip-recovery", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["blocks_per_chunk"] for row in report["throughput"]] == [1, 16]
    for row in report["throughput"]:
        assert row["bytes"] >= 8 << 20  # at least one whole chunk (16 MiB with 16-block chunks)
        assert set(row["gb_per_s"]) == {"worker_store", "direct_put", "worker_load", "direct_get"}
        assert all(rate > 0 for rate in row["gb_per_s"].values())
    assert "cross-node throughput" in capsys.readouterr().out
