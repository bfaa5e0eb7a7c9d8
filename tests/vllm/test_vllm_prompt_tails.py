"""A prompt's last partial block (scheduler_side.prompt_tails), on real engines and a real
Mooncake store: engine A answers prompts whose lengths are not multiples of a block; a fresh engine B
loads the whole of each repeated prompt, and only that: a prompt ending elsewhere in the block, another
tail after the same full blocks, or another cache salt gets the full blocks at most, never the tail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    assert_same_greedy,
    cold_and_warm,
    connector,
    generate,
    greedy_tolerance,
    key_logged_engine,
    keys_of,
    run_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

P = tokens(91, 2000)  # 15 full blocks and 80 tokens
SHORT = tokens(92, 90)  # no full block: the tail is the first block, its hash carries no parent
P_ENDS_EARLIER = P[:1990]  # ends in P's tail block, 10 tokens sooner
P_OTHER_TAIL = P[:1920] + tokens(93, 80)  # P's full blocks, another tail of the same length
FULL = 1920
ENGINE = {"enable_prefix_caching": False}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-tails"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / "tiny-llama")
        yield world


@pytest.fixture(scope="module")
def reference(world: dict[str, Any]) -> dict[str, Any]:
    """No connector: each prompt computed whole ("cold") and with vLLM's own prefix cache reusing its
    full blocks ("warm"); cold against warm is the control that sizes the logprob tolerance."""
    steps = [step for name, prompt in NAMED for step in cold_and_warm(f"_{name}", prompt)]
    return run_engine(world["root"], "reference", model=world["model"], steps=steps)


NAMED = [("p", P), ("short", SHORT), ("p_ends_earlier", P_ENDS_EARLIER), ("p_other_tail", P_OTHER_TAIL)]


@pytest.fixture(scope="module")
def tolerance(reference: dict[str, Any]) -> float:
    outputs = {key: step["outputs"][0] for key, step in reference.items() if isinstance(step, dict)}
    return greedy_tolerance([(outputs[f"warm_{name}"], outputs[f"cold_{name}"]) for name, _ in NAMED])


@pytest.fixture(scope="module")
def runs(world: dict[str, Any]) -> dict[str, Any]:
    """A stores P and SHORT; B (a fresh process) asks for them, then for prompts sharing P's blocks
    but not its tail, then P under another cache salt, then two copies of P at once."""
    stores = key_logged_engine(
        world,
        "A",
        [generate("stores", [P, SHORT]), {"op": "flush"}],
        engine=ENGINE,
    )
    loads = key_logged_engine(
        world,
        "B",
        [
            generate("p", [P]),
            generate("short", [SHORT]),
            generate("p_ends_earlier", [P_ENDS_EARLIER]),
            generate("p_other_tail", [P_OTHER_TAIL]),
            generate("p_salted", [P], cache_salt="another tenant"),
            generate("p_twice", [P, P]),
        ],
        engine=ENGINE,
    )
    return {"A": stores, "B": loads}


def mooncake_engine(
    world: dict[str, Any],
    name: str,
    steps: list[dict[str, Any]],
    env: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """An engine with the connector on the world's Mooncake store (``extra``: more of its config)."""
    kv = connector({"backend": "mooncake", "mooncake_config": str(world["mooncake_config"]), **extra})
    env = {**MOONCAKE_ENV, **(env or {})}
    return run_engine(
        world["root"], name, model=world["model"], engine=ENGINE, env=env, kv_transfer_config=kv, steps=steps
    )


def only(run: dict[str, Any], name: str) -> dict[str, Any]:
    (output,) = run[name]["outputs"]
    return output


def test_each_prompt_stores_its_tail_as_one_more_key(runs: dict[str, Any]) -> None:
    puts = keys_of(runs["A"], "put", "@")
    # P: 15 full blocks and its tail; SHORT: its tail alone.
    assert len(puts) == len(set(puts)) == 15 + 1 + 1, puts


def test_a_repeated_prompt_loads_whole_with_the_references_tokens(
    runs: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    for name, prompt in [("p", P), ("short", SHORT)]:
        got = only(runs["B"], name)
        assert got["cached"] == len(prompt), (name, got["cached"])
        assert_same_greedy(got, reference[f"cold_{name}"]["outputs"][0], tolerance, name)


def test_two_copies_at_once_each_load_the_whole_prompt(
    runs: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    for got in runs["B"]["p_twice"]["outputs"]:
        assert got["cached"] == len(P), got["cached"]
        assert_same_greedy(got, reference["cold_p"]["outputs"][0], tolerance, "p twice")


def test_a_tail_serves_only_a_prompt_ending_with_exactly_its_tokens(
    runs: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """P's tail key is never loaded for a prompt that ends earlier in the block or has other tokens
    there: each gets P's full blocks from the store and computes the rest, with its own tokens."""
    for name in ("p_ends_earlier", "p_other_tail"):
        got = only(runs["B"], name)
        assert got["cached"] == FULL, (name, got["cached"])
        assert_same_greedy(got, reference[f"cold_{name}"]["outputs"][0], tolerance, name)


def test_another_cache_salt_shares_nothing(
    runs: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """vLLM folds a cache salt into the first block's hash, so every key of a salted prompt, its tail
    included, differs from the unsalted one's."""
    got = only(runs["B"], "p_salted")
    assert got["cached"] == 0, got["cached"]
    assert_same_greedy(got, reference["cold_p"]["outputs"][0], tolerance, "salted")


def test_tails_are_off_when_asked(world: dict[str, Any], runs: dict[str, Any]) -> None:
    """``store_prompt_tails: false``: a prompt stores its full blocks only and loads up to them."""
    run = mooncake_engine(world, "no_tails", [generate("p", [P])], store_prompt_tails=False)
    assert only(run, "p")["cached"] == FULL
    assert len(P) // BLOCK * BLOCK == FULL


def test_the_tail_is_stored_from_its_final_bytes_as_the_request_ends(world: dict[str, Any]) -> None:
    """Every put held 1 s and checked (the bytes it was handed against what the store then holds,
    :class:`tests.vllm.support.CheckedSlowPuts`): the tail's put runs after the request ended, from a
    block vLLM keeps until the store is done, so nothing writes into it meanwhile; a fresh engine then
    loads the whole prompt, its verified values intact."""
    prompt = tokens(94, 1000)  # 7 full blocks and 104 tokens
    put_log = world["root"] / "tail-puts.jsonl"
    env = {"AIOKV_TEST_PUT_DELAY_S": "1", "AIOKV_TEST_PUT_LOG": str(put_log)}
    steps = [generate("p", [prompt], logprobs=False), {"op": "flush"}]
    mooncake_engine(world, "A_slow", steps, env=env, backend="tests.vllm.support:slow_put_mooncake")
    puts = [json.loads(line) for line in put_log.read_text().splitlines()]
    assert sum(p["checked"] for p in puts) == 7 + 1 and all(p["equal"] == p["checked"] for p in puts), puts
    loaded = mooncake_engine(world, "slow_tail_load", [generate("p", [prompt]), {"op": "stats"}])
    assert only(loaded, "p")["cached"] == len(prompt)
    assert not loaded["stats"]["events"].get("load_error_blocks"), loaded["stats"]["events"]
