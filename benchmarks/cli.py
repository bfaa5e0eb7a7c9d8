"""``python -m benchmarks``: the long-prompt scenario, aiokv against its baselines, in one run.

1. ``prepare_values``: the scalar per-chunk reference, the vectorised baseline (lists) and
   ``KVLayout.prepare_values`` on the same chunks (plus chunk hashing);
2. event-loop lag and framework CPU of concurrent long-prompt stores with a sleeping, GIL-releasing
   backend: aiokv against the thread-per-request baseline;
3. end to end through the worker on the chosen backend with real bytes: CPU per request, loop lag
   with 1 and N concurrent requests, and throughput against direct backend batch calls on the same
   keys and regions (on Mooncake also the GIL-held time per request).

Progress goes to stderr, the table to stdout; ``--json`` and ``--plot`` write every figure.

Other suites run as ``python -m benchmarks SUITE [options]`` (each has its own ``--help``): see
:data:`SUITES`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from aiokv.errors import AiokvError

from .e2e import Progress, run_e2e_benchmark
from .geometry import DEFAULT_E2E_BUDGET_BYTES, Geometry, choose_block_bytes, store_capacity_bytes
from .loop_lag import run_loop_lag_benchmark
from .prepare import DEFAULT_TOKENS, run_prepare_benchmark
from .report import PLOT_HINT, goals, kib, mb, print_report, write_plot

NAMESPACE_COMMAND = "unshare -rn sh -c 'ip link set lo up && python -m benchmarks --backend mooncake'"


# --quick: a scenario that finishes in seconds (explicit options still win).
_QUICK = {"tokens": 32 * 1024, "regions": 32, "rounds": 2}
_FULL = {"tokens": DEFAULT_TOKENS, "regions": 96, "rounds": 5}


# Suites beside the default one: name -> (module, what it compares). Imported only when asked for.
SUITES = {
    "layouts": ("benchmarks.layouts", "block-major vs layer-major caches: pairs, GIL, loop lag, GB/s"),
    "layouts-xproc": ("benchmarks.layouts_xproc", "prefill -> decode across processes on Mooncake"),
    "vllm": ("benchmarks.vllm", "AiokvConnector vs vLLM's MooncakeStoreConnector on real engines"),
    "vllm-tier": ("benchmarks.vllm_tier", "TTFT of a host-tier hit against the same hit from Mooncake"),
    "vllm-throttle": (
        "benchmarks.vllm_throttle",
        "TTFT of a hit across link rates: declining slow hits vs loading them vs recompute",
    ),
    "cluster": ("benchmarks.cluster", "cross-node GB/s (worker vs direct) and recovery times in namespaces"),
    "scale": ("benchmarks.scale", "loop stalls finishing 10,000 requests and a 62,500-key prompt"),
    "handoff": ("benchmarks.handoff", "an engine thread's cost to submit a step: store() vs store_many()"),
    "checksums": (
        "benchmarks.checksums",
        "checksum libraries for verified values: GB/s vs memcpy, GIL release",
    ),
    "verify-cost": (
        "benchmarks.verify_cost",
        "verified values on vs off: store and load wall and CPU per request",
    ),
    "mooncake-conversion": (
        "benchmarks.mooncake_conversion",
        "the Mooncake binding's argument conversion (GIL held) per argument form, one large batch",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The long-prompt scenario (289K tokens, block 128, 96 regions): the scalar "
        "reference, the vectorised baseline and aiokv side by side, then end to end through "
        "the worker with real bytes against direct backend calls.",
        epilog=f"Mooncake without --master starts a loopback master; run it in a private network "
        f"namespace: {NAMESPACE_COMMAND}. Other suites: "
        + "; ".join(f"`{name} --help`: {what}" for name, (_, what) in SUITES.items()),
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
    from aiokv import __version__

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
        from aiokv.backends.memory import MemoryBackend

        backend = MemoryBackend(capacity_bytes=capacity)
        try:
            yield backend
        finally:
            backend.close()
        return
    from aiokv.backends.mooncake import MooncakeBackend
    from aiokv.backends.mooncake_master import MooncakeMaster

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
        mooncake = MooncakeBackend.from_master(address, global_segment_size=capacity)
        stack.callback(mooncake.close)
        progress(f"mooncake: client connected to {address}, segment {capacity / 2**20:.0f} MiB")
        yield mooncake
    progress("mooncake: client closed" + ("" if args.master else ", master stopped"))


# -- output ---------------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    started = time.perf_counter()
    geometry = _geometry(args)
    available = _available_memory()
    if available is not None and geometry.working_set_bytes > 0.8 * available:
        raise MemoryError(
            f"the e2e working set ({mb(geometry.working_set_bytes)}) is more than 80% of the available "
            f"memory ({mb(available)}): pass a smaller --block-bytes"
        )
    repeats = max(3, 3 * args.rounds)
    progress(
        f"1/3 prepare_values: scalar reference vs vectorised baseline vs aiokv, {args.tokens:,} tokens, "
        f"{repeats} samples each"
    )
    prepare = run_prepare_benchmark(
        args.tokens, args.block_size, args.regions, args.chunk_tokens, repeats, seed=args.seed
    )
    progress(
        f"2/3 loop lag + framework CPU: {args.concurrency} concurrent stores, aiokv vs thread-per-request "
        f"baseline, {args.rounds} rounds"
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
        f"3/3 end to end on {args.backend}: block {kib(args.block_bytes)} per region, working set "
        f"{mb(geometry.working_set_bytes)}"
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
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUITES:
        suite = importlib.import_module(SUITES[argv[0]][0])
        return int(suite.main(argv[1:]))
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
