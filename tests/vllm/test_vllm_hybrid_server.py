"""AiokvConnector on the sliding-window model under vLLM's OpenAI server, concurrent requests over HTTP.

The model of ``test_vllm_hybrid.py`` (``write_tiny_sliding_llama``: layer 0 attends over a 256-token
window, layer 1 over everything; vLLM's hybrid allocator gives each its own KV-cache group) served as
users serve it (``aiokv.testing.vllm_server``: API server, engine core, worker process;
``--no-enable-prefix-caching``, so every hit is the connector's). Every server is a pure client of a
Mooncake store whose segment a holder process owns.

- A no-connector server gives the reference: each prompt alone, then the scenario at once (its spread
  against the solo runs is the control behind the logprob tolerance, ``support.greedy_tolerance``).
- Server A (AiokvConnector, its default chunk of blocks) stores P and Q (2,000 tokens, far longer than
  the window; not a whole number of blocks) until it hits them itself, and is stopped.
- A fresh server B loads them alone, then the scenario in rounds of real concurrent requests: two
  copies each of P and Q, three prompts sharing P's first 1,024 tokens and three sharing Q's first
  1,536, with unaligned suffixes. Every request generates the reference's greedy tokens and hits at
  least the shared prefix.

Run inside a private network namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
from aiokv.testing.tiny_model import write_tiny_sliding_llama, write_word_tokenizer
from aiokv.testing.vllm_server import running_server
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    ROOT,
    assert_same_greedy,
    connector,
    server_reference,
    solo_vs_concurrent_tolerance,
    store_world,
    tokens,
    wait_until,
)

pytestmark = pytest.mark.mooncake

WINDOW = 256
P = tokens(160, 2000)
Q = tokens(161, 2000)
P_SHARING = [P[:1024] + tokens(170 + i, 333 + 41 * i) for i in range(3)]
Q_SHARING = [Q[:1536] + tokens(180 + i, 217 + 53 * i) for i in range(3)]
SCENARIO = [P, P, Q, Q, *P_SHARING, *Q_SHARING]
LABELS = ["P", "P", "Q", "Q", *(f"P{i}" for i in range(3)), *(f"Q{i}" for i in range(3))]
SHARED = [2000, 2000, 2000, 2000, 1024, 1024, 1024, 1536, 1536, 1536]  # tokens each shares with P or Q
ROUNDS = 4
STORE_SETTLE_S = 120  # until server A hits its own stores: bounded, not a speed figure
CHUNK_TOKENS = ConnectorConfig.from_extra_config({"backend": "memory"}).chunk_blocks * BLOCK


def whole_chunks(tokens_count: int) -> int:
    return tokens_count // CHUNK_TOKENS * CHUNK_TOKENS


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-hybrid-server"), mooncake_master.address) as world:
        model = write_tiny_sliding_llama(world["root"] / "tiny-swa", sliding_window=WINDOW)
        world["model"] = write_word_tokenizer(model)
        yield world


def serve(world: dict[str, Any], name: str, kv: dict[str, Any] | None = None) -> Any:
    env = {**MOONCAKE_ENV, "PYTHONPATH": str(ROOT)}
    return running_server(world["model"], world["root"] / f"{name}.log", kv_transfer_config=kv, env=env)


def aiokv_connector(world: dict[str, Any]) -> dict[str, Any]:
    return connector({"backend": "mooncake", "mooncake_config": str(world["mooncake_config"])})


@pytest.fixture(scope="module")
def reference(world: dict[str, Any]) -> dict[str, Any]:
    with serve(world, "reference") as server:
        return server_reference(server, SCENARIO)


@pytest.fixture(scope="module")
def tolerance(reference: dict[str, Any]) -> float:
    return solo_vs_concurrent_tolerance(reference, SCENARIO)


@pytest.fixture(scope="module")
def loading_server(world: dict[str, Any], reference: dict[str, Any]) -> Iterator[Any]:
    """Server A stores P and Q until it hits the whole of both itself (every full block and the
    prompt's last partial block); then a fresh server B."""
    with serve(world, "A", aiokv_connector(world)) as server:
        server.complete_all([P, Q])
        wait_until(
            lambda: [server.complete(p, logprobs=None).cached for p in (P, Q)] == [2000, 2000],
            STORE_SETTLE_S,
            "server A hitting its own stores of P and Q",
        )
    with serve(world, "B", aiokv_connector(world)) as server:
        yield server


def test_fresh_server_loads_prompts_longer_than_the_window(
    loading_server: Any, reference: dict[str, Any], tolerance: float
) -> None:
    for name, prompt in (("P", P), ("Q", Q)):
        got = loading_server.complete(prompt).as_output()
        assert got["cached"] == len(prompt), (name, got["cached"])
        assert_same_greedy(got, reference["solo"][tuple(prompt)], tolerance, f"{name} alone")


def test_concurrent_prefix_sharing_requests_match_the_reference(
    loading_server: Any, reference: dict[str, Any], tolerance: float
) -> None:
    """``ROUNDS`` rounds of the scenario at once: every request of every round generates the reference's
    greedy tokens and hits at least the whole chunks of what it shares with P or Q (after the first
    round the sharing prompts' own chunks and last partial blocks are stored too, so later hits may be
    longer, up to the whole prompt)."""
    failed: list[str] = []
    hits: list[list[int]] = []
    for round_index in range(ROUNDS):
        got = [c.as_output() for c in loading_server.complete_all(SCENARIO)]
        hits.append([output["cached"] for output in got])
        for label, prompt, output in zip(LABELS, SCENARIO, got, strict=True):
            try:
                assert_same_greedy(output, reference["solo"][tuple(prompt)], tolerance, label)
            except AssertionError as error:
                failed.append(f"round {round_index} {label} (hit {output['cached']}): {error}")
    assert not failed, f"tolerance {tolerance:.3f}, hits {hits}:\n" + "\n".join(failed)
    for round_hits in hits:
        assert all(
            whole_chunks(shared) <= hit <= len(prompt)
            for hit, shared, prompt in zip(round_hits, SHARED, SCENARIO, strict=True)
        ), hits
