"""Concurrent, duplicate and prefix-sharing requests at unaligned lengths, on real engines and a real
Mooncake store: the way a server meets them, with the connector's defaults (asynchronous loads).

Engine A stores twelve prompts sent at once (two copies each of P and Q, four sharing P's first 1,024
tokens, four sharing Q's first 1,536; no length a multiple of a block). Engine B, a fresh process,
answers Q alone first (so its free-block list is no longer in order), then the twelve at once, then two
copies of Q at once, then the twelve again. vLLM's own ``MooncakeStoreConnector`` runs the same steps
as the control. Every output must give the no-connector run's greedy tokens, and every prompt must hit
all it has stored: every full block and its last partial block, the whole prompt (more than vLLM's
connector's hit, which ends at the last full block).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    run_engine,
    store_world,
    tokens,
    vllm_mooncake_connector,
)

pytestmark = pytest.mark.mooncake

P, Q = tokens(61, 2000), tokens(62, 1700)
TWELVE = [
    P,
    P,
    Q,
    Q,
    *(P[:1024] + tokens(70 + i, 600 + 37 * i) for i in range(4)),
    *(Q[:1536] + tokens(80 + i, 300 + 29 * i) for i in range(4)),
]
MAX_TOKENS = 16
# Many blocks, no preemption: what is tested is concurrency, not memory pressure.
ENGINE = {"enable_prefix_caching": False, "num_gpu_blocks_override": 320}
LOADER_STEPS = [
    generate("q_alone", [Q], max_tokens=MAX_TOKENS),
    generate("twelve", TWELVE, max_tokens=MAX_TOKENS),
    generate("q_twice", [Q, Q], max_tokens=MAX_TOKENS),
    generate("twelve_again", TWELVE, max_tokens=MAX_TOKENS),
]


def whole(prompt: list[int]) -> int:
    """The hit of a prompt A stored: its full blocks and its last partial block (no length here is a
    multiple of a block)."""
    assert len(prompt) % BLOCK
    return len(prompt)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-concurrency"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / "tiny-llama")
        yield world


@pytest.fixture(scope="module")
def reference(world: dict[str, Any]) -> dict[str, Any]:
    """No connector: each distinct prompt alone, and the twelve at once (the control that sizes the
    logprob tolerance: what batching alone moves on this CPU)."""
    distinct = list(dict.fromkeys(map(tuple, TWELVE)))
    steps = [generate(f"alone{i}", [list(p)], max_tokens=MAX_TOKENS) for i, p in enumerate(distinct)]
    steps.append(generate("twelve", TWELVE, max_tokens=MAX_TOKENS))
    out = run_engine(world["root"], "reference", model=world["model"], engine=ENGINE, steps=steps)
    alone = {p: out[f"alone{i}"]["outputs"][0] for i, p in enumerate(distinct)}
    return {"alone": alone, "concurrent": out["twelve"]["outputs"]}


@pytest.fixture(scope="module")
def tolerance(reference: dict[str, Any], theirs: dict[str, Any]) -> float:
    """Sized by two controls on this machine: batching alone (no connector, the twelve at once against
    each alone) and vLLM's own connector's hits against the computed outputs."""
    controls = [
        (reference["alone"][tuple(p)], c) for p, c in zip(TWELVE, reference["concurrent"], strict=True)
    ]
    for step in LOADER_STEPS:
        outputs = theirs["loader"][step["name"]]["outputs"]
        controls += [
            (reference["alone"][tuple(p)], o) for p, o in zip(prompts_of(step["name"]), outputs, strict=True)
        ]
    return greedy_tolerance(controls)


def run_step(
    world: dict[str, Any], name: str, kv: dict[str, Any], env: dict[str, str], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    """One engine of the scenario (its own process) running ``steps``."""
    return run_engine(
        world["root"], name, model=world["model"], engine=ENGINE, env=env, kv_transfer_config=kv, steps=steps
    )


def store_then_load(
    world: dict[str, Any], name: str, kv: dict[str, Any], env: dict[str, str]
) -> dict[str, Any]:
    # Draining steps the engine as a server's loop would, so requests' last stores are ordered.
    stores = [
        generate("twelve", TWELVE, max_tokens=MAX_TOKENS),
        {"op": "drain"},
        {"op": "sleep", "seconds": 4},
    ]
    storer = run_step(world, f"{name}_stores", kv, env, stores)
    loader = run_step(world, f"{name}_loads", kv, env, LOADER_STEPS)
    return {"storer": storer, "loader": loader}


@pytest.fixture(scope="module")
def ours(world: dict[str, Any]) -> dict[str, Any]:
    kv = connector({"backend": "mooncake", "mooncake_config": str(world["mooncake_config"])})
    return store_then_load(world, "aiokv", kv, MOONCAKE_ENV)


@pytest.fixture(scope="module", params=["async", "sync"])
def ours_jittered(
    request: pytest.FixtureRequest, world: dict[str, Any], ours: dict[str, Any]
) -> dict[str, Any]:
    """A second loader over what ``ours`` stored, every get held back at random (none, 50 or 300 ms):
    a request's gets land out of order and steps after they were asked for. Asynchronous loads (the
    default) and loads the step waits for."""
    kv = connector(
        {
            "backend": "tests.vllm.support:jittered_gets_mooncake",
            "mooncake_config": str(world["mooncake_config"]),
            "load_async": request.param == "async",
            # A store this slow is one the load policy rightly declines: what is tested here is
            # that every get it does take lands right, so every hit is loaded.
            "decline_slow_loads": False,
        }
    )
    env = {**MOONCAKE_ENV, "AIOKV_TEST_JITTER_SEED": "7"}
    steps = [*LOADER_STEPS, {"op": "scheduler_stats"}]
    return {**run_step(world, f"aiokv_jittered_{request.param}", kv, env, steps), "name": request.param}


@pytest.fixture(scope="module")
def theirs(world: dict[str, Any]) -> dict[str, Any]:
    env = {**MOONCAKE_ENV, "MOONCAKE_CONFIG_PATH": str(world["mooncake_config"])}
    return store_then_load(world, "vllm", vllm_mooncake_connector(), env)


def prompts_of(step: str) -> list[list[int]]:
    return {"q_alone": [Q], "q_twice": [Q, Q]}.get(step, TWELVE)


@pytest.mark.parametrize("step", [s["name"] for s in LOADER_STEPS])
def test_concurrent_duplicate_and_shared_prefix_requests_give_the_reference_tokens(
    ours: dict[str, Any], reference: dict[str, Any], tolerance: float, step: str
) -> None:
    outputs = ours["loader"][step]["outputs"]
    for i, (prompt, got) in enumerate(zip(prompts_of(step), outputs, strict=True)):
        assert got["cached"] == whole(prompt), (step, i, got["cached"])
        assert_same_greedy(got, reference["alone"][tuple(prompt)], tolerance, f"{step}[{i}]")


@pytest.mark.parametrize("step", [s["name"] for s in LOADER_STEPS])
def test_every_prompt_hits_at_least_what_vllms_connector_hits(
    ours: dict[str, Any], theirs: dict[str, Any], reference: dict[str, Any], tolerance: float, step: str
) -> None:
    for i, (prompt, got, control) in enumerate(
        zip(prompts_of(step), ours["loader"][step]["outputs"], theirs["loader"][step]["outputs"], strict=True)
    ):
        assert got["cached"] >= control["cached"], (step, i, got["cached"], control["cached"])
        # The control is a working connector: its outputs are the reference's.
        assert_same_greedy(control, reference["alone"][tuple(prompt)], tolerance, f"vllm {step}[{i}]")


@pytest.mark.parametrize("step", [s["name"] for s in LOADER_STEPS])
def test_gets_landing_late_and_out_of_order_give_the_reference_tokens(
    ours_jittered: dict[str, Any], reference: dict[str, Any], tolerance: float, step: str
) -> None:
    """What a faster engine (an AMX CPU, a GPU) sees: its steps outrun the store's gets. A load must not
    count before its last get wrote the blocks, and each get must land in its own request's blocks."""
    outputs = ours_jittered[step]["outputs"]
    # A load the step waits for must leave the prompt's last token to compute.
    last = 1 if ours_jittered["name"] == "sync" else 0
    for i, (prompt, got) in enumerate(zip(prompts_of(step), outputs, strict=True)):
        assert got["cached"] == whole(prompt) - last, (step, i, got["cached"])
        assert_same_greedy(got, reference["alone"][tuple(prompt)], tolerance, f"jittered {step}[{i}]")


def test_lookups_answered_late_are_asked_again_and_take_the_whole_hit(ours_jittered: dict[str, Any]) -> None:
    """Every existence check of the jittered loader outlasts the scheduler's first wait: its requests
    were answered "ask again" (counted), and the test above shows each then hit the whole prompt with
    the reference's tokens."""
    deferred = ours_jittered["scheduler_stats"]["counters"].get("lookups_deferred", 0)
    assert deferred >= len(LOADER_STEPS), ours_jittered["scheduler_stats"]
