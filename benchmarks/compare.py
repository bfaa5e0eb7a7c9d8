"""Old against new in one run: ``python -m benchmarks.compare REV [--scenarios seed ...] [--rounds N]``.

Checks ``REV`` out into a temporary git worktree, then runs the chosen scenarios
(:mod:`benchmarks.scenarios`, each round a fresh process) on that revision's ``aiokv`` and on the working
tree's, alternating which goes first, and prints per figure the median of each side, the ratio
new / old of the medians and the spread of the per-round ratios (min-max). On a shared machine absolute
times move from run to run; the interleaved ratio is what shows a regression.

Each side's values are also kept as pyperf benchmark suites (``--json DIR`` writes ``old.json`` and
``new.json``, which ``python -m pyperf compare_to DIR/old.json DIR/new.json`` reads too); pyperf
computes the means and standard deviations printed here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyperf

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS_SCRIPT = Path(__file__).resolve().parent / "scenarios.py"

Samples = dict[str, dict[str, list[float]]]  # scenario -> figure -> one value per round


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_scenarios(code_root: Path, scenarios: list[str]) -> dict[str, dict[str, float]]:
    """One fresh process running ``scenarios`` with ``code_root``'s ``aiokv`` first on the path."""
    env = dict(os.environ, PYTHONPATH=str(code_root))
    done = subprocess.run(
        [sys.executable, str(SCENARIOS_SCRIPT), *scenarios],
        env=env,
        cwd=code_root,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"scenarios failed on {code_root} (exit {done.returncode}):\n{done.stderr}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(answer["aiokv"]).resolve().parent.parent != code_root.resolve():
        raise RuntimeError(f"scenarios imported {answer['aiokv']}, not the aiokv of {code_root}")
    figures: dict[str, dict[str, float]] = answer["figures"]
    return figures


def _append(samples: Samples, figures: dict[str, dict[str, float]]) -> None:
    for scenario, values in figures.items():
        for name, value in values.items():
            samples.setdefault(scenario, {}).setdefault(name, []).append(value)


def interleaved(old_root: Path, new_root: Path, scenarios: list[str], rounds: int) -> tuple[Samples, Samples]:
    """``rounds`` pairs of runs, old first in even rounds and new first in odd ones."""
    old: Samples = {}
    new: Samples = {}
    for index in range(rounds):
        order = [(old_root, old), (new_root, new)]
        for root, samples in order if index % 2 == 0 else order[::-1]:
            _append(samples, run_scenarios(root, scenarios))
    return old, new


def as_pyperf_suite(samples: Samples) -> pyperf.BenchmarkSuite:
    """One pyperf benchmark per figure (a round is one run of one value)."""
    benchmarks = []
    for scenario, figures in samples.items():
        for name, values in figures.items():
            runs = [
                pyperf.Run(
                    [max(value, 1e-12)], metadata={"name": f"{scenario}.{name}"}, collect_metadata=False
                )
                for value in values
            ]
            benchmarks.append(pyperf.Benchmark(runs))
    return pyperf.BenchmarkSuite(benchmarks)


def ratio_rows(old: Samples, new: Samples) -> list[tuple[str, float, float, float, float, float, float]]:
    """Per figure: (name, old median, new median, new/old of the medians, min and max per-round ratio,
    new's relative standard deviation)."""
    old_suite = as_pyperf_suite(old)
    new_suite = as_pyperf_suite(new)
    rows = []
    for bench in new_suite.get_benchmarks():
        name = bench.get_name()
        new_values = bench.get_values()
        old_values = old_suite.get_benchmark(name).get_values()
        old_median, new_median = statistics.median(old_values), statistics.median(new_values)
        per_round = [n / o for o, n in zip(old_values, new_values, strict=True) if o > 1e-9]
        ratio = new_median / old_median if old_median > 1e-9 else float("nan")
        spread = bench.stdev() / bench.mean() if len(new_values) > 1 and bench.mean() > 0 else 0.0
        rows.append(
            (
                name,
                old_median,
                new_median,
                ratio,
                min(per_round, default=ratio),
                max(per_round, default=ratio),
                spread,
            )
        )
    return rows


def format_rows(rows: list[tuple[str, float, float, float, float, float, float]], rev: str) -> str:
    width = max(len(row[0]) for row in rows) if rows else 10
    lines = [f"{'figure':<{width}}  {rev:>10}  {'working':>10}  {'ratio':>6}  {'per-round':>13}  new sd"]
    for name, old_median, new_median, ratio, low, high, spread in rows:
        lines.append(
            f"{name:<{width}}  {old_median:>10.3f}  {new_median:>10.3f}  {ratio:>6.2f}  "
            f"{low:>5.2f}-{high:<7.2f}  {spread:>5.0%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n")[0])
    parser.add_argument(
        "rev", help="git revision to compare the working tree against (e.g. HEAD~1, a tag, a commit hash)"
    )
    parser.add_argument("--scenarios", nargs="+", default=["seed"], help="scenario names (default: seed)")
    parser.add_argument("--rounds", type=int, default=5, help="pairs of runs (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="folder for pyperf suites old.json/new.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    commit = _git("rev-parse", "--verify", f"{args.rev}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="aiokv-compare-") as scratch:
        old_root = Path(scratch) / "old"
        _git("worktree", "add", "--detach", str(old_root), commit)
        try:
            old, new = interleaved(old_root, ROOT, args.scenarios, args.rounds)
        finally:
            _git("worktree", "remove", "--force", str(old_root))
    if args.json is not None:
        args.json.mkdir(parents=True, exist_ok=True)
        as_pyperf_suite(old).dump(str(args.json / "old.json"), replace=True)
        as_pyperf_suite(new).dump(str(args.json / "new.json"), replace=True)
    print(f"{args.rounds} interleaved rounds; ratio = working tree / {args.rev} ({commit[:10]}), medians")
    print(format_rows(ratio_rows(old, new), args.rev))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
