"""AiokvConnector with tensor and pipeline parallelism on real vLLM engines (CPU build) and Mooncake.

Engines with TP 2 or PP 2 run vLLM's multiprocess executor (one worker process per rank, each with its
own connector and Mooncake client). Engine A stores a prompt; engine B, another process of the same
shape, loads it; each rank writes and reads only its own shard (keys carry the TP and PP ranks and
sizes). A TP-1 engine given the TP-2 engines' prompt misses: another TP size holds other shards, so it
never shares keys. Every output is compared with a run without any connector (vLLM reusing the same
prefix from its own prefix cache; ``support.assert_same_greedy``). Run inside a private network namespace.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.backends.value_header import HEADER_BYTES
from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    PARALLEL_ENV,
    TP2_ENGINE,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    read_key_log,
    read_value,
    require_vllm,
    run_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

PROMPT = tokens(41, 2100)  # 16 full blocks: 4 chunks of 4 blocks
CHUNKS = 4
PARALLEL_TIMEOUT_S = 600
# Pipeline parallelism on vLLM's CPU worker needs a compilation mode other than NONE (with
# enforce_eager the warm-up that allocates the stages' intermediate tensors is skipped, and the
# second stage fails an assertion). Mode 1 (stock torch.compile) runs eagerly here, as the engine job
# disables TorchDynamo.
PP2_ENGINE = {
    "pipeline_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "enforce_eager": False,
    "compilation_config": {"mode": 1},
}  # a TP-2 engine starts in ~30 s alone, minutes on a loaded 2-core machine


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-parallel"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / "tiny-llama")
        yield world


def logged(world: dict[str, Any], engine: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The connector config and env of an engine whose puts and gets go to ``<engine>.keys.jsonl``."""
    kv = connector(
        {
            "backend": "tests.vllm.support:key_log_mooncake",
            "mooncake_config": str(world["mooncake_config"]),
            # Keys of several blocks (the default is one per block): what this module counts and sizes.
            "chunk_blocks": 4,
        }
    )
    return kv, {**MOONCAKE_ENV, "AIOKV_TEST_KEY_LOG": str(world["root"] / f"{engine}.keys.jsonl")}


def reference(world: dict[str, Any], name: str, engine: dict[str, Any], env: dict[str, str]) -> Any:
    """No connector: the prompt "cold", then "warm" (vLLM's own prefix cache holds the 16 blocks a
    loading engine loads: the same reused/computed split)."""
    steps = [generate("cold", [PROMPT]), generate("warm", [PROMPT])]
    return run_engine(
        world["root"], name, model=world["model"], engine=engine, env=env, steps=steps,
        timeout=PARALLEL_TIMEOUT_S,
    )  # fmt: skip


def given_the_prompt(
    world: dict[str, Any], name: str, engine: dict[str, Any], env: dict[str, str], *, stores: bool = False
) -> dict[str, Any]:
    """An engine with the key-logging connector given the prompt; its run and the keys it put and got.
    ``stores``: it stays up 3 s after, while its stores finish in the background."""
    kv, log_env = logged(world, name)
    steps = [generate("p", [PROMPT])]
    if stores:
        steps.append({"op": "sleep", "seconds": 3})
    run = run_engine(
        world["root"], name, model=world["model"], engine=engine, env={**env, **log_env},
        kv_transfer_config=kv, steps=steps, timeout=PARALLEL_TIMEOUT_S,
    )  # fmt: skip
    return {name: run, f"{name}_keys": read_key_log(world["root"] / f"{name}.keys.jsonl")}


@pytest.fixture(scope="module")
def runs(world: dict[str, Any]) -> dict[str, Any]:
    """The references (no connector; TP 2 "cold" and "warm", TP 1 cold), then A (TP 2) stores the
    prompt, B (TP 2, another process) and C (TP 1) are given it."""
    out: dict[str, Any] = {"ref_tp2": reference(world, "ref_tp2", TP2_ENGINE, PARALLEL_ENV)}
    steps = [generate("cold", [PROMPT]), generate("warm", [PROMPT])]
    out["ref_tp1"] = run_engine(world["root"], "ref_tp1", model=world["model"], steps=steps)
    out |= given_the_prompt(world, "A", TP2_ENGINE, PARALLEL_ENV, stores=True)
    out |= given_the_prompt(world, "B", TP2_ENGINE, PARALLEL_ENV)
    out |= given_the_prompt(world, "C", {}, {})
    return out


def only(run: dict[str, Any], name: str) -> dict[str, Any]:
    (output,) = run[name]["outputs"]
    return output


def control(ref: dict[str, Any]) -> float:
    """The logprob tolerance from a reference's own control: the prompt computed whole against behind
    vLLM's cached prefix (``support.greedy_tolerance``)."""
    return greedy_tolerance([(only(ref, "warm"), only(ref, "cold"))])


def keys_by_rank(entries: list[dict[str, Any]], op: str, rank: str = "tp_rank") -> dict[int, list[str]]:
    by_rank: dict[int, list[str]] = {}
    for entry in entries:
        if entry["op"] == op:
            assert all(code >= 0 for code in entry["codes"]), entry
            by_rank.setdefault(entry[rank], []).extend(entry["keys"])
    return by_rank


def test_tp2_engine_loads_every_full_block_stored_by_another_tp2_engine(runs: dict[str, Any]) -> None:
    got = only(runs["B"], "p")
    assert got["cached"] == 16 * BLOCK
    # As vLLM reusing the same 2,048 tokens from its own prefix cache, and as computing the whole prompt.
    assert_same_greedy(got, only(runs["ref_tp2"], "warm"), control(runs["ref_tp2"]), "B against warm")
    assert_same_greedy(got, only(runs["ref_tp2"], "cold"), control(runs["ref_tp2"]), "B against cold")


def test_each_tp_rank_stores_and_loads_its_own_shard(runs: dict[str, Any], mooncake_backend: Any) -> None:
    puts = keys_by_rank(runs["A_keys"], "put")
    assert sorted(puts) == [0, 1], puts.keys()
    assert all(len(set(keys)) == CHUNKS for keys in puts.values()), puts
    # The same chunks under each rank's name, nothing shared.
    assert not set(puts[0]) & set(puts[1])
    assert sorted(k.replace(".tp0.", ".tp1.") for k in puts[0]) == sorted(puts[1])
    assert all(re.search(r"@tp2pp1/.*\.tp0\.pp0/", key) for key in puts[0]), puts[0]
    # All in the store; each rank's value is its own shard (other KV heads: other bytes).
    sizes = {entry["keys"][0]: entry["sizes"][0] for entry in runs["A_keys"] if entry["op"] == "put"}
    assert mooncake_backend.batch_exists(puts[0] + puts[1]) == [True] * (2 * CHUNKS)
    for key in puts[0][:1]:
        other = key.replace(".tp0.", ".tp1.")
        size = sizes.get(key) or sizes[other]
        # Compared without the verification header (which names the key, so always differs).
        payload = size - HEADER_BYTES
        assert (
            read_value(mooncake_backend, key, size)[:payload]
            != read_value(mooncake_backend, other, size)[:payload]
        )
    # B's rank r read exactly rank r's keys.
    gets = keys_by_rank(runs["B_keys"], "get")
    assert {rank: sorted(set(keys)) for rank, keys in gets.items()} == {
        rank: sorted(set(keys)) for rank, keys in puts.items()
    }


def test_other_tp_size_misses_and_stays_exact(runs: dict[str, Any], mooncake_backend: Any) -> None:
    """TP 1 and TP 2 hold different shards under different keys: the TP-1 engine finds nothing of the
    TP-2 engines' prompt (though it is in the store), computes it, and its outputs are exact."""
    got = only(runs["C"], "p")
    assert got["cached"] == 0
    assert not [entry for entry in runs["C_keys"] if entry["op"] == "get"]
    assert_same_greedy(got, only(runs["ref_tp1"], "cold"), control(runs["ref_tp1"]), "TP-1 engine")
    tp2_keys = [key for keys in keys_by_rank(runs["A_keys"], "put").values() for key in keys]
    assert all(mooncake_backend.batch_exists(tp2_keys))
    # C stored the prompt under its own TP-1 keys, beside the TP-2 ones.
    tp1_keys = keys_by_rank(runs["C_keys"], "put")[0]
    assert len(set(tp1_keys)) == CHUNKS
    assert all("@tp1pp1/" in key for key in tp1_keys) and not set(tp1_keys) & set(tp2_keys)


@pytest.fixture(scope="module")
def pp_runs(world: dict[str, Any]) -> dict[str, Any]:
    """With PP 2: the reference (cold, warm), A stores the prompt, B (another process) loads it."""
    out: dict[str, Any] = {"ref": reference(world, "ref_pp2", PP2_ENGINE, PARALLEL_ENV)}
    out |= given_the_prompt(world, "pp_A", PP2_ENGINE, PARALLEL_ENV, stores=True)
    out |= given_the_prompt(world, "pp_B", PP2_ENGINE, PARALLEL_ENV)
    return out


def test_pp2_engine_loads_every_full_block_and_matches(pp_runs: dict[str, Any]) -> None:
    got = only(pp_runs["pp_B"], "p")
    assert got["cached"] == 16 * BLOCK
    # As vLLM reusing the same 2,048 tokens itself. (That reuse already changed the sixth greedy token
    # of a whole-prompt run at PP 2 on an AMX CPU, a near tie: so no comparison of tokens with it.)
    assert_same_greedy(got, only(pp_runs["ref"], "warm"), control(pp_runs["ref"]), "PP-2 engine")


def test_each_pp_stage_stores_and_loads_its_own_layers(
    pp_runs: dict[str, Any], mooncake_backend: Any
) -> None:
    puts = keys_by_rank(pp_runs["pp_A_keys"], "put", rank="pp_rank")
    assert sorted(puts) == [0, 1], puts.keys()
    assert all(len(set(keys)) == CHUNKS for keys in puts.values()), puts
    assert all(re.search(r"@tp1pp2/.*\.tp0\.pp0/", key) for key in puts[0]), puts[0]
    assert all(re.search(r"@tp1pp2/.*\.tp0\.pp1/", key) for key in puts[1]), puts[1]
    assert mooncake_backend.batch_exists(puts[0] + puts[1]) == [True] * (2 * CHUNKS)
    # One of the model's two layers per stage: a chunk is 4 blocks of one layer (and its verification
    # header: the recording wrapper is the store below it).
    sizes = {entry["sizes"][0] for entry in pp_runs["pp_A_keys"] if entry["op"] == "put"}
    assert sizes == {4 * 64 * 1024 + HEADER_BYTES}, sizes
    gets = keys_by_rank(pp_runs["pp_B_keys"], "get", rank="pp_rank")
    assert {rank: sorted(set(keys)) for rank, keys in gets.items()} == {
        rank: sorted(set(keys)) for rank, keys in puts.items()
    }


def test_listed_but_unreadable_keys_are_recomputed_once_not_loaded_forever(tmp_path: Any) -> None:
    """A lookup finds every key, every load fails (as when another TP size's value sits under a
    ``key_format "vllm"`` key, which names no TP size): vLLM recomputes the failed blocks and asks the
    connector again, which must then answer a miss. It used to answer the same hit, and the request
    was loaded and rescheduled until the engine was killed."""
    require_vllm()
    model = write_tiny_llama(tmp_path / "tiny-llama")
    out = run_engine(
        tmp_path,
        "failing_gets",
        model=model,
        kv_transfer_config=connector({"backend": "tests.vllm.support:failing_gets_memory"}),
        steps=[generate("first", [PROMPT]), {"op": "flush"}, {"op": "evict"}, generate("again", [PROMPT])],
        timeout=180,
    )
    got, first = only(out, "again"), only(out, "first")
    assert got["cached"] == 0
    assert got["tokens"] == first["tokens"]
    assert out["log"].count("Recovered from KV load failure") == 1


@pytest.mark.parametrize(
    ("is_mla", "key_format", "says"),
    [
        (False, "aiokv", "TP size 2 and PP size 1; engines of other sizes miss them"),
        (True, "aiokv", "any TP size (MLA: one shared key per chunk) and PP size 1"),
        (False, "vllm", "name no TP size: give every engine sharing them TP size 2"),
    ],
)
def test_start_up_log_says_which_engines_share_the_keys(
    caplog: pytest.LogCaptureFixture, is_mla: bool, key_format: str, says: str
) -> None:
    require_vllm()
    from types import SimpleNamespace

    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.common.geometry import EngineGeometry, KVGeometry
    from aiokv.integrations.vllm.scheduler_side.key_scope import log_key_scope

    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="/models/tiny-llama", get_total_num_kv_heads=lambda: 2),
    )
    config = ConnectorConfig.from_extra_config({"key_format": key_format, "backend": "memory"})
    group = KVGeometry(("layer.0",), block_size=128, page_bytes=65536, dtype="bfloat16", is_mla=is_mla)
    geometry = EngineGeometry((group,))
    with caplog.at_level(logging.INFO, logger="aiokv.vllm"):
        log_key_scope(vllm_config, config, geometry)
    (record,) = [record for record in caplog.records if record.name == "aiokv.vllm"]
    assert "'tiny-llama" in record.getMessage() and says in record.getMessage(), record.getMessage()
