"""``python -m benchmarks vllm-tier``: time to first token of a hit from the host-memory tier against
the same hit from Mooncake, in one run (``backend: "tiered"``, docs/vllm.md#the-host-memory-tier).

A fresh Mooncake master and a holder process mounting the store's segment (so a Mooncake load crosses
processes over TCP, as in ``bench vllm``). Engine A (tiered) computes and stores the prompts (into its
tier and Mooncake). Then engines B (tiered, its tier empty) and C (``backend: "mooncake"``, no tier)
run side by side, each prompt's hits back to back, with vLLM's prefix cache cleared before each: B
hits Mooncake (and promotes the blocks into its tier) then its tier; C hits Mooncake (the same hit
without the promotion's copy), before B on every other prompt. So a burst of load on a shared machine
hits all three alike. The first prompt warms the paths up and is not counted. Every engine is an
in-process engine (``benchmarks.vllm_engine``), so a request's CPU seconds cover the engine and
aiokv's threads. Greedy tokens must equal engine A's computed ones. Run inside a private
network namespace (Mooncake listens on every interface):
``unshare -rn sh -c 'ip link set lo up && exec python -m benchmarks vllm-tier'``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .vllm import engine_env
from .vllm_setup import kv_transfer_config, mooncake_store
from .vllm_workload import BLOCK_SIZE, MODEL_SHAPE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks vllm-tier", description=__doc__)
    parser.add_argument("--tokens", type=int, default=7777, help="prompt length (default 7,777: unaligned)")
    parser.add_argument("--prompts", type=int, default=6, help="distinct prompts, each hit once per tier")
    parser.add_argument("--chunk-blocks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def _engine(spec_path: str) -> None:
    """One engine (its own process), driven by its parent: a JSON command per stdin line (``hit`` a
    prompt with vLLM's prefix cache cleared, ``stats``, ``quit``), each answered by one stdout line
    starting with ``@@`` (vLLM's own log lines go to stdout too)."""
    from aiokv.integrations.vllm.common.amx import allow_amx_tiles

    from .vllm_engine import EngineDriver, build_llm

    allow_amx_tiles()
    spec = json.loads(Path(spec_path).read_text())
    driver = EngineDriver(build_llm(spec))
    driver.run([{"name": "warmup", "ids": list(range(3, 3 + 3 * BLOCK_SIZE)), "max_tokens": 1}])
    print("@@{}", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        answer: dict[str, Any] = {}
        if command["op"] == "quit":
            break
        if command["op"] == "stats":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            answer = get_kv_transfer_group().stats()  # type: ignore[attr-defined]  # AiokvConnector's
        else:
            n = command["prompt"]
            driver.clear_prefix_cache()
            record = driver.run([{"name": f"p{n}", "ids": spec["prompts"][n], "max_tokens": 1}])
            (request,) = record.requests
            answer = {
                "prompt": n,
                "source": command["source"],
                "ttft_s": (request.first_token or record.outputs_done) - request.added,
                "cpu_s": record.cpu_seconds,
                "cached_tokens": request.cached_tokens,
                "tokens": request.tokens,
            }
        print("@@" + json.dumps(answer), flush=True)


class EngineProcess:
    """A running engine process (:func:`_engine` of ``module``); its other output goes to ``log``.
    ``popen``: how to start it (another network namespace's, say)."""

    def __init__(
        self,
        spec_path: Path,
        env: dict[str, str],
        log: Path,
        *,
        module: str = "benchmarks.vllm_tier",
        popen: Callable[..., subprocess.Popen[str]] = subprocess.Popen,
    ) -> None:
        self._log = log.open("w")
        command = [sys.executable, "-m", module, "--engine", str(spec_path)]
        self._process = popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if self._process.stdin is None or self._process.stdout is None:
            raise RuntimeError("the engine process has no pipes")
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        self._answer()  # ready

    def _answer(self) -> dict[str, Any]:
        for line in self._stdout:
            if line.startswith("@@"):
                answer: dict[str, Any] = json.loads(line[2:])
                return answer
            self._log.write(line)
        self._log.close()
        raise SystemExit(f"an engine exited {self._process.wait()}: see {self._log.name}")

    def ask(self, **command: Any) -> dict[str, Any]:
        self._stdin.write(json.dumps(command) + "\n")
        self._stdin.flush()
        return self._answer()

    def close(self) -> None:
        self._stdin.write(json.dumps({"op": "quit"}) + "\n")
        self._stdin.close()
        self._process.wait(timeout=120)
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.engine:
        _engine(args.engine)
        return 0
    import random

    from aiokv.testing.tiny_model import write_tiny_llama

    rng = random.Random(args.seed)
    vocab = MODEL_SHAPE["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.tokens)] for _ in range(args.prompts)]
    layers, heads, head_dim = MODEL_SHAPE["num_layers"], MODEL_SHAPE["num_kv_heads"], MODEL_SHAPE["head_dim"]
    block_bytes = 2 * layers * heads * head_dim * 2 * BLOCK_SIZE  # K and V, bf16
    stored = block_bytes * (args.tokens // BLOCK_SIZE) * args.prompts
    segment = max(512 << 20, 2 * stored)
    with tempfile.TemporaryDirectory(prefix="aiokv-bench-tier-") as tmp, mooncake_store(segment) as address:
        workdir = Path(tmp)
        model = write_tiny_llama(workdir / "model", **MODEL_SHAPE, seed=args.seed)
        store_config = {
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": address,
            "protocol": "tcp",
            "device_name": "",
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": "64MB",
        }
        tiered = {
            "backend": "tiered",
            "memory_capacity": stored + (64 << 20),
            "chunk_blocks": args.chunk_blocks,
        }
        plain = {"chunk_blocks": args.chunk_blocks}  # Mooncake alone

        def start(role: str, extra: dict[str, Any]) -> EngineProcess:
            spec = {
                "model": str(model),
                "max_model_len": args.tokens + 64,
                "prompts": prompts,
                "kv_transfer_config": kv_transfer_config("aiokv", store_config, extra),
            }
            spec_path = workdir / f"{role}.spec.json"
            spec_path.write_text(json.dumps(spec))
            return EngineProcess(spec_path, engine_env(None, 2), workdir / f"{role}.log")

        started = time.perf_counter()
        storing = start("store", tiered)
        computed = [storing.ask(op="hit", prompt=n, source="store")["tokens"] for n in range(args.prompts)]
        storing.close()
        print(f"stored: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        tier_engine, plain_engine = start("tiered", tiered), start("plain", plain)
        hits = []
        for n in range(args.prompts):
            # Each prompt's three hits run back to back (the tiered engine's Mooncake hit first: it is
            # what puts the prompt into its tier), the engine without a tier first on every other one.
            tiered_hits = [("mooncake", tier_engine), ("tier", tier_engine)]
            order = (
                [("plain-mooncake", plain_engine), *tiered_hits]
                if n % 2
                else [*tiered_hits, ("plain-mooncake", plain_engine)]
            )
            hits += [engine.ask(op="hit", prompt=n, source=source) for source, engine in order]
        stats = tier_engine.ask(op="stats")
        tier_engine.close()
        plain_engine.close()
        print(f"hit: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(json.dumps(summarize(computed, hits, stats, args), indent=2))
    return 0


def summarize(
    computed: list[list[int]], hits: list[dict[str, Any]], stats: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    by_source: dict[str, list[dict[str, Any]]] = {"mooncake": [], "tier": [], "plain-mooncake": []}
    for hit in hits:
        if hit["tokens"] != computed[hit["prompt"]]:
            raise SystemExit(
                f"prompt {hit['prompt']} from {hit['source']}: tokens differ from the computed ones"
            )
        if hit["prompt"] > 0:  # the first prompt warms the paths up
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
    out["host_tier"] = stats.get("host_tier")
    out["store_chunks_loaded"] = stats.get("chunks", {}).get("loaded")
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
