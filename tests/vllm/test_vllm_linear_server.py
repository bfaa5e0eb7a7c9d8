"""AiokvConnector on the linear-attention model under vLLM's OpenAI server, concurrent requests over HTTP.

The model of ``test_vllm_linear.py`` (``write_tiny_qwen3_next``: a gated delta net layer and a
full-attention layer) served as users serve it (``aiokv.testing.vllm_server``: API server, engine core,
worker process). Unlike the other server tests, prefix caching stays on: vLLM runs such a model in
``mamba_cache_mode="align"`` (the only mode whose states the connector can store) only with it. Every
server is a pure client of a Mooncake store whose segment a holder process owns.

- A no-connector server gives the reference: each prompt alone, then the scenario at once. The
  logprob tolerance (``support.greedy_tolerance``) comes from two controls: that concurrent run
  against the solo runs, and vLLM's own connector run through the same steps (a server stores P and
  Q, a fresh one loads them alone and in the scenario).
- Server A stores P and Q (1,290 tokens each), one after the other, and is stopped once its key log
  shows each prompt's state written (its own prefix cache would answer a repeat, so a repeat cannot
  tell).
- A fresh server B loads P alone (1,280 tokens: the state at the last block boundary vLLM keeps, and
  the attention chunks before it), then gets two copies of Q and three prompts sharing Q's first 1,280
  tokens at once: each hits at least those 1,280 tokens (from the store, or from B's own cache once one
  of them loaded it) and generates the reference's greedy tokens.

Run inside a private network namespace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_word_tokenizer
from aiokv.testing.tiny_qwen3_next import write_tiny_qwen3_next
from aiokv.testing.vllm_server import DEFAULT_ARGS, running_server
from tests.vllm.support import (
    MOONCAKE_ENV,
    ROOT,
    assert_same_greedy,
    connector,
    greedy_tolerance,
    read_key_log,
    server_reference,
    solo_vs_concurrent_tolerance,
    store_world,
    tokens,
    vllm_mooncake_connector,
    wait_until,
)

pytestmark = pytest.mark.mooncake

P, Q = tokens(260, 1290), tokens(261, 1290)
HIT = 1280  # the last 256-token block boundary before each prompt's last token
Q_SHARING = [Q[:HIT] + tokens(270 + i, 150 + 41 * i) for i in range(3)]
SCENARIO = [Q, Q, *Q_SHARING]
STATE_KEYS = "state-gdn_attn"
# Prefix caching on (vLLM's "align" mode needs it); everything else as the other server tests run.
ARGS = (*(arg for arg in DEFAULT_ARGS if arg != "--no-enable-prefix-caching"), "--mamba-cache-mode", "align")
STORE_SETTLE_S = 120  # until server A's key log shows its stores: bounded, not a speed figure
VLLM_STORE_SETTLE_S = 10  # vLLM's connector stores in the background; nothing to wait on from outside


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-linear-server"), mooncake_master.address) as world:
        world["model"] = write_word_tokenizer(write_tiny_qwen3_next(world["root"] / "tiny-qwen3-next"))
        yield world


def serve(world: dict[str, Any], name: str, kv: dict[str, Any] | None = None, **env: str) -> Any:
    config = {"MOONCAKE_CONFIG_PATH": str(world["mooncake_config"])}  # vLLM's connector reads it
    return running_server(
        world["model"],
        world["root"] / f"{name}.log",
        kv_transfer_config=kv,
        env={**MOONCAKE_ENV, "PYTHONPATH": str(ROOT), **config, **env},
        args=ARGS,
    )


def aiokv_connector(world: dict[str, Any], backend: str = "mooncake") -> dict[str, Any]:
    return connector({"backend": backend, "mooncake_config": str(world["mooncake_config"])})


@pytest.fixture(scope="module")
def reference(world: dict[str, Any]) -> dict[str, Any]:
    with serve(world, "reference") as server:
        return server_reference(server, SCENARIO, [P])


@pytest.fixture(scope="module")
def tolerance(world: dict[str, Any], reference: dict[str, Any]) -> float:
    """Controls: the no-connector server's solo against concurrent runs, and vLLM's own connector
    through this test's steps. After an external hit on this model a server's outputs move off the
    reference's by up to ~0.05 with either connector, by the same amounts (an AMX CPU: 0.0047 for P
    alone, 0.0528 for Q alone), while its own prefix cache gives them bitwise."""
    with serve(world, "vllm_stores", vllm_mooncake_connector()) as server:
        server.complete(P)  # one at a time, as server A below
        server.complete(Q)
        time.sleep(VLLM_STORE_SETTLE_S)  # vLLM's connector stores in the background
    with serve(world, "vllm_loads", vllm_mooncake_connector()) as server:
        got = [server.complete(prompt).as_output() for prompt in [P, *SCENARIO]]
        got += [completion.as_output() for completion in server.complete_all(SCENARIO)]
    hits = [output["cached"] for output in got]
    assert hits == [HIT] * len(hits), f"vLLM's connector, the control, did not hit {HIT} tokens each: {hits}"
    pairs = list(
        zip(got, [reference["solo"][tuple(prompt)] for prompt in [P, *SCENARIO, *SCENARIO]], strict=True)
    )
    return max(solo_vs_concurrent_tolerance(reference, SCENARIO), greedy_tolerance(pairs))


def stored_states(log: Any) -> int:
    """State values server A's key log shows written (every code a success)."""
    return sum(
        1
        for entry in read_key_log(log)
        if entry["op"] == "put"
        for key, code in zip(entry["keys"], entry["codes"], strict=True)
        if STATE_KEYS in key and code >= 0
    )


@pytest.fixture(scope="module")
def loading_server(world: dict[str, Any], reference: dict[str, Any]) -> Iterator[Any]:
    """Server A stores P and Q (waited for in its key log); then a fresh server B."""
    log = world["root"] / "A.keys.jsonl"
    kv = aiokv_connector(world, "tests.vllm.support:key_log_mooncake")
    with serve(world, "A", kv, AIOKV_TEST_KEY_LOG=str(log)) as server:
        # One at a time: vLLM keeps (and hands over) a state only at a block boundary where a prefill
        # chunk ends, and two prompts prefilled in one step are cut where the step's token budget ends.
        server.complete(P)
        server.complete(Q)
        wait_until(lambda: stored_states(log) >= 2, STORE_SETTLE_S, "server A writing both states")
    with serve(world, "B", aiokv_connector(world)) as server:
        yield server


def test_fresh_server_loads_the_state_and_the_attention_chunks(
    loading_server: Any, reference: dict[str, Any], tolerance: float
) -> None:
    got = loading_server.complete(P).as_output()
    assert got["cached"] == HIT, got["cached"]
    assert_same_greedy(got, reference["solo"][tuple(P)], tolerance, "P alone")


def test_concurrent_duplicate_and_prefix_sharing_requests_match_the_reference(
    loading_server: Any, reference: dict[str, Any], tolerance: float
) -> None:
    got = [c.as_output() for c in loading_server.complete_all(SCENARIO)]
    hits = [output["cached"] for output in got]
    assert all(hit >= HIT for hit in hits), hits
    for n, (prompt, output) in enumerate(zip(SCENARIO, got, strict=True)):
        assert_same_greedy(
            output, reference["solo"][tuple(prompt)], tolerance, f"request {n} (hit {hits[n]})"
        )
