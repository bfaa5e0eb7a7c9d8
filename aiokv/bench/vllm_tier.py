"""``python -m aiokv.bench.vllm_tier``: time to first token of a hit from the host-memory tier against
the same hit from Mooncake, in one run (``backend: "tiered"``, docs/vllm.md#the-host-memory-tier).

A fresh Mooncake master and a holder process mounting the store's segment (so a Mooncake load crosses
processes over TCP, as in ``bench vllm``). Engine A (tiered) stores the prompts (into its tier and
Mooncake). Engine B (tiered, a fresh process: its tier starts empty) takes each prompt with vLLM's
prefix cache cleared: the first time it hits Mooncake (and promotes the blocks into its tier), the
second time its tier. Engine C (``backend: "mooncake"``, no tier) hits each prompt from Mooncake once:
the Mooncake hit without the promotion's copy. The first prompt warms the paths up and is not counted. Both
engines are in-process engines (``aiokv.bench.vllm_engine``), so a request's CPU seconds cover the
engine and aiokv's threads. Greedy tokens must equal engine A's computed ones. Run inside a private
network namespace (Mooncake listens on every interface):
``unshare -rn sh -c 'ip link set lo up && exec python -m aiokv.bench.vllm_tier'``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .vllm import engine_env, kv_transfer_config, mooncake_store
from .vllm_workload import BLOCK_SIZE, MODEL_SHAPE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aiokv.bench.vllm_tier", description=__doc__)
    parser.add_argument("--tokens", type=int, default=7777, help="prompt length (default 7,777: unaligned)")
    parser.add_argument("--prompts", type=int, default=6, help="distinct prompts, each hit once per tier")
    parser.add_argument("--chunk-blocks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    return parser


def _engine(spec_path: str, result_path: str) -> None:
    """One engine (its own process): ``spec["role"]`` "store" or "load"."""
    from ..integrations.vllm.amx import allow_amx_tiles
    from .vllm_engine import EngineDriver, build_llm

    allow_amx_tiles()
    spec = json.loads(Path(spec_path).read_text())
    driver = EngineDriver(build_llm(spec))
    warmup = {"name": "warmup", "ids": list(range(3, 3 + 3 * BLOCK_SIZE)), "max_tokens": 1}
    driver.run([warmup])
    hits: list[dict[str, Any]] = []
    for n, ids in enumerate(spec["prompts"]):
        prompt = {"name": f"p{n}", "ids": ids, "max_tokens": 1}
        # The tier holds a prompt only once a Mooncake hit promoted it: that order is fixed.
        sources = {"store": ["store"], "load": ["mooncake", "tier"], "plain": ["plain-mooncake"]}[
            spec["role"]
        ]
        for source in sources:
            driver.clear_prefix_cache()
            record = driver.run([prompt])
            (request,) = record.requests
            hits.append(
                {
                    "prompt": n,
                    "source": source,
                    "ttft_s": (request.first_token or record.outputs_done) - request.added,
                    "cpu_s": record.cpu_seconds,
                    "cached_tokens": request.cached_tokens,
                    "tokens": request.tokens,
                }
            )
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stats = get_kv_transfer_group().stats()  # type: ignore[attr-defined]  # AiokvConnector's
    Path(result_path).write_text(json.dumps({"hits": hits, "stats": stats}))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.engine:
        _engine(*args.engine)
        return 0
    import random

    from ..integrations.vllm.tiny_model import write_tiny_llama

    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, MODEL_SHAPE["vocab_size"]) for _ in range(args.tokens)] for _ in range(args.prompts)
    ]
    block_bytes = (
        2 * MODEL_SHAPE["num_layers"] * MODEL_SHAPE["num_kv_heads"] * MODEL_SHAPE["head_dim"] * 2 * BLOCK_SIZE
    )
    stored = block_bytes * (args.tokens // BLOCK_SIZE) * args.prompts
    with (
        tempfile.TemporaryDirectory(prefix="aiokv-bench-tier-") as tmp,
        mooncake_store(max(512 << 20, 2 * stored)) as address,
    ):
        workdir = Path(tmp)
        model = write_tiny_llama(workdir / "model", **MODEL_SHAPE, seed=args.seed)
        config_path = workdir / "mooncake.json"
        config_path.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": address,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "64MB",
                }
            )
        )
        tiered = {
            "backend": "tiered",
            "memory_capacity": stored + (64 << 20),
            "chunk_blocks": args.chunk_blocks,
        }
        results = {}
        for role in ("store", "load", "plain"):
            extra = tiered if role != "plain" else {"chunk_blocks": args.chunk_blocks}  # Mooncake alone
            spec = {
                "role": role,
                "model": str(model),
                "max_model_len": args.tokens + 64,
                "prompts": prompts,
                "kv_transfer_config": kv_transfer_config("aiokv", json.loads(config_path.read_text()), extra),
            }
            spec_path, result_path = workdir / f"{role}.spec.json", workdir / f"{role}.result.json"
            spec_path.write_text(json.dumps(spec))
            env = engine_env(config_path, 2)
            started = time.perf_counter()
            with (workdir / f"{role}.log").open("wb") as log:
                code = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "aiokv.bench.vllm_tier",
                        "--engine",
                        str(spec_path),
                        str(result_path),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=False,
                ).returncode
            if code != 0:
                sys.stderr.write((workdir / f"{role}.log").read_text()[-4000:])
                raise SystemExit(f"engine {role} exited {code}")
            results[role] = json.loads(result_path.read_text())
            print(f"{role}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps(summarize(results, args), indent=2))
    return 0


def summarize(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    computed = {hit["prompt"]: hit["tokens"] for hit in results["store"]["hits"]}
    by_source: dict[str, list[dict[str, Any]]] = {"mooncake": [], "tier": [], "plain-mooncake": []}
    for hit in results["load"]["hits"] + results["plain"]["hits"]:
        if hit["tokens"] != computed[hit["prompt"]]:
            raise SystemExit(
                f"prompt {hit['prompt']} from {hit['source']}: tokens differ from the computed ones"
            )
        if hit["prompt"] > 0:  # the first prompt warms both paths up
            by_source[hit["source"]].append(hit)
    out: dict[str, Any] = {"tokens": args.tokens, "prompts": args.prompts, "chunk_blocks": args.chunk_blocks}
    for source, hits in by_source.items():
        out[source] = {
            "ttft_s_median": statistics.median(h["ttft_s"] for h in hits),
            "cpu_s_median": statistics.median(h["cpu_s"] for h in hits),
            "ttft_s": [round(h["ttft_s"], 4) for h in hits],
            "cached_tokens": sorted({h["cached_tokens"] for h in hits}),
        }
    out["ttft_ratio_tier_over_mooncake"] = out["tier"]["ttft_s_median"] / out["mooncake"]["ttft_s_median"]
    out["cpu_ratio_tier_over_mooncake"] = out["tier"]["cpu_s_median"] / out["mooncake"]["cpu_s_median"]
    # The tiered engine's Mooncake hit also promotes its blocks; an engine without a tier does not.
    plain = out["plain-mooncake"]
    out["ttft_ratio_tier_over_plain_mooncake"] = out["tier"]["ttft_s_median"] / plain["ttft_s_median"]
    out["cpu_ratio_tier_over_plain_mooncake"] = out["tier"]["cpu_s_median"] / plain["cpu_s_median"]
    out["host_tier"] = results["load"]["stats"].get("host_tier")
    out["store_chunks_loaded"] = results["load"]["stats"].get("chunks", {}).get("loaded")
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
