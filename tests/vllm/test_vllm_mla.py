"""AiokvConnector with multi-head latent attention (MLA) on real vLLM engines against a real Mooncake store.

A tiny random DeepSeek-V2-style model (``write_tiny_deepseek_mla``) runs on vLLM's CPU MLA backend
(``CPU_MLA``: 16-token blocks). MLA's KV cache (the latent) is the same on every TP rank: TP rank 0
alone writes one shared key, every rank reads it, and engines of any TP size share it. A (TP 2) stores
two prompts, B (TP 1) and D (TP 2) load them. Run inside a private network namespace.

vLLM turns its own prefix cache off for MLA on CPUs without AMX, and a prompt computed behind a reused
prefix differs from a whole-prompt computation in the second decimal of the logprobs (the backend's
context path), so the references run with vLLM's prefix cache kept on (``prefix_cache_job.py``):
vLLM reuses the same prefix itself, and outputs are compared (``support.assert_same_greedy``). A
cross-TP load (a latent computed with TP 2, used with TP 1) is close, not bitwise equal: vLLM's TP-1
and TP-2 MLA engines already compute different numbers. The model runs in float32 to keep that gap
small. A negative control (another prompt's KV under a prompt's keys) changes the tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_deepseek_mla
from tests.vllm import support
from tests.vllm.support import (
    MOONCAKE_ENV,
    PARALLEL_ENV,
    TP2_ENGINE,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    overwrite,
    read_key_log,
    read_value,
    run_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

MLA_BLOCK = 16  # vLLM's CPU MLA backend
PROMPT = tokens(51, 2100)
PROMPT_C = tokens(53, 1500)  # the negative control's
HIT = (2100 - 1) // MLA_BLOCK * MLA_BLOCK  # 131 full blocks: 2,096 tokens (vLLM's own reuse too)
HIT_C = (1500 - 1) // MLA_BLOCK * MLA_BLOCK
# CPU_MLA explicitly: on CPUs with AMX vLLM would pick AMX_MLA, which takes bf16 weights only.
ENGINE = {
    "num_gpu_blocks_override": 320,
    "max_model_len": 2304,
    "dtype": "float32",
    "attention_backend": "CPU_MLA",
}
PARALLEL_TIMEOUT_S = 600
# vLLM's CPU MLA engines with TP 1 and TP 2 compute visibly different numbers (even in float32 their
# own greedy tokens for PROMPT part after four), so a latent computed with TP 2 and used with TP 1
# is only close to the TP-1 engine's own (a few hundredths of a logprob).
CROSS_TP_LOGPROB_TOLERANCE = 0.05
PREFIX_CACHE_JOB = Path(support.__file__).with_name("prefix_cache_job.py")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-mla"), mooncake_master.address) as world:
        world["model"] = write_tiny_deepseek_mla(world["root"] / "tiny-mla")
        yield world


def parallel(tp: int) -> tuple[dict[str, Any], dict[str, str]]:
    return (TP2_ENGINE, PARALLEL_ENV) if tp == 2 else ({}, {})


def reference(world: dict[str, Any], name: str, steps: list[dict[str, Any]], *, tp: int) -> dict[str, Any]:
    """A run without any connector, vLLM's prefix cache kept on (``prefix_cache_job.py``)."""
    engine, env = parallel(tp)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(support, "JOB_SCRIPT", PREFIX_CACHE_JOB)
        return run_engine(
            world["root"],
            name,
            model=world["model"],
            engine={**ENGINE, **engine},
            env=env,
            steps=steps,
            timeout=PARALLEL_TIMEOUT_S,
        )


def with_connector(
    world: dict[str, Any], name: str, steps: list[dict[str, Any]], *, tp: int
) -> dict[str, Any]:
    """An engine with the connector (one block per key: hits end where vLLM's own reuse ends), its
    puts and gets recorded (``run["keys"]``)."""
    log = world["root"] / f"{name}.keys.jsonl"
    kv = connector(
        {
            "backend": "tests.vllm.support:key_log_mooncake",
            "mooncake_config": str(world["mooncake_config"]),
            "chunk_blocks": 1,
        }
    )
    engine, env = parallel(tp)
    run = run_engine(
        world["root"],
        name,
        model=world["model"],
        engine={**ENGINE, **engine},
        env={**MOONCAKE_ENV, **env, "AIOKV_TEST_KEY_LOG": str(log)},
        kv_transfer_config=kv,
        steps=steps,
        timeout=PARALLEL_TIMEOUT_S,
    )
    run["keys"] = read_key_log(log)
    return run


def keys_of(run: dict[str, Any], op: str, tp_rank: int | None = None) -> list[str]:
    found = [entry for entry in run["keys"] if entry["op"] == op]
    assert all(code >= 0 for entry in found for code in entry["codes"]), found
    return [key for entry in found if tp_rank in (None, entry["tp_rank"]) for key in entry["keys"]]


@pytest.fixture(scope="module")
def runs(world: dict[str, Any], mooncake_backend: Any) -> dict[str, Any]:
    """References for TP 1 and TP 2 ("warm": vLLM reuses the 131 blocks the connector loads); A (TP 2)
    stores both prompts, B (TP 1) loads PROMPT; C's keys are then given another prompt's KV; D (TP 2)
    loads both."""
    evict: dict[str, Any] = {"op": "evict"}
    out: dict[str, Any] = {}
    warm = [generate("cold", [PROMPT]), generate("warm", [PROMPT])]
    out["ref_tp1"] = reference(world, "ref_tp1", [*warm, evict, generate("c", [PROMPT_C])], tp=1)
    out["ref_tp2"] = reference(world, "ref_tp2", warm, tp=2)
    sleep: dict[str, Any] = {"op": "sleep", "seconds": 3}  # stores finish in the background
    out["A"] = with_connector(world, "A", [generate("p", [PROMPT]), generate("c", [PROMPT_C]), sleep], tp=2)
    out["B"] = with_connector(world, "B", [generate("p", [PROMPT])], tp=1)
    # B loaded PROMPT's keys: the rest of A's are PROMPT_C's. They now hold one of PROMPT's blocks.
    prompt_keys = set(keys_of(out["B"], "get"))
    c_keys = [key for key in dict.fromkeys(keys_of(out["A"], "put")) if key not in prompt_keys]
    size = next(entry["sizes"][0] for entry in out["A"]["keys"] if entry["op"] == "put")
    overwrite(mooncake_backend, c_keys, read_value(mooncake_backend, min(prompt_keys), size))
    out["D"] = with_connector(world, "D", [generate("p", [PROMPT]), generate("c", [PROMPT_C])], tp=2)
    return out


def only(run: dict[str, Any], name: str) -> dict[str, Any]:
    (output,) = run[name]["outputs"]
    return output


def test_only_tp_rank_0_writes_the_shared_key(runs: dict[str, Any], mooncake_backend: Any) -> None:
    puts = keys_of(runs["A"], "put")
    assert keys_of(runs["A"], "put", tp_rank=0) == puts
    assert len(set(puts)) == (HIT + HIT_C) // MLA_BLOCK
    assert all("@mla" in key and ".tp*." in key for key in puts), puts[:2]
    assert all(mooncake_backend.batch_exists(puts))


def test_tp2_engine_reads_the_shared_key_on_every_rank(runs: dict[str, Any]) -> None:
    got = only(runs["D"], "p")
    assert got["cached"] == HIT
    warm, cold = only(runs["ref_tp2"], "warm"), only(runs["ref_tp2"], "cold")
    tolerance = greedy_tolerance([(warm, cold)])
    assert_same_greedy(got, warm, tolerance, "D against warm")
    assert_same_greedy(got, cold, tolerance, "D against cold")
    prompt_keys = set(keys_of(runs["B"], "get"))
    assert len(prompt_keys) == HIT // MLA_BLOCK
    for rank in (0, 1):
        assert set(keys_of(runs["D"], "get", tp_rank=rank)) >= prompt_keys, rank
    # Every full block was loaded: nothing of PROMPT's to store (D rewrites only the planted keys of
    # PROMPT_C it refused, see test_wrong_latent_is_refused_and_recomputed).
    assert not set(keys_of(runs["D"], "put")) & prompt_keys


def test_tp1_engine_loads_what_a_tp2_engine_stored(runs: dict[str, Any]) -> None:
    """MLA keys carry no TP size: a TP-1 engine loads the latent a TP-2 engine computed."""
    got, want = only(runs["B"], "p"), only(runs["ref_tp1"], "warm")
    assert got["cached"] == HIT
    cold = only(runs["ref_tp1"], "cold")
    # The measured cross-TP gap, or this run's own control if that is wider.
    tolerance = max(CROSS_TP_LOGPROB_TOLERANCE, greedy_tolerance([(want, cold)]))
    assert_same_greedy(got, want, tolerance, "TP-1 engine against warm")
    assert got["tokens"] == cold["tokens"]


def test_wrong_latent_is_refused_and_recomputed(runs: dict[str, Any]) -> None:
    """PROMPT_C's keys hold one of PROMPT's blocks (a well-formed value under the wrong key, as a
    store's repeated-key get bug gives): D finds them, but its ranks refuse each on load (the value
    names another key), recompute, and its tokens are the reference's. Without verification D loaded
    that latent and its tokens differed; that negative control is now tests/vllm/test_vllm_verify.py's
    (verification off), which also shows the comparisons catch wrong KV."""
    got = only(runs["D"], "c")
    assert got["tokens"] == only(runs["ref_tp1"], "c")["tokens"]
    assert "failed verification (identity" in runs["D"]["log"]
    # The refused values were dropped, so D stored PROMPT_C's chunks again: exactly the planted keys.
    prompt_keys = set(keys_of(runs["B"], "get"))
    planted = {key for key in keys_of(runs["A"], "put") if key not in prompt_keys}
    assert len(planted) == HIT_C // MLA_BLOCK
    assert set(keys_of(runs["D"], "put")) == planted
