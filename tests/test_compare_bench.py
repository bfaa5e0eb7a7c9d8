"""The old-vs-new runner (benchmarks/compare.py) runs end to end: against HEAD it checks the revision
out, runs the seed scenario on both trees (tiny settings) and prints a ratio per figure. No speed is
asserted: ratios on a shared machine are for people to read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("pyperf", reason="pyperf (the test extra) runs the comparison's statistics")


def test_compare_prints_ratios_against_head() -> None:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: the runner checks a revision out with git worktree")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "HEAD~0", "--rounds", "1", "--scenarios", "tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("tiny.")]
    names = {row.split()[0] for row in rows}
    assert {"tiny.tokens_cpu_per_request_ms", "tiny.tokens_lag_p99_ms", "tiny.tokens_wall_ms"} <= names
    for row in rows:
        # figure, old median, new median, ratio, per-round range, spread
        assert re.fullmatch(r"\S+\s+[\d.]+\s+[\d.]+\s+([\d.]+|nan)\s+\S+\s+\d+%", row), row
    # No worktree is left behind.
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "aiokv-compare-" not in listed


def test_compare_refuses_an_unknown_scenario() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scenarios.py"), "no-such-scenario"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown scenario" in done.stderr


def test_throughput_scenario_stores_and_loads_every_request() -> None:
    """The throughput scenario, small: it raises unless every store wrote and every load read its
    prompt, so figures come back only from requests that moved their bytes."""
    import asyncio

    from benchmarks import scenarios

    figures = asyncio.run(scenarios.throughput(pairs=64, callers=8, rounds=1))
    assert (
        figures["requests_per_s"] == pytest.approx(2 * figures["stores_per_s"])
        and figures["stores_per_s"] > 0
    )
    assert figures["cpu_per_request_us"] > 0 and figures["requests_per_cpu_s"] > 0
