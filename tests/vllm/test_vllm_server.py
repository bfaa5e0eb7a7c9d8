"""AiokvConnector under vLLM's OpenAI server, as users run it: real servers driven over HTTP.

Servers (``aiokv.testing.vllm_server``: ``python -m vllm.entrypoints.openai.api_server``, vLLM's
default multiprocess engine: API server, engine core, worker) run on loopback with
``--no-enable-prefix-caching``, so every hit (``cached_tokens``) is the connector's. Prompts go as
token ids to ``/v1/completions``: greedy, 16 tokens, ``logprobs`` 2. Every server is a pure client of a
Mooncake store whose segment a holder process owns, so the KV outlives the server that wrote it.

- A no-connector server gives the reference: each prompt alone, then the concurrent scenario (its
  spread against the solo runs is the control behind the logprob tolerance, ``support.
  greedy_tolerance``).
- vLLM's own ``MooncakeStoreConnector`` runs the same scenario (server A' stores, is stopped, B' loads).
- AiokvConnector: server A stores, then is stopped with SIGINT while stores of other prompts are in
  flight (puts delayed 3 s), with vLLM's default shutdown and (server A2) with a grace period; a fresh
  server B loads: alone, then the concurrent scenario (two copies
  each of two 2,000-token prompts P and Q, four prompts sharing P's first 1,024 tokens, four sharing
  Q's first 1,536) in 20 rounds of real concurrent HTTP requests, each round's greedy tokens equal to
  the reference's.

- The embedded tier (``backend "memory"``, no store to run) at TP 1 and TP 2, and the tiered setup (the
  tier in front of Mooncake: one server stores and hits its tier, a fresh one hits Mooncake, promotes,
  then hits its tier), the scenario in rounds with every full block hit and the reference's outputs.

Run inside a private network namespace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
from aiokv.testing.tiny_model import write_tiny_llama, write_word_tokenizer
from aiokv.testing.vllm_server import Completion, running_server
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    PARALLEL_ENV,
    ROOT,
    assert_same_greedy,
    connector,
    read_key_log,
    server_reference,
    solo_vs_concurrent_tolerance,
    store_world,
    tokens,
    vllm_mooncake_connector,
    wait_until,
)

pytestmark = pytest.mark.mooncake

P = tokens(60, 2000)  # 15 full blocks: 3 chunks of 4 blocks (AiokvConnector), 15 keys (vLLM's)
Q = tokens(61, 2000)
P_SHARING = [P[:1024] + tokens(70 + i, 676) for i in range(4)]
Q_SHARING = [Q[:1536] + tokens(80 + i, 364) for i in range(4)]
# 12 concurrent requests: repeats, and prompts sharing prefixes.
SCENARIO = [P, P, Q, Q, *P_SHARING, *Q_SHARING]
LABELS = ["P", "P", "Q", "Q", *(f"P{i}" for i in range(4)), *(f"Q{i}" for i in range(4))]
# Stored by a server stopped with SIGINT while their stores are in flight.
STOPPED = [tokens(90 + i, 1700) for i in range(3)]
DRAINED = [tokens(95 + i, 1700) for i in range(3)]
ROUNDS = 20
ROUNDS_TIME_LIMIT_S = 1200  # a round takes ~5-20 s on 2 shared cores; beyond this something hangs
PUT_DELAY_S = 3
# AiokvConnector's default blocks per key: a hit is whole keys of full blocks.
CHUNK_TOKENS = ConnectorConfig.from_extra_config({"backend": "memory"}).chunk_blocks * BLOCK


def expected_hit(prompt: list[int]) -> int:
    """The hit of a prompt (not a whole number of blocks) whose every key is in the store: the whole
    prompt, its last partial block included (``store_prompt_tails``)."""
    return len(prompt)


def possible_hit(hit: int, prompt: list[int]) -> bool:
    """Whether ``hit`` is a leading run of ``prompt``'s keys: whole keys of full blocks, or all of it."""
    return hit == len(prompt) or (hit % CHUNK_TOKENS == 0 and hit < len(prompt))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-server"), mooncake_master.address) as world:
        world["model"] = write_word_tokenizer(write_tiny_llama(world["root"] / "tiny-llama"))
        yield world


def serve(world: dict[str, Any], name: str, kv: dict[str, Any] | None = None, *args: str, **env: str) -> Any:
    """A ready server for the test model (stopped with SIGINT on leaving), with ``args`` added to its
    command line; its log is ``<name>.log``."""
    server_env = {
        **MOONCAKE_ENV,
        "PYTHONPATH": str(ROOT),  # the worktree's aiokv and test backends, in every server process
        "MOONCAKE_CONFIG_PATH": str(world["mooncake_config"]),  # vLLM's connector reads it
        **env,
    }
    return running_server(
        world["model"], world["root"] / f"{name}.log", kv_transfer_config=kv, env=server_env, extra_args=args
    )


def aiokv_connector(world: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return connector({"backend": "mooncake", "mooncake_config": str(world["mooncake_config"]), **extra})


def outputs(completions: list[Completion]) -> list[dict[str, Any]]:
    return [completion.as_output() for completion in completions]


@pytest.fixture(scope="module")
def reference(world: dict[str, Any]) -> dict[str, Any]:
    with serve(world, "reference") as server:
        return server_reference(server, SCENARIO, [*STOPPED, *DRAINED])


@pytest.fixture(scope="module")
def tolerance(reference: dict[str, Any]) -> float:
    return solo_vs_concurrent_tolerance(reference, SCENARIO)


def scenario_mismatches(got: list[dict[str, Any]], reference: dict[str, Any], tolerance: float) -> list[str]:
    """Each request of the scenario that did not generate the reference's greedy output, described."""
    found = []
    for label, prompt, output in zip(LABELS, SCENARIO, got, strict=True):
        try:
            assert_same_greedy(output, reference["solo"][tuple(prompt)], tolerance, label)
        except AssertionError as error:
            found.append(f"{label} (hit {output['cached']}): {error}")
    return found


def test_vllms_connector_passes_the_concurrent_scenario(
    world: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """The control connector: vLLM's MooncakeStoreConnector, stored by one server and loaded by a
    fresh one, gives the reference's greedy tokens alone and concurrently (one full block per key:
    it hits 1,920 of a 2,000-token prompt)."""
    with serve(world, "vllm_stores", vllm_mooncake_connector()) as server:
        server.complete_all([P, Q])
        time.sleep(5)  # vLLM's connector stores in the background; nothing to wait on from outside
    with serve(world, "vllm_loads", vllm_mooncake_connector()) as server:
        solo = [server.complete(prompt).as_output() for prompt in (P, Q)]
        rounds = [outputs(server.complete_all(SCENARIO)) for _ in range(2)]
    for prompt, got in zip((P, Q), solo, strict=True):
        assert got["cached"] == 1920
        assert_same_greedy(got, reference["solo"][tuple(prompt)], tolerance, "vLLM's connector, alone")
    for got in rounds:
        assert not scenario_mismatches(got, reference, tolerance)


def store_then_stop(
    world: dict[str, Any], name: str, first: list[list[int]], in_flight: list[list[int]], *args: str
) -> dict[str, Any]:
    """A server stores ``first`` (puts delayed and checked, every put and get recorded) and waits for
    those stores, then answers ``in_flight`` and is stopped with SIGINT at once, their stores in flight
    (``args``: its shutdown options). Returns the keys it acknowledged as stored and the put checks."""
    key_log = world["root"] / f"{name}.keys.jsonl"
    put_log = world["root"] / f"{name}.puts.jsonl"
    kv = aiokv_connector(world, backend="tests.vllm.support:slow_key_log_mooncake")
    env = {
        "AIOKV_TEST_KEY_LOG": str(key_log),
        "AIOKV_TEST_PUT_LOG": str(put_log),
        "AIOKV_TEST_PUT_DELAY_S": str(PUT_DELAY_S),
    }

    def acknowledged() -> set[str]:
        return {
            key
            for entry in read_key_log(key_log)
            if entry["op"] == "put"
            for key, code in zip(entry["keys"], entry["codes"], strict=True)
            if code >= 0
        }

    with serve(world, name, kv, *args, **env) as server:
        server.complete_all(first)
        # Every full block's key and each prompt's last partial block (stored as its request ends).
        chunks = sum(len(prompt) // CHUNK_TOKENS + 1 for prompt in first)
        wait_until(lambda: len(acknowledged()) >= chunks, 120, f"the first prompts' {chunks} keys stored")
        before_stop = acknowledged()
        server.complete_all(in_flight)
    # The context sent SIGINT and waited for the server's processes to exit.
    puts = [json.loads(line) for line in put_log.read_text().splitlines()] if put_log.exists() else []
    return {"before_stop": before_stop, "acknowledged": acknowledged(), "puts": puts}


@pytest.fixture(scope="module")
def stored(world: dict[str, Any]) -> dict[str, Any]:
    """Server A stores P and Q, then is stopped while the STOPPED prompts' stores are in flight, with
    vLLM's default shutdown (``--shutdown-timeout 0``: the engine and worker processes are killed at
    once, in-flight stores never complete); server A2 the same for DRAINED with a grace period, in
    which the connector's shutdown waits for its stores."""
    return {
        "abort": store_then_stop(world, "A", [P, Q], STOPPED),
        "drain": store_then_stop(world, "A2", [], DRAINED, "--shutdown-timeout", "30"),
    }


@pytest.fixture(scope="module")
def loading_server(world: dict[str, Any], stored: dict[str, Any]) -> Iterator[Any]:
    """Server B: a fresh AiokvConnector server on the same store (plain Mooncake backend)."""
    with serve(world, "B", aiokv_connector(world)) as server:
        yield server


@pytest.mark.parametrize(("shutdown", "prompts"), [("abort", STOPPED), ("drain", DRAINED)])
def test_stopped_with_stores_in_flight_leaves_right_bytes_or_none(
    stored: dict[str, Any],
    loading_server: Any,
    reference: dict[str, Any],
    tolerance: float,
    mooncake_backend: Any,
    shutdown: str,
    prompts: list[list[int]],
) -> None:
    """SIGINT while the prompts' stores are in flight: every key the server acknowledged is in the
    store with the bytes it computed (each put read back equal to the blocks when it began), and a
    fresh server loading the prompts hits whatever landed and generates the reference's tokens. With a
    grace period (``--shutdown-timeout``) every store lands. (With vLLM's default, none did here: the
    engine core and worker are killed at once, so the connector's shutdown never runs.)"""
    run = stored[shutdown]
    acknowledged = sorted(run["acknowledged"])
    assert run["before_stop"] <= run["acknowledged"]
    assert mooncake_backend.batch_exists(acknowledged) == [True] * len(acknowledged)
    assert all(put["equal"] == put["checked"] for put in run["puts"]), run["puts"]
    hits = []
    for i, prompt in enumerate(prompts):
        got = loading_server.complete(prompt).as_output()
        hits.append(got["cached"])
        assert_same_greedy(got, reference["solo"][tuple(prompt)], tolerance, f"{shutdown} prompt {i}")
    assert all(possible_hit(hit, prompt) for hit, prompt in zip(hits, prompts, strict=True)), hits
    if shutdown == "drain":
        # Every full block's key and every prompt's tail key.
        keys = sum(len(prompt) // CHUNK_TOKENS + 1 for prompt in prompts)
        assert len(acknowledged) == keys and hits == [len(p) for p in prompts], (hits, acknowledged)


def test_fresh_server_loads_what_a_stopped_one_stored(
    loading_server: Any, reference: dict[str, Any], tolerance: float
) -> None:
    """One request at a time: P and Q hit every whole key of theirs and match the reference."""
    for name, prompt in (("P", P), ("Q", Q)):
        got = loading_server.complete(prompt).as_output()
        assert got["cached"] == expected_hit(prompt), (name, got["cached"])
        assert_same_greedy(got, reference["solo"][tuple(prompt)], tolerance, f"{name} alone")


def test_concurrent_scenario_matches_the_reference_in_every_round(
    loading_server: Any, reference: dict[str, Any], tolerance: float
) -> None:
    """The 12 concurrent requests of ``SCENARIO``, ``ROUNDS`` times over HTTP: every request of every round
    generates the reference's greedy tokens (logprobs within the control's tolerance). Every hit is
    loaded anew each round (no prefix caching); after the first round the sharing prompts' own
    chunks are in the store too, so rounds differ in their hits."""
    began = time.monotonic()
    failed: dict[int, list[str]] = {}
    hits: list[list[int]] = []
    for round_index in range(ROUNDS):
        assert time.monotonic() - began < ROUNDS_TIME_LIMIT_S, f"only {round_index} rounds in time"
        got = outputs(loading_server.complete_all(SCENARIO))
        hits.append([output["cached"] for output in got])
        mismatches = scenario_mismatches(got, reference, tolerance)
        if mismatches:
            failed[round_index] = mismatches
    assert not failed, (
        f"{len(failed)} of {ROUNDS} rounds differ from the reference (tolerance {tolerance:.3f}; hits per"
        f" round {hits}):\n" + "\n".join(f"round {r}: {m}" for r, ms in failed.items() for m in ms)
    )
    assert all(hit >= 1024 for round_hits in hits for hit in round_hits), hits


TP2_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
# One allowed core per rank's threads (vLLM's CPU worker refuses to bind two workers otherwise).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": PARALLEL_ENV["VLLM_CPU_OMP_THREADS_BIND"]}
HOST_TIER_ROUNDS = 3
TIER_SETTLE_S = 120  # until every rank reported its writes to the scheduler: bounded, not a speed figure


def hits_from_the_tier(server: Any, reference: dict[str, Any], tolerance: float) -> list[list[int]]:
    """The scenario once to store it, then (once the tier reports every full block of P and Q, one
    request at a time) ``HOST_TIER_ROUNDS`` concurrent rounds: every request hits every full block it
    has stored (no prefix caching: the hits are the tier's) with the reference's outputs."""
    server.complete_all(SCENARIO)
    wait_until(
        lambda: all(server.complete(prompt).cached == expected_hit(prompt) for prompt in (P, Q)),
        TIER_SETTLE_S,
        "P and Q whole in the host tier",
    )
    hits = []
    for round_index in range(HOST_TIER_ROUNDS):
        got = outputs(server.complete_all(SCENARIO))
        hits.append([output["cached"] for output in got])
        assert not scenario_mismatches(got, reference, tolerance), (round_index, hits)
        assert [output["cached"] for output in got] == [expected_hit(p) for p in SCENARIO], hits
    return hits


@pytest.mark.parametrize("tp", [1, 2])
def test_embedded_tier_serves_hits_under_the_openai_server(
    world: dict[str, Any], reference: dict[str, Any], tolerance: float, tp: int
) -> None:
    """``backend "memory"`` under vLLM's default multiprocess engine (the scheduler and the model in
    different processes even at TP 1), at TP 1 and TP 2: no store to run, hits from the tier."""
    kv = connector({"backend": "memory", "memory_capacity": "256MiB"})
    args, env = (TP2_ARGS, TP2_ENV) if tp == 2 else ((), {})
    with serve(world, f"embedded_tp{tp}", kv, *args, **env) as server:
        hits_from_the_tier(server, reference, tolerance)


def test_tiered_setup_under_the_openai_server(
    world: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """``backend "tiered"``: server T1 stores to its tier and Mooncake and hits from its tier; a fresh
    server T2 (empty tier) hits Mooncake first, promotes, then hits its tier, outputs right throughout."""
    kv = aiokv_connector(world, backend="tiered", memory_capacity="256MiB", cache_prefix="tiered")
    with serve(world, "tiered_1", kv) as server:
        hits_from_the_tier(server, reference, tolerance)
    with serve(world, "tiered_2", kv) as server:
        for prompt in (P, Q):  # from Mooncake: the new server's tier is empty
            got = server.complete(prompt).as_output()
            assert got["cached"] == expected_hit(prompt)
            assert_same_greedy(got, reference["solo"][tuple(prompt)], tolerance, "tiered, from Mooncake")
        hits_from_the_tier(server, reference, tolerance)
