"""AiokvConnector with the embedded store in one in-process engine: offload beyond vLLM's own prefix
cache. Prompts are stored, vLLM's prefix cache is dropped, and the prompts come back from the store,
one alone and four sharing a prefix at once (synchronous loads, so the four compute in one step, as
in the reference run). Outputs equal those of vLLM reusing its own KV for the same tokens: the same
greedy tokens, logprobs within the spread this CPU shows between computing a prompt whole and behind
its cached prefix, with tens of tokens and with one token left to compute (the controls,
``support.greedy_tolerance``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import (
    BLOCK,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    one_token_left_pairs,
    one_token_left_steps,
    require_vllm,
    run_engine,
    tokens,
)

PROMPT = tokens(40, 2100)  # 16 full blocks and 52 tokens
# Each shares 12 blocks with PROMPT and has 4 full blocks and 88 tokens of its own.
SHARED = [PROMPT[:1536] + tokens(41 + i, 600) for i in range(4)]
EXACT = tokens(50, 16 * BLOCK)  # exactly 16 blocks: the last token ends the last block


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model, written once for every engine of the module."""
    require_vllm()
    return write_tiny_llama(tmp_path_factory.mktemp("vllm-embedded-model") / "tiny-llama")


def embedded_engine(
    tmp_path_factory: pytest.TempPathFactory,
    model: Path,
    name: str,
    steps: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """One in-process engine with AiokvConnector on the embedded store, running ``steps``."""
    config = {"backend": "memory", "memory_capacity": "64MiB", "lookup_wait_s": 2.0, **extra}
    return run_engine(
        tmp_path_factory.mktemp(f"vllm-{name}"),
        name,
        model=model,
        kv_transfer_config=connector(config),
        steps=steps,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, model: Path) -> dict[str, Any]:
    return embedded_engine(
        tmp_path_factory,
        model,
        "embedded",
        load_async=False,
        steps=[
            generate("computed", [PROMPT]),
            # vLLM's own prefix cache: what the reloads below must equal.
            generate("warm", [PROMPT]),
            generate("shared_first", SHARED),  # computes and stores their own chunks
            generate("shared_warm", SHARED),
            generate("exact_computed", [EXACT]),
            {"op": "flush"},
            {"op": "evict"},
            # Counters before the reloads: a "warm" step may itself load a prompt's last partial block,
            # stored as the step before it ended, if its lookup is asked again after that store.
            {"op": "stats", "name": "before_reloads"},
            generate("reloaded", [PROMPT]),
            generate("exact_reloaded", [EXACT]),
            {"op": "evict"},
            generate("shared_reloaded", SHARED),
            {"op": "stats"},
        ],
    )


@pytest.fixture(scope="module")
def tolerance(run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, model: Path) -> float:
    """The tolerance from controls on this CPU: every prompt computed whole, then behind vLLM's own
    cached prefix, in the run's engine; and, in an engine without a connector, each prompt's
    one-token-left control (the synchronous reloads below leave one token to compute)."""
    pairs = [(run["computed"]["outputs"][0], run["warm"]["outputs"][0])]
    pairs += list(zip(run["shared_first"]["outputs"], run["shared_warm"]["outputs"], strict=True))
    prompts = [PROMPT, *SHARED, EXACT]
    root = tmp_path_factory.mktemp("vllm-embedded-control")
    numerics = run_engine(root, "one-token-left", model=model, steps=one_token_left_steps(prompts))
    return greedy_tolerance(pairs + one_token_left_pairs(numerics, len(prompts)))


def test_store_evict_reload(run: dict[str, Any], tolerance: float) -> None:
    assert run["evict"] is True  # vLLM's prefix cache was dropped: the hits below are the store's
    (computed,) = run["computed"]["outputs"]
    (warm,) = run["warm"]["outputs"]
    (reloaded,) = run["reloaded"]["outputs"]
    assert computed["cached"] == 0 and warm["cached"] == 16 * BLOCK
    # Every full block and the last partial block, loaded synchronously: all but the last token.
    assert reloaded["cached"] == len(PROMPT) - 1
    assert_same_greedy(reloaded, warm, tolerance, "reloaded against warm")
    assert_same_greedy(reloaded, computed, tolerance, "reloaded against computed")


def test_concurrent_requests_sharing_a_prefix(run: dict[str, Any], tolerance: float) -> None:
    """All four at once: the first loads the shared chunks, vLLM lets the others reuse those blocks
    in the same step, and every request loads its own chunks and last partial block: four loads in
    one step (a synchronous load leaves the last token to compute)."""
    reloaded = run["shared_reloaded"]["outputs"]
    assert [out["cached"] for out in reloaded] == [len(prompt) - 1 for prompt in SHARED]
    for got, want in zip(reloaded, run["shared_warm"]["outputs"], strict=True):
        assert want["cached"] == 16 * BLOCK
        assert_same_greedy(got, want, tolerance, "a shared-prefix request reloaded")
    loads = run["stats"]["events"]["loads_submitted"] - run["before_reloads"]["events"].get(
        "loads_submitted", 0
    )
    assert loads == 1 + 1 + 4


def test_synchronous_load_of_an_exact_block_multiple_leaves_one_token(run: dict[str, Any]) -> None:
    """A synchronous load is scheduled with the computation that follows it: vLLM must get a token to
    compute, so the hit is every token but the last (all 16 blocks are loaded; the forward rewrites
    the last slot). vLLM's own prefix cache would reuse only 15 blocks here."""
    (computed,) = run["exact_computed"]["outputs"]
    (reloaded,) = run["exact_reloaded"]["outputs"]
    assert computed["cached"] == 0 and reloaded["cached"] == 16 * BLOCK - 1
    assert reloaded["tokens"] == computed["tokens"]
    assert run["stats"]["events"].get("load_error_blocks", 0) == 0


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory, model: Path) -> dict[str, Any]:
    return embedded_engine(
        tmp_path_factory,
        model,
        "embedded-async",
        steps=[
            generate("computed", [EXACT]),
            generate("warm", [EXACT]),  # the control: vLLM's own prefix cache reuses 15 blocks
            {"op": "flush"},
            {"op": "evict"},
            # Counters before the reload: "warm" may itself load its 16th block (one key per block; its
            # 15 cached blocks end on a key boundary) if "computed"'s store landed before its lookup.
            {"op": "stats", "name": "before"},
            generate("reloaded", [EXACT]),
            {"op": "stats"},
        ],
    )


def test_asynchronous_load_hits_the_whole_prompt(async_run: dict[str, Any], tolerance: float) -> None:
    """An asynchronous load may cover every token: once it lands vLLM recomputes only the last token
    (into the loaded last block) to sample from. 16 blocks loaded where vLLM's own prefix cache and
    its Mooncake connector reuse 15; the greedy tokens equal those computed without any load."""
    (computed,) = async_run["computed"]["outputs"]
    (reloaded,) = async_run["reloaded"]["outputs"]
    assert computed["cached"] == 0 and reloaded["cached"] == 16 * BLOCK
    assert reloaded["tokens"] == computed["tokens"]
    # Only the last token's KV is computed anew; the controls: the same prompt behind vLLM's own
    # cached prefix (15 blocks) against computed whole, and the module's (one token left among them).
    (warm,) = async_run["warm"]["outputs"]
    whole_hit = max(tolerance, greedy_tolerance([(warm, computed)]))
    assert_same_greedy(reloaded, computed, whole_hit, "whole-prompt hit")
    stats, before = async_run["stats"], async_run["before"]
    assert stats["events"]["loads_submitted"] - before["events"].get("loads_submitted", 0) == 1
    assert stats["events"].get("load_error_blocks", 0) == 0
    # every block, one key each (chunk_blocks 1)
    assert stats["chunks"]["loaded"] - before.get("chunks", {}).get("loaded", 0) == 16
