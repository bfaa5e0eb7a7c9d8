"""The host-memory tier (``backend: "memory"``) under vLLM's default multiprocess engine, at TP 1 and
TP 2: the scheduler in the engine-core process, each rank's model and tier in a worker process of its
own, no server. A first generate stores two prompts whose lengths are not multiples of a chunk; vLLM's
own prefix cache is then dropped, and the same prompts hit from the tier (every full block) with the
outputs of an engine of the same shape without any connector."""

from __future__ import annotations

from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import (
    PARALLEL_ENV,
    TP2_ENGINE,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    require_vllm,
    run_engine,
    tokens,
)

P = tokens(60, 2000)  # 15 full blocks
Q = tokens(61, 1700)  # 13 full blocks
PROMPTS = [P, Q]
# Every key of each prompt is in the tier: its full blocks and its last partial block (store_prompt_tails).
WHOLE_PROMPTS = [len(P), len(Q)]
MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
TIMEOUT_S = 600
# No connector: the two prompts at once ("cold", what the connector runs are compared with) and each
# alone, the control that sizes the logprob tolerance (what batching alone moves on this CPU).
REFERENCE_STEPS = [generate("cold", PROMPTS), generate("alone_p", [P]), generate("alone_q", [Q])]


def reference_tolerance(reference: dict[str, Any]) -> float:
    alone = [*reference["alone_p"]["outputs"], *reference["alone_q"]["outputs"]]
    return greedy_tolerance(list(zip(reference["cold"]["outputs"], alone, strict=True)))


def assert_matches_reference(outputs: list[dict[str, Any]], reference: dict[str, Any], what: str) -> None:
    """Each output against the no-connector run of the same prompts (see support.assert_same_greedy)."""
    tolerance = reference_tolerance(reference)
    for i, (got, want) in enumerate(zip(outputs, reference["cold"]["outputs"], strict=True)):
        assert_same_greedy(got, want, tolerance, f"{what}[{i}]")


def tier_config(**extra: Any) -> dict[str, Any]:
    return connector({"backend": "memory", "memory_capacity": "64MiB", "chunk_blocks": 1, **extra})


STEPS = [
    generate("first", PROMPTS),  # computed: stored into the tier
    {"op": "evict"},  # vLLM's prefix cache dropped: what hits now comes from the tier
    generate("hit", PROMPTS),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-host-tier")
    return root, write_tiny_llama(root / "tiny-llama")


def engine(model: Any, name: str, steps: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    root, path = model
    return run_engine(root, name, model=path, steps=steps, timeout=TIMEOUT_S, **options)


@pytest.fixture(scope="module")
def tp1(model: Any) -> dict[str, Any]:
    return {
        "reference": engine(model, "ref-tp1", REFERENCE_STEPS, env=MULTIPROCESS),
        "tier": engine(model, "tier-tp1", STEPS, kv_transfer_config=tier_config(), env=MULTIPROCESS),
    }


@pytest.fixture(scope="module")
def tp2(model: Any) -> dict[str, Any]:
    return {
        "reference": engine(model, "ref-tp2", REFERENCE_STEPS, engine=TP2_ENGINE, env=PARALLEL_ENV),
        "tier": engine(
            model, "tier-tp2", STEPS, kv_transfer_config=tier_config(), engine=TP2_ENGINE, env=PARALLEL_ENV
        ),
    }


def check_hits(run: dict[str, Any]) -> None:
    tier, reference = run["tier"], run["reference"]
    assert "backend 'memory' keeps KV inside one process" not in tier["log"]
    assert tier["evict"] is True  # vLLM's own prefix cache was dropped: the hits are the tier's
    assert [out["cached"] for out in tier["first"]["outputs"]] == [0, 0]
    assert [out["cached"] for out in tier["hit"]["outputs"]] == WHOLE_PROMPTS  # every token
    assert_matches_reference(tier["hit"]["outputs"], reference, "hit")
    assert_matches_reference(tier["first"]["outputs"], reference, "first")


def test_tp1_multiprocess_engine_hits_from_the_host_tier(tp1: dict[str, Any]) -> None:
    check_hits(tp1)


def test_tp2_engine_hits_whole_on_both_ranks(tp2: dict[str, Any]) -> None:
    """Each rank holds its own shard in its own process; a chunk is a hit only once both ranks
    reported it written, and both load it: the outputs match the TP-2 reference."""
    check_hits(tp2)
