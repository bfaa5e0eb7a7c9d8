"""The report of ``python -m benchmarks``: the project's goals judged on its figures, the text tables,
and the optional plot."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

PLOT_HINT = "--plot needs matplotlib: pip install 'aiokv[plot]'"

# The project's goals. They are judged on the full scenario (the defaults); smaller runs report them too.
GOAL_LAG_P99_MS = 2.0
GOAL_FRAMEWORK_CPU_MS = 4.0
GOAL_THROUGHPUT_RATIO = 0.95


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def kib(nbytes: int) -> str:
    return f"{nbytes / 1024:g} KiB" if nbytes >= 1024 else f"{nbytes} B"


def table(out: TextIO, headers: list[str], rows: list[list[str]], indent: str = "  ") -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return indent + "  ".join(parts).rstrip()

    out.write(line(headers) + "\n")
    out.write(indent + "  ".join("-" * w for w in widths) + "\n")
    for row in rows:
        out.write(line(row) + "\n")


def _f(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _goal(goal: str, target: str, value: float, unit: str, met: bool | None) -> dict[str, Any]:
    return {"goal": goal, "target": target, "value": value, "unit": unit, "met": met}


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every goal with the figure it is judged on."""
    speed = report["prepare"]["speedups"]
    vs_scalar = speed["prepare_values_lists_vs_scalar"]["best"]
    vs_writeup = speed["prepare_values_lists_vs_writeup"]["best"]
    items = [
        _goal("prepare_values (lists) vs scalar reference", ">= 50x", vs_scalar, "x", vs_scalar >= 50),
        _goal("prepare_values (lists) vs vectorised baseline", ">= 10x", vs_writeup, "x", vs_writeup >= 10),
    ]
    ours = next(f for f in report["loop_lag"] if f["design"] == "aiokv" and f["tokens_as"] == "int64 array")
    lag_target, cpu_target = f"<= {GOAL_LAG_P99_MS:g} ms", f"<= {GOAL_FRAMEWORK_CPU_MS:g} ms"
    p99, cpu = ours["lag_p99_ms"], ours["cpu_per_request_ms"]
    items.append(
        _goal(f"loop lag p99, {ours['concurrency']} stores, sleeping backend", lag_target, p99, "ms",
              p99 <= GOAL_LAG_P99_MS)
    )  # fmt: skip
    items.append(
        _goal("framework CPU per request, int64 tokens", cpu_target, cpu, "ms", cpu <= GOAL_FRAMEWORK_CPU_MS)
    )
    e2e = report["e2e"]
    backend = report["parameters"]["backend"]
    top = max(level["concurrency"] for level in e2e["levels"])
    for level in e2e["levels"]:
        if level["concurrency"] == top:
            p99 = level["worker"]["lag_p99_ms"]
            name = f"e2e {backend} {level['op']} x{top}: loop lag p99"
            items.append(_goal(name, lag_target, p99, "ms", p99 <= GOAL_LAG_P99_MS))
    for level in e2e["levels"]:
        ratio = level["ratio_best"]
        name = f"e2e {backend} {level['op']} x{level['concurrency']}: worker / direct throughput"
        items.append(_goal(name, f">= {GOAL_THROUGHPUT_RATIO:g}", ratio, "", ratio >= GOAL_THROUGHPUT_RATIO))
    gil = e2e.get("gil")
    if gil:
        name = "GIL-held per request on the Mooncake path (prepare + calls, upper bound)"
        items.append(_goal(name, "reported", gil["total_ms"], "ms", None))
    return items


def headline(p: dict[str, Any]) -> str:
    """The scenario in one line, the table's and the plot's title alike."""
    return (
        f"aiokv bench: {p['tokens']:,} tokens, block {p['block_size']}, {p['regions']} regions, "
        f"chunk {p['chunk_tokens']}"
    )


def print_report(report: dict[str, Any], out: TextIO) -> None:
    p = report["parameters"]
    prep = report["prepare"]
    m = report["machine"]
    v = report["versions"]
    out.write(
        f"\n{headline(p)} tokens ({prep['config']['chunks']:,} chunks), "
        f"concurrency {p['concurrency']}, backend {p['backend']}\n"
        f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['platform']}, Python {m['python']}; "
        f"aiokv {v['aiokv']}, NumPy {v['numpy']}"
        + (f", mooncake {v['mooncake']}" if v.get("mooncake") else "")
        + "\n\n"
    )
    t = prep["timings"]
    s = prep["speedups"]
    out.write(f"1. prepare_values, per call over {prep['config']['repeats']} samples (addresses only)\n")
    lines = [
        ("scalar reference (loop over chunks)", "scalar_reference", None, None),
        ("vectorised baseline (lists)", "writeup_vectorised", None, None),
        ("aiokv prepare_values, same lists", "prepare_values_lists", "prepare_values_lists_vs_scalar",
         "prepare_values_lists_vs_writeup"),
        ("aiokv prepare_values, int64 arrays", "prepare_values_arrays", "prepare_values_arrays_vs_scalar",
         "prepare_values_arrays_vs_writeup"),
        ("chunk_hashes, int64 token array", "chunk_hashes_int64_array", None, None),
        ("chunk_hashes, token list", "chunk_hashes_list", None, None),
    ]  # fmt: skip
    rows = []
    for label, key, vs_scalar, vs_writeup in lines:
        row = [label, _f(t[key]["best_ms"], 3), _f(t[key]["median_ms"], 3)]
        if key == "writeup_vectorised":
            row += [f"{t['scalar_reference']['best_ms'] / t[key]['best_ms']:.1f}x", ""]
        else:
            row.append(f"{s[vs_scalar]['best']:.0f}x" if vs_scalar else "")
            row.append(f"{s[vs_writeup]['best']:.1f}x" if vs_writeup else "")
        rows.append(row)
    table(out, ["implementation", "best ms", "median ms", "vs scalar", "vs baseline"], rows)

    lag = report["loop_lag"]
    c = lag[0]["concurrency"]
    out.write(
        f"\n2. loop lag and framework CPU: {c} concurrent {p['tokens']:,}-token stores, "
        f"sleeping GIL-free backend (median over {p['rounds']} rounds)\n"
    )
    rows = [
        [f["design"], f["tokens_as"], _f(f["lag_p50_ms"]), _f(f["lag_p99_ms"]), _f(f["lag_max_ms"]),
         _f(f["cpu_per_request_ms"]), _f(f["wall_ms"], 1)]
        for f in lag
    ]  # fmt: skip
    table(out, ["design", "tokens as", "lag p50 ms", "p99 ms", "max ms", "CPU/request ms", "wall ms"], rows)
    ours = next(f for f in lag if f["design"] == "aiokv" and f["tokens_as"] == "list")
    theirs = next(f for f in lag if f["design"] != "aiokv")
    lag_ratio = theirs["lag_p99_ms"] / max(ours["lag_p99_ms"], 1e-9)
    cpu_ratio = theirs["cpu_per_request_ms"] / max(ours["cpu_per_request_ms"], 1e-9)
    out.write(
        f"  baseline / aiokv (both lists): lag p99 {lag_ratio:.1f}x, CPU per request {cpu_ratio:.1f}x\n"
    )

    e2e = report["e2e"]
    g = e2e["geometry"]
    block = kib(g["block_bytes"]) + (" (auto)" if p["block_bytes_auto"] else "")
    out.write(
        f"\n3. end to end on the {p['backend']} backend, real bytes: block {block} per "
        f"region -> {mb(g['prompt_bytes'])} per prompt; cache {mb(g['cache_bytes'])} + store "
        f"{mb(g['store_bytes'])} = working set {mb(g['working_set_bytes'])}; "
        f"{e2e['max_regions_per_call']} regions per worker call; {mb(e2e['verified_bytes'])} verified "
        f"byte for byte before timing\n"
        f"   (wall and GB/s best over {e2e['rounds']} rounds; lag pooled over rounds; CPU = process CPU per "
        f"request, median)\n"
    )
    rows = []
    for level in e2e["levels"]:
        for path in ("worker", "direct"):
            f = level[path]
            figures = [f["wall_best_ms"], f["wall_median_ms"], f["gbps_best"]]
            figures += [f["lag_p50_ms"], f["lag_p99_ms"], f["lag_max_ms"], f["cpu_per_request_ms"]]
            ratio = f"{level['ratio_best']:.3f}" if path == "worker" else ""
            rows.append([f"{level['op']} x{level['concurrency']}", path, *map(_f, figures), ratio])
    table(
        out,
        ["op", "path", "wall ms", "median", "GB/s", "lag p50", "p99", "max", "CPU/req ms", "worker/direct"],
        rows,
    )
    gil = e2e.get("gil")
    if gil:
        out.write(
            f"  GIL-held per request on the Mooncake path: prepare {gil['prepare_ms']:.2f} + calls "
            f"{gil['calls_ms']:.2f} = {gil['total_ms']:.2f} ms over {gil['calls_per_request']} calls "
            f"(longest call {gil['longest_call_ms']:.2f} ms; each call timed on absent keys, the "
            "master's answer included: an upper bound)\n"
        )

    out.write("\ngoals (judged on the full scenario)\n")
    rows = []
    for item in report["goals"]:
        state = "" if item["met"] is None else ("met" if item["met"] else "MISSED")
        value = f"{item['value']:.3f}{item['unit']}" if item["unit"] != "x" else f"{item['value']:.1f}x"
        rows.append([item["goal"], item["target"], value, state])
    table(out, ["goal", "target", "measured", ""], rows)
    out.write(f"\nran in {report['seconds']:.1f} s\n")


def write_plot(report: dict[str, Any], path: Path) -> None:
    """A PNG of the comparison: prepare_values, loop lag / CPU, e2e throughput and e2e loop lag."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(PLOT_HINT) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    p = report["parameters"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    fig.suptitle(f"{headline(p)}, backend {p['backend']}")
    t = report["prepare"]["timings"]
    names = [
        ("scalar\nreference", "scalar_reference"),
        ("baseline\n(lists)", "writeup_vectorised"),
        ("aiokv\n(lists)", "prepare_values_lists"),
        ("aiokv\n(arrays)", "prepare_values_arrays"),
    ]
    ax = axes[0][0]
    values = [t[key]["best_ms"] for _, key in names]
    bars = ax.bar([n for n, _ in names], values, color=["#999", "#c77", "#47a", "#6ad"])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (best)")
    ax.set_title("prepare_values")

    ax = axes[0][1]
    lag = report["loop_lag"]
    labels = [f"{f['design'].replace(' (thread per request)', '')}\n{f['tokens_as']}" for f in lag]
    x = np.arange(len(lag))
    b1 = ax.bar(x - 0.2, [f["lag_p99_ms"] for f in lag], 0.4, label="loop lag p99 ms")
    b2 = ax.bar(x + 0.2, [f["cpu_per_request_ms"] for f in lag], 0.4, label="CPU per request ms")
    ax.bar_label(b1, fmt="%.1f")
    ax.bar_label(b2, fmt="%.1f")
    ax.axhline(GOAL_LAG_P99_MS, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_title(f"{lag[0]['concurrency']} concurrent stores, sleeping backend")
    ax.legend()

    levels = report["e2e"]["levels"]
    labels = [f"{level['op']} x{level['concurrency']}" for level in levels]
    x = np.arange(len(levels))
    for ax, key, title, unit in (
        (axes[1][0], "gbps_best", f"e2e throughput, {p['backend']} backend, real bytes", "GB/s (best)"),
        (axes[1][1], "lag_p99_ms", "e2e loop lag p99", "ms"),
    ):
        w = ax.bar(x - 0.2, [level["worker"][key] for level in levels], 0.4, label="through the worker")
        d = ax.bar(x + 0.2, [level["direct"][key] for level in levels], 0.4, label="direct batch calls")
        ax.bar_label(w, fmt="%.2f")
        ax.bar_label(d, fmt="%.2f")
        ax.set_xticks(x, labels)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend()
    axes[1][1].axhline(GOAL_LAG_P99_MS, color="k", lw=0.8, ls="--")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------


def finish_suite(
    suite: str,
    make_report: Callable[[], dict[str, Any]],
    print_report: Callable[[dict[str, Any], TextIO], None],
    json_path: Path | None,
) -> int:
    """A suite's ``main`` after its arguments are parsed: run it (a ``ValueError`` is a bad argument:
    exit status 2), print its report, write it as JSON if asked."""
    try:
        report = make_report()
    except ValueError as exc:
        sys.stderr.write(f"aiokv bench {suite}: {exc}\n")
        return 2
    print_report(report, sys.stdout)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def suite_main(
    suite: str,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    run: Callable[..., dict[str, Any]],
    print_report: Callable[[dict[str, Any], TextIO], None],
) -> int:
    """A suite's whole ``main``: parse its arguments, run it with every option but ``--json`` as a
    keyword argument, then :func:`finish_suite`."""
    args = parser.parse_args(argv)
    options = {name: value for name, value in vars(args).items() if name != "json"}
    return finish_suite(suite, lambda: run(**options), print_report, args.json)
