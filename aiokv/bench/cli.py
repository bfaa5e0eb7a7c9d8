"""``python -m aiokv bench``: the reference write-up's scenario, aiokv against its baselines, in one run.

1. ``prepare_values``: the scalar per-chunk reference, the write-up's vectorised version (lists) and
   ``KVLayout.prepare_values`` on the same chunks (plus chunk hashing);
2. event-loop lag and framework CPU of concurrent long-prompt stores with a sleeping, GIL-releasing
   backend: aiokv against the write-up's thread-per-request design;
3. end to end through the worker on the chosen backend with real bytes: CPU per request, loop lag
   with 1 and N concurrent requests, and throughput against direct backend batch calls on the same
   keys and regions (on Mooncake also the GIL-held time per request).

Progress goes to stderr, the table to stdout; ``--json`` and ``--plot`` write every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..errors import AiokvError
from .e2e import (
    DEFAULT_E2E_BUDGET_BYTES,
    Geometry,
    Progress,
    choose_block_bytes,
    run_e2e_benchmark,
    store_capacity_bytes,
)
from .loop_lag import run_loop_lag_benchmark
from .prepare import DEFAULT_TOKENS, run_prepare_benchmark

NAMESPACE_COMMAND = "unshare -rn sh -c 'ip link set lo up && python -m aiokv bench --backend mooncake'"
PLOT_HINT = "--plot needs matplotlib: pip install 'aiokv[plot]'"

# The issues' goals. They are judged on the full scenario (the defaults); smaller runs report them too.
GOAL_LAG_P99_MS = 2.0
GOAL_FRAMEWORK_CPU_MS = 4.0
GOAL_THROUGHPUT_RATIO = 0.95

# --quick: a scenario that finishes in seconds (explicit options still win).
_QUICK = {"tokens": 32 * 1024, "regions": 32, "rounds": 2}
_FULL = {"tokens": DEFAULT_TOKENS, "regions": 96, "rounds": 5}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aiokv bench",
        description="The reference write-up's scenario (289K tokens, block 128, 96 regions): the scalar "
        "reference, the write-up's vectorised version and aiokv side by side, then end to end through "
        "the worker with real bytes against direct backend calls.",
        epilog=f"Mooncake without --master starts a loopback master; run it in a private network "
        f"namespace: {NAMESPACE_COMMAND}",
    )
    scenario = parser.add_argument_group("scenario")
    scenario.add_argument("--tokens", type=int, help=f"tokens per prompt (default {DEFAULT_TOKENS})")
    scenario.add_argument("--block-size", type=int, default=128, help="tokens per block (default 128)")
    scenario.add_argument("--regions", type=int, help="cache regions, layers x K/V (default 96)")
    scenario.add_argument(
        "--chunk-tokens", type=int, default=128, help="tokens per stored chunk (default 128, one block)"
    )
    scenario.add_argument(
        "--concurrency", type=int, default=4, help="concurrent requests (default 4; e2e also runs 1)"
    )
    scenario.add_argument(
        "--block-bytes",
        type=int,
        help="bytes per block per region for the e2e part (real memory; default: the largest power "
        f"of two <= 16 KiB whose working set fits {DEFAULT_E2E_BUDGET_BYTES >> 30} GiB)",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--backend", choices=("memory", "mooncake"), default="memory")
    run.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="a running mooncake_master on this machine (a loopback client; default: start one)",
    )
    run.add_argument("--rounds", type=int, help="timed rounds per measurement, after a warm-up (default 5)")
    run.add_argument("--quick", action="store_true", help="a small scenario that runs in seconds")
    run.add_argument(
        "--max-regions-per-call",
        type=int,
        help="the worker's max_regions_per_call (default: the backend's, else the worker's default)",
    )
    run.add_argument(
        "--executor-threads", type=int, help="the worker's executor_threads (default: the worker's)"
    )
    run.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", type=Path, help="write every figure as JSON")
    out.add_argument("--plot", metavar="PATH", type=Path, help="write a PNG of the comparison (matplotlib)")
    return parser


def _positive(parser: argparse.ArgumentParser, name: str, value: int) -> None:
    if value < 1:
        parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _resolve(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    preset = _QUICK if args.quick else _FULL
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("tokens", "block_size", "regions", "chunk_tokens", "concurrency", "rounds"):
        _positive(parser, name, getattr(args, name))
    for name in ("max_regions_per_call", "executor_threads"):
        if getattr(args, name) is not None:
            _positive(parser, name, getattr(args, name))
    if args.chunk_tokens % args.block_size:
        parser.error(
            f"--chunk-tokens {args.chunk_tokens} must be a multiple of --block-size {args.block_size}"
        )
    if args.tokens < args.chunk_tokens:
        parser.error(f"--tokens {args.tokens} hold no whole chunk of {args.chunk_tokens} tokens")
    if args.master is not None and args.backend != "mooncake":
        parser.error("--master is for --backend mooncake")
    if args.block_bytes is None:
        args.block_bytes = choose_block_bytes(
            args.tokens, args.block_size, args.regions, args.chunk_tokens, args.concurrency
        )
        args.block_bytes_auto = True
    else:
        _positive(parser, "block_bytes", args.block_bytes)
        args.block_bytes_auto = False
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(PLOT_HINT)  # before minutes of benchmarking, not after
    return args


def _geometry(args: argparse.Namespace) -> Geometry:
    whole = args.tokens // args.chunk_tokens * args.chunk_tokens
    return Geometry(
        whole, args.block_size, args.regions, args.chunk_tokens, args.block_bytes, args.concurrency
    )


# -- environment ----------------------------------------------------------------------------------


def _version(*distributions: str) -> str | None:
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def _cpu_model() -> str | None:
    # platform.processor() is empty on most Linux systems; /proc/cpuinfo names the CPU.
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
    }


def versions() -> dict[str, str | None]:
    from .. import __version__

    return {
        "aiokv": __version__,
        "numpy": np.__version__,
        "uvloop": _version("uvloop"),
        "mooncake": _version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
    }


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _private_namespace() -> bool:
    try:
        with open("/proc/net/dev") as dev:
            names = {line.split(":", 1)[0].strip() for line in dev.read().splitlines()[2:] if ":" in line}
    except OSError:
        return False
    return names == {"lo"}


# -- backends -------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_backend(args: argparse.Namespace, geometry: Geometry, progress: Progress) -> Iterator[Any]:
    """The e2e backend, sized to the working set; for Mooncake also a master when none is given."""
    capacity = store_capacity_bytes(geometry)
    if args.backend == "memory":
        from ..backends.memory import MemoryBackend

        backend = MemoryBackend(capacity_bytes=capacity)
        try:
            yield backend
        finally:
            backend.close()
        return
    from ..backends.mooncake import MooncakeBackend
    from ..backends.mooncake_master import MooncakeMaster

    with contextlib.ExitStack() as stack:
        address = args.master
        if address is None:
            if not _private_namespace():
                progress(
                    "warning: some Mooncake sockets listen on all interfaces; to keep them on loopback "
                    f"run: {NAMESPACE_COMMAND}"
                )
            master = stack.enter_context(MooncakeMaster())
            address = master.address
            progress(f"mooncake: started mooncake_master pid {master.pid} on {address}")
        backend = MooncakeBackend.from_master(address, global_segment_size=capacity)
        stack.callback(backend.close)
        progress(f"mooncake: client connected to {address}, segment {capacity / 2**20:.0f} MiB")
        yield backend
    progress("mooncake: client closed" + ("" if args.master else ", master stopped"))


# -- output ---------------------------------------------------------------------------------------


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:g} KiB" if nbytes >= 1024 else f"{nbytes} B"


def _table(out: TextIO, headers: list[str], rows: list[list[str]], indent: str = "  ") -> None:
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
    """Every goal of the issues with the figure it is judged on."""
    speed = report["prepare"]["speedups"]
    vs_scalar = speed["prepare_values_lists_vs_scalar"]["best"]
    vs_writeup = speed["prepare_values_lists_vs_writeup"]["best"]
    items = [
        _goal("prepare_values (lists) vs scalar reference", ">= 50x", vs_scalar, "x", vs_scalar >= 50),
        _goal("prepare_values (lists) vs write-up", ">= 10x", vs_writeup, "x", vs_writeup >= 10),
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
        name = "GIL-held per request on the Mooncake path (prepare + conversion)"
        items.append(_goal(name, "reported", gil["total_ms"], "ms", None))
    return items


def print_report(report: dict[str, Any], out: TextIO) -> None:
    p = report["parameters"]
    prep = report["prepare"]
    m = report["machine"]
    v = report["versions"]
    out.write(
        f"\naiokv bench: {p['tokens']:,} tokens, block {p['block_size']}, {p['regions']} regions, "
        f"chunk {p['chunk_tokens']} tokens ({prep['config']['chunks']:,} chunks), "
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
        ("write-up vectorised (lists)", "writeup_vectorised", None, None),
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
    _table(out, ["implementation", "best ms", "median ms", "vs scalar", "vs write-up"], rows)

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
    _table(out, ["design", "tokens as", "lag p50 ms", "p99 ms", "max ms", "CPU/request ms", "wall ms"], rows)
    ours = next(f for f in lag if f["design"] == "aiokv" and f["tokens_as"] == "list")
    theirs = next(f for f in lag if f["design"] != "aiokv")
    lag_ratio = theirs["lag_p99_ms"] / max(ours["lag_p99_ms"], 1e-9)
    cpu_ratio = theirs["cpu_per_request_ms"] / max(ours["cpu_per_request_ms"], 1e-9)
    out.write(
        f"  write-up / aiokv (both lists): lag p99 {lag_ratio:.1f}x, CPU per request {cpu_ratio:.1f}x\n"
    )

    e2e = report["e2e"]
    g = e2e["geometry"]
    block = _kib(g["block_bytes"]) + (" (auto)" if p["block_bytes_auto"] else "")
    out.write(
        f"\n3. end to end on the {p['backend']} backend, real bytes: block {block} per "
        f"region -> {_mb(g['prompt_bytes'])} per prompt; cache {_mb(g['cache_bytes'])} + store "
        f"{_mb(g['store_bytes'])} = working set {_mb(g['working_set_bytes'])}; "
        f"{e2e['max_regions_per_call']} regions per worker call; {_mb(e2e['verified_bytes'])} verified "
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
    _table(
        out,
        ["op", "path", "wall ms", "median", "GB/s", "lag p50", "p99", "max", "CPU/req ms", "worker/direct"],
        rows,
    )
    gil = e2e.get("gil")
    if gil:
        out.write(
            f"  GIL-held per request on the Mooncake path: prepare {gil['prepare_ms']:.2f} + checks "
            f"{gil['checks_ms']:.2f} + lists {gil['lists_ms']:.2f} + binding conversion "
            f"{gil['conversion_ms']:.2f} = {gil['total_ms']:.2f} ms over {gil['calls_per_request']} calls "
            f"(longest call {gil['longest_call_ms']:.2f} ms)\n"
        )

    out.write("\ngoals (judged on the full scenario)\n")
    rows = []
    for item in report["goals"]:
        state = "" if item["met"] is None else ("met" if item["met"] else "MISSED")
        value = f"{item['value']:.3f}{item['unit']}" if item["unit"] != "x" else f"{item['value']:.1f}x"
        rows.append([item["goal"], item["target"], value, state])
    _table(out, ["goal", "target", "measured", ""], rows)
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
    fig.suptitle(
        f"aiokv bench: {p['tokens']:,} tokens, block {p['block_size']}, {p['regions']} regions, "
        f"chunk {p['chunk_tokens']}, backend {p['backend']}"
    )
    t = report["prepare"]["timings"]
    names = [
        ("scalar\nreference", "scalar_reference"),
        ("write-up\n(lists)", "writeup_vectorised"),
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


def run_bench(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    started = time.perf_counter()
    geometry = _geometry(args)
    available = _available_memory()
    if available is not None and geometry.working_set_bytes > 0.8 * available:
        raise MemoryError(
            f"the e2e working set ({_mb(geometry.working_set_bytes)}) is more than 80% of the available "
            f"memory ({_mb(available)}): pass a smaller --block-bytes"
        )
    repeats = max(3, 3 * args.rounds)
    progress(
        f"1/3 prepare_values: scalar reference vs write-up vs aiokv, {args.tokens:,} tokens, "
        f"{repeats} samples each"
    )
    prepare = run_prepare_benchmark(
        args.tokens, args.block_size, args.regions, args.chunk_tokens, repeats, seed=args.seed
    )
    progress(
        f"2/3 loop lag + framework CPU: {args.concurrency} concurrent stores, aiokv vs write-up design, "
        f"{args.rounds} rounds"
    )
    loop_lag = run_loop_lag_benchmark(
        tokens=args.tokens,
        block_size=args.block_size,
        regions=args.regions,
        chunk_tokens=args.chunk_tokens,
        concurrency=args.concurrency,
        rounds=args.rounds,
    )
    progress(
        f"3/3 end to end on {args.backend}: block {_kib(args.block_bytes)} per region, working set "
        f"{_mb(geometry.working_set_bytes)}"
    )
    with open_backend(args, geometry, progress) as backend:
        options = {}
        for name in ("max_regions_per_call", "executor_threads"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
        e2e = run_e2e_benchmark(
            backend, geometry, rounds=args.rounds, progress=progress, seed=args.seed, worker_options=options
        )
    names = "tokens block_size regions chunk_tokens concurrency block_bytes block_bytes_auto backend master"
    names += " rounds max_regions_per_call executor_threads quick seed"
    parameters = {name: getattr(args, name) for name in names.split()}
    report: dict[str, Any] = {
        "machine": machine_info(),
        "versions": versions(),
        "parameters": parameters,
        "prepare": prepare,
        "loop_lag": loop_lag,
        "e2e": e2e,
    }
    report["goals"] = goals(report)
    report["seconds"] = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    args = _resolve(argv)
    started = time.perf_counter()

    def progress(message: str) -> None:
        sys.stderr.write(f"[aiokv bench {time.perf_counter() - started:6.1f}s] {message}\n")
        sys.stderr.flush()

    try:
        report = run_bench(args, progress)
    except (AiokvError, MemoryError, RuntimeError, ImportError, OSError, ValueError) as exc:
        sys.stderr.write(f"aiokv bench failed: {type(exc).__name__}: {exc}\n")
        return 1
    print_report(report, sys.stdout)
    sys.stdout.flush()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        progress(f"wrote {args.json}")
    if args.plot is not None:
        write_plot(report, args.plot)
        progress(f"wrote {args.plot}")
    return 0
