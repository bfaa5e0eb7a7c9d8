"""``python -m benchmarks vllm``: AiokvConnector against vLLM's own MooncakeStoreConnector on a real
vLLM engine, and against recomputing, in one run on one model and one workload.

Per configuration (``recompute``: no connector; ``vllm``: ``MooncakeStoreConnector``; ``aiokv``:
``AiokvConnector``; ``aiokv-vllm-keys``: it with ``"key_format": "vllm"``; ``aiokv-unverified``: it with
``"verify_values": false``, against which ``aiokv``'s cost of verified values is measured;
``aiokv-full-blocks``: it with ``"store_prompt_tails": false``, full blocks only as before prompts'
last partial blocks were stored) a fresh
Mooncake master and a holder process that mounts the store's segment, so every load and store crosses
processes over TCP (standalone-store mode: the engines mount nothing). One engine process stores, a
second one loads; each is its own subprocess running the in-process engine (``benchmarks.vllm_engine``).
Greedy tokens must be equal in every configuration, or the run fails.

Mooncake opens sockets on all interfaces: the benchmark runs in a private network namespace, re-running
itself under ``unshare -rn`` when it is not in one. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .vllm_figures import (
    Geometry,
    check_outputs,
    format_table,
    hit_boundaries,
    median_figures,
    round_figures,
    summarize,
)
from .vllm_setup import kv_transfer_config, mooncake_config, mooncake_store, rerun_in_namespace
from .vllm_workload import BLOCK_SIZE, MODEL_SHAPE, build_workload, stored_bytes_estimate

logger = logging.getLogger("benchmarks.vllm")

CONFIGS = ("recompute", "vllm", "aiokv", "aiokv-vllm-keys", "aiokv-unverified", "aiokv-full-blocks")
AIOKV_CONFIGS = ("aiokv", "aiokv-vllm-keys", "aiokv-unverified", "aiokv-full-blocks")
CHECKOUT = Path(__file__).resolve().parent.parent  # the repository root: benchmarks are not installed
ENGINE_TIMEOUT_S = 1200.0

# With glibc's defaults an engine faults its activations in anew each prefill step (~50,000 4 KiB
# pages in an 8K step here, 3x that in some engine instances: +0.3-1 s, whatever the connector).
# Transparent huge pages for malloc's memory cut that to a few hundred faults, and both connectors'
# stores ran faster with them too (docs/benchmarks.md); every configuration runs with the same setting.
ENGINE_MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks vllm",
        description="AiokvConnector vs vLLM's MooncakeStoreConnector vs recompute on a real vLLM engine: "
        "TTFT on a hit, throughput, step-time inflation, GB/s and CPU per request, across processes.",
    )
    parser.add_argument(
        "--prompt-tokens",
        default="2000,6000,7777",
        help="long prompt sizes, comma-separated (default 2000,6000,7777: lengths users send, not multiples "
        "of a block or chunk, so a connector that stores only whole chunks shows its lost hit tokens)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="loads of each long prompt (default 3)")
    parser.add_argument(
        "--store-repeats",
        type=int,
        default=3,
        help="cold prompts of each size in the storing engine, each with its own tokens; store figures "
        "are their medians (default 3)",
    )
    parser.add_argument(
        "--recompute-repeats", type=int, default=1, help="runs of each long prompt without a connector (1)"
    )
    parser.add_argument(
        "--output-tokens", type=int, default=16, help="greedy tokens per request (default 16)"
    )
    parser.add_argument(
        "--probe-tokens", type=int, default=8192, help="prompt stored during the step probe (8192)"
    )
    parser.add_argument("--probe-steps", type=int, default=48, help="decode steps of the probe request")
    parser.add_argument("--prefixes", type=int, default=2, help="shared prefixes in the mixed workload")
    parser.add_argument("--per-prefix", type=int, default=4, help="concurrent requests per prefix")
    parser.add_argument("--prefix-tokens", type=int, default=1999, help="tokens per shared prefix (1999)")
    parser.add_argument("--suffix-tokens", type=int, default=301, help="own tokens per mixed request (301)")
    parser.add_argument("--layers", type=int, default=MODEL_SHAPE["num_layers"], help="model layers (16)")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (default 2)")
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="a hybrid model instead: even layers attend over this many tokens, odd ones over everything "
        "(vLLM's hybrid allocator on, one KV cache group per kind; default 0: every layer full)",
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of the connector configurations, order alternating; figures are the medians (default 1)",
    )
    parser.add_argument(
        "--aiokv-extra",
        type=json.loads,
        default={},
        help="JSON object merged into AiokvConnector's kv_connector_extra_config (both aiokv configs), "
        "e.g. '{\"executor_threads\": 2}'",
    )
    parser.add_argument(
        "--malloc-tunables",
        default=ENGINE_MALLOC_TUNABLES,
        help="GLIBC_TUNABLES for every engine process (default %(default)s: transparent huge pages for "
        "malloc, so a prefill step does not fault in its activations 4 KiB at a time; '' for glibc's "
        "defaults)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every figure and raw timing here")
    parser.add_argument("--keep", type=Path, help="keep the model, specs, results and logs in this folder")
    parser.add_argument(
        "--no-unshare", action="store_true", help="fail instead of re-running under unshare -rn"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


# -- store and engines ----------------------------------------------------------------------------


def engine_env(config_path: Path | None, kv_cache_gib: int, malloc_tunables: str = "") -> dict[str, str]:
    env = dict(os.environ)
    if malloc_tunables:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), malloc_tunables)))
    # The engine processes run `-m benchmarks.vllm_engine`: the checkout (benchmarks are not installed)
    # goes first on their path, whatever the current directory.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CHECKOUT), env.get("PYTHONPATH"))))
    env |= {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
        # Without these a batch of more than ~1024 slices to one peer hangs 60 s (../shared/mooncake.md).
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
        "MC_STORE_CLIENT_SETUP_RETRIES": "3",
    }
    if config_path is not None:
        env["MOONCAKE_CONFIG_PATH"] = str(config_path)
    return env


def run_engine(spec: dict[str, Any], workdir: Path, tag: str, env: dict[str, str]) -> dict[str, Any]:
    spec_path, result_path, log_path = (
        workdir / f"{tag}.{ext}" for ext in ("spec.json", "result.json", "log")
    )
    spec_path.write_text(json.dumps(spec))
    started = time.perf_counter()
    with log_path.open("wb") as log:
        process = subprocess.run(
            [sys.executable, "-m", "benchmarks.vllm_engine", str(spec_path), str(result_path)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    if process.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"engine {tag} failed (exit {process.returncode}); log tail:\n" + "\n".join(tail))
    logger.info("engine %s done in %.1f s", tag, time.perf_counter() - started)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def run_config(
    name: str,
    workload: dict[str, Any],
    model: Path,
    workdir: Path,
    args: argparse.Namespace,
    segment: int,
    *,
    tag: str,
    roles: tuple[str, ...] = ("store", "load"),
    load_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``roles``' engines one after the other on one fresh store (none for ``recompute``)."""
    base = {"model": str(model), "max_model_len": workload["max_model_len"]}
    with contextlib.ExitStack() as stack:
        config_path: Path | None = None
        transfer: dict[str, Any] | None = None
        if name != "recompute":
            address = stack.enter_context(mooncake_store(segment))
            store_config = mooncake_config(address)
            config_path = workdir / f"{tag}.mooncake.json"
            config_path.write_text(json.dumps(store_config))
            transfer = kv_transfer_config(name, store_config, args.aiokv_extra)
        env = engine_env(config_path, args.kv_cache_gib, args.malloc_tunables)
        result: dict[str, Any] = {"connector": transfer}
        for role in roles:
            logger.info("%s: %s engine", tag, role)
            spec = {**base, **workload[role], "role": role, "kv_transfer_config": transfer}
            if role == "load":
                spec |= load_extra or {}
            result[role] = run_engine(spec, workdir, f"{tag}.{role}", env)
        return result


def model_layer_types(layers: int, sliding_window: int) -> tuple[str, ...] | None:
    """Each layer's kind for ``--sliding-window`` (even layers windowed), or None for a plain Llama."""
    if sliding_window <= 0:
        return None
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))


def write_model(
    path: Path, shape: dict[str, int], layer_types: tuple[str, ...] | None, args: argparse.Namespace
) -> Path:
    from aiokv.testing.tiny_model import write_tiny_llama, write_tiny_sliding_llama

    if layer_types is None:
        return write_tiny_llama(path, **shape, seed=args.seed)
    llama = {name: size for name, size in shape.items() if name != "num_layers"}
    return write_tiny_sliding_llama(
        path, sliding_window=args.sliding_window, layer_types=layer_types, seed=args.seed, **llama
    )


# -- report ---------------------------------------------------------------------------------------


def aiokv_available() -> str | None:
    """Why AiokvConnector cannot run here, or None."""
    # Located, not imported: importing the connector imports vLLM (seconds); the engines import it.
    try:
        if importlib.util.find_spec("aiokv.integrations.vllm.connector") is None:
            return "aiokv.integrations.vllm.connector (AiokvConnector) is not installed"
    except ImportError as exc:
        return f"aiokv.integrations.vllm is not installed: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    if "--http" in args_list:  # under vLLM's OpenAI server, over HTTP (benchmarks.vllm_http)
        from .vllm_http import main as http_main

        return http_main([arg for arg in args_list if arg != "--http"])
    args = _parser().parse_args(args_list)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(message)s",
        stream=sys.stderr,
    )
    from .cli import _private_namespace

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or "recompute" not in configs:
        raise SystemExit(f"--configs must name recompute and any of {', '.join(CONFIGS)}; got {unknown}")
    needs_store = any(c != "recompute" for c in configs)
    if needs_store and not _private_namespace():
        return 2 if args.no_unshare else rerun_in_namespace(args_list)
    missing = aiokv_available()
    if missing is not None and any(c in AIOKV_CONFIGS for c in configs):
        logger.warning("AiokvConnector left out: %s", missing)
        configs = [c for c in configs if c not in AIOKV_CONFIGS]

    shape = dict(MODEL_SHAPE, num_layers=args.layers)
    layer_types = model_layer_types(args.layers, args.sliding_window)
    # GB/s figures count the full-attention layers' blocks: a sliding-window layer keeps (and a hit
    # loads) only the blocks of its window, a few per request whatever the prompt's length.
    full_layers = layer_types.count("full_attention") if layer_types else shape["num_layers"]
    block_bytes = BLOCK_SIZE * full_layers * 2 * shape["num_kv_heads"] * shape["head_dim"] * 2
    geometry = Geometry(BLOCK_SIZE, block_bytes)
    workload = build_workload(args)
    segment = max(512 << 20, 2 * stored_bytes_estimate(workload, block_bytes))
    with contextlib.ExitStack() as stack:
        workdir = args.keep or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="aiokv-bench-vllm-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        model = write_model(workdir / "model", shape, layer_types, args)
        reference = run_config(
            "recompute", workload, model, workdir, args, segment, tag="recompute", roles=("store",)
        )
        connectors = [c for c in configs if c != "recompute"]
        rounds: list[dict[str, dict[str, Any]]] = []
        for number in range(1, args.rounds + 1):
            # Alternate the order so that a machine getting busier or quieter favours no connector.
            order = connectors if number % 2 else connectors[::-1]
            rounds.append(
                {
                    name: run_config(name, workload, model, workdir, args, segment, tag=f"{name}.r{number}")
                    for name in order
                }
            )
        # The reference loads last: it reproduces every hit boundary the connectors produced.
        boundaries = hit_boundaries(
            {f"{i}{n}": r for i, rs in enumerate(rounds) for n, r in rs.items()}, BLOCK_SIZE
        )
        load_extra = {"repeats": args.recompute_repeats, "boundaries": boundaries}
        reference |= run_config(
            "recompute",
            workload,
            model,
            workdir,
            args,
            segment,
            tag="recompute",
            roles=("load",),
            load_extra=load_extra,
        )
        rounds = [{"recompute": reference, **results} for results in rounds]
    per_round = [round_figures(results, geometry) for results in rounds]
    summary = summarize(median_figures(per_round))
    checks = [check_outputs(results, "recompute", BLOCK_SIZE) for results in rounds]
    wrong = sorted({problem for problems, _, _ in checks for problem in problems})
    diverged = sorted({problem for _, problems, _ in checks for problem in problems})
    unverified = {name: sum(counts.get(name, 0) for _, _, counts in checks) for name in configs}
    summary |= {
        "mismatches": wrong + diverged,
        "wrong_outputs": wrong,
        "diverged_outputs": diverged,
        "unverified_requests": unverified,
        "configs": configs,
        "aiokv_missing": missing,
        "per_round": per_round,
    }
    summary["setup"] = {
        "model": shape | {"layer_types": layer_types, "sliding_window": args.sliding_window},
        "block_bytes": block_bytes,
        "args": vars(args) | {"json": None, "keep": None},
    }
    sys.stdout.write(format_table(summary))
    for problem in wrong:
        sys.stdout.write(f"WRONG OUTPUT {problem}\n")
    for problem in diverged:
        sys.stdout.write(f"DIVERGED LATER {problem}\n")
    verdict = "all equal" if not wrong + diverged else f"{len(wrong)} wrong, {len(diverged)} diverged later"
    sys.stdout.write(
        f"greedy tokens vs the run without a connector at the same hit boundary: {verdict}; "
        f"requests with no reference at their boundary: {unverified}\n"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "raw": rounds}, indent=1, default=str))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
