"""Chunks moved layer group by layer group (``layer_groups``) on real engines and a real Mooncake master.

A four-layer model, two layer groups: every chunk is two keys. Engine A computes two prompts (their
stores leave during the forward, a layer group at a time), drops vLLM's prefix cache and asks again:
the synchronous loads are waited for per layer group, as each attention layer asks for its KV. Engine B,
a fresh process loading asynchronously, reads the same keys whole. Outputs equal the no-connector
run's, up to the first near-tie, with tolerances from controls run on this machine. Run inside a
private network namespace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import (
    MOONCAKE_ENV,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    one_token_left_pairs,
    one_token_left_steps,
    run_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

P = tokens(70, 1000)  # 7 full blocks of 128 and a tail of 104: not a multiple of anything
Q = tokens(71, 1333)
PROMPTS = [P, Q]
KEYS = 2 * ((7 + 1) + (10 + 1))  # two layer groups x (full blocks + the last partial block)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-layerwise"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / "tiny-llama-4", num_layers=4)
        yield world


def layered(world: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return connector(
        {
            "backend": "mooncake",
            "mooncake_config": str(world["mooncake_config"]),
            "layer_groups": 2,
            "lookup_wait_s": 2.0,
            **extra,
        }
    )


@pytest.fixture(scope="module")
def runs(world: dict[str, Any]) -> dict[str, Any]:
    def engine(name: str, steps: list[dict[str, Any]], kv: dict[str, Any] | None = None) -> dict[str, Any]:
        return run_engine(
            world["root"], name, model=world["model"], steps=steps, kv_transfer_config=kv, env=MOONCAKE_ENV
        )

    return {
        # Controls: the prompts together and alone, and each with one token left behind vLLM's cache.
        "reference": engine(
            "reference",
            [
                generate("cold", PROMPTS),
                generate("alone_p", [P]),
                {"op": "evict"},
                *one_token_left_steps(PROMPTS),
            ],
        ),
        "a": engine(
            "layerwise-sync",
            [
                generate("first", PROMPTS),
                {"op": "flush"},
                {"op": "evict"},
                {"op": "stats", "name": "stored"},
                generate("again", PROMPTS),
                {"op": "stats"},
            ],
            layered(world, load_async=False),
        ),
        "b": engine("layerwise-async", [generate("fresh", PROMPTS), {"op": "stats"}], layered(world)),
    }


@pytest.fixture(scope="module")
def tolerance(runs: dict[str, Any]) -> float:
    reference = runs["reference"]
    pairs = [(reference["cold"]["outputs"][0], reference["alone_p"]["outputs"][0])]
    return greedy_tolerance(pairs + one_token_left_pairs(reference, len(PROMPTS)))


def test_stores_leave_per_layer_group_during_the_forward(runs: dict[str, Any], tolerance: float) -> None:
    a = runs["a"]
    stored = a["stored"]
    # Both layer groups' keys of every block and tail, and of the evict step's one-block prompt's tail.
    assert stored["chunks"]["stored"] == KEYS + 2
    assert stored["layerwise"]["layer_stores_during_forward"] >= 2  # the prompts' step, both groups
    for got, want in zip(a["first"]["outputs"], runs["reference"]["cold"]["outputs"], strict=True):
        assert_same_greedy(got, want, tolerance, "computed with layer-wise stores")


def test_synchronous_loads_are_waited_for_per_layer_group(runs: dict[str, Any], tolerance: float) -> None:
    a, reference = runs["a"], runs["reference"]
    assert a["evict"] is True
    # Every full block and tail, loaded in the step that computes the last token.
    assert [out["cached"] for out in a["again"]["outputs"]] == [len(P) - 1, len(Q) - 1]
    for got, want in zip(a["again"]["outputs"], reference["cold"]["outputs"], strict=True):
        assert_same_greedy(got, want, tolerance, "loaded layer group by layer group")
    before = a["stored"]["layerwise"].get("layer_loads_waited", 0)
    waited = a["stats"]["layerwise"]["layer_loads_waited"] - before
    # Each layer group once per step with loads, by its first layer (one step, or one per prompt).
    assert waited in (2, 4)
    assert a["stats"]["events"].get("load_error_blocks", 0) == 0
    assert a["stats"]["chunks"]["loaded"] == KEYS


def test_asynchronous_loads_read_every_layer_group(runs: dict[str, Any], tolerance: float) -> None:
    b, reference = runs["b"], runs["reference"]
    assert [out["cached"] for out in b["fresh"]["outputs"]] == [len(P), len(Q)]
    for got, want in zip(b["fresh"]["outputs"], reference["cold"]["outputs"], strict=True):
        assert_same_greedy(got, want, tolerance, "loaded asynchronously")
    assert b["stats"]["chunks"]["loaded"] == KEYS
    assert b["stats"]["layerwise"].get("layer_loads_waited", 0) == 0  # the scheduler waited, not layers
