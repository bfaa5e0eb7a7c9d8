"""AiokvConnector with vLLM's hybrid allocator on: a model with sliding-window and full-attention layers.

A random Llama whose layer 0 attends over a 256-token window and layer 1 over everything
(``write_tiny_sliding_llama``): vLLM gives each kind its own KV-cache group (group 0 sliding window,
group 1 full attention, 128-token blocks). Engine A stores two prompts longer than the window, of
unaligned lengths; engines in other processes load them (Mooncake, standalone store). Run inside a
private network namespace.

- B loads: greedy tokens equal to the run without a connector, logprobs within the tolerance a
  control gives (vLLM's own prefix cache reusing the same blocks vs. a whole prefill); the sliding
  window group reads only the blocks its window needs, the full-attention group every block.
- D loads a prompt whose full-attention values are another prompt's: verification refuses them, the
  request is recomputed and its tokens are right.
- E loads that prompt with every get of the sliding-window group failing: the whole hit is recomputed
  in every group, so the wrong full-attention values it did load are never used, and outputs are right.
- F, the same model with the hybrid allocator off (one full-attention group), finds none of A's keys.

The host tier (backend "memory") is refused at start-up on the hybrid model, with the reason.
Linear-attention models (Qwen3-Next's gated delta net): tests/vllm/test_vllm_linear.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_sliding_llama
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    assert_each_gets_the_prefix,
    assert_same_greedy,
    cold_and_warm,
    connector,
    generate,
    greedy_tolerance,
    key_logged_engine,
    keys_of,
    overwrite,
    read_key_log,
    read_value,
    run_engine,
    run_vllm_connector_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

WINDOW = 256
PROMPT = tokens(61, 2000)  # 15 full blocks and 80 tokens
PROMPT_C = tokens(63, 1500)  # 11 full blocks and 92 tokens
HIT, HIT_C = 1920, 1408  # their full blocks; each prompt's last partial block is one key more
INTEROP_D, INTEROP_E = tokens(66, 1300), tokens(67, 1300)  # 10 full blocks: 1,280 tokens
SHARED_PREFIX = 1536  # 12 of PROMPT's blocks, shared by three concurrent requests
SHARED = [PROMPT[:SHARED_PREFIX] + tokens(70 + i, 300 + 37 * i) for i in range(3)]
SWA_KEYS, FULL_KEYS = "hma-g0-swa256", "hma-g1-full"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-hybrid"), mooncake_master.address) as world:
        world["model"] = write_tiny_sliding_llama(world["root"] / "tiny-swa", sliding_window=WINDOW)
        yield world


def with_connector(
    world: dict[str, Any], name: str, steps: list[dict[str, Any]], **options: Any
) -> dict[str, Any]:
    """An engine with the connector (one block per key), its puts and gets recorded (``run["keys"]``)."""
    return key_logged_engine(world, name, steps, chunk_blocks=1, **options)


@pytest.fixture(scope="module")
def reference(world: dict[str, Any]) -> dict[str, Any]:
    """Every prompt without a connector: "cold" computed whole, "warm" with vLLM's own prefix cache
    reusing the blocks the connector loads."""
    evict: dict[str, Any] = {"op": "evict"}
    return run_engine(
        world["root"],
        "reference",
        model=world["model"],
        steps=[
            *cold_and_warm("", PROMPT),
            *cold_and_warm("_c", PROMPT_C),
            *cold_and_warm("_d", INTEROP_D),
            *cold_and_warm("_e", INTEROP_E),
            generate("cold_shared", SHARED),
            evict,
            generate("prefix", [PROMPT[: SHARED_PREFIX + 1]]),  # caches the shared 12 blocks
            generate("warm_shared", SHARED),
        ],
    )


@pytest.fixture(scope="module")
def runs(world: dict[str, Any], reference: dict[str, Any], mooncake_backend: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"ref": reference}
    stores = [generate("p", [PROMPT]), generate("c", [PROMPT_C]), {"op": "flush"}]
    out["A"] = with_connector(world, "A", stores)
    out["B"] = with_connector(world, "B", [generate("p", [PROMPT]), {"op": "stats"}])
    # PROMPT_C's full-attention keys now hold one of PROMPT's blocks.
    prompt_full = keys_of(out["B"], "get", FULL_KEYS)
    c_full = [key for key in dict.fromkeys(keys_of(out["A"], "put", FULL_KEYS)) if key not in prompt_full]
    size = next(entry["sizes"][0] for entry in out["A"]["keys"] if entry["op"] == "put")
    overwrite(mooncake_backend, c_full, read_value(mooncake_backend, prompt_full[0], size))
    out["c_full_keys"] = c_full
    # D drops the values it refuses and stores C again; draining lets it store C's last partial block.
    out["D"] = with_connector(world, "D", [generate("c", [PROMPT_C]), {"op": "drain"}, {"op": "stats"}])
    out["E"] = with_connector(
        world,
        "E",
        [generate("c", [PROMPT_C]), {"op": "stats"}],
        backend="tests.vllm.support:failing_group_gets_mooncake",
        env={"AIOKV_TEST_FAIL_KEYS_WITH": SWA_KEYS},
    )
    # With the hybrid allocator off, one group holds the windowed and the global layer; vLLM 0.32's CPU
    # attention then plans split-KV decode without the window, and with one OpenMP thread layer 0's
    # decode reads only masked partitions: NaN, greedy token 0 from the second token on, with or
    # without a connector (docs/vllm.md). Split-KV off keeps that vLLM bug out of what F tests.
    out["F"] = with_connector(
        world,
        "F",
        [generate("p", [PROMPT])],
        engine={"disable_hybrid_kv_cache_manager": True},
        env={"VLLM_CPU_ATTN_SPLIT_KV": "0"},
    )
    return out


def only(run: dict[str, Any], name: str) -> dict[str, Any]:
    (output,) = run[name]["outputs"]
    return output


def tolerance(ref: dict[str, Any]) -> float:
    """Controls: vLLM reusing its own cached blocks vs. computing the whole prompt (equal on CPUs with
    AMX, up to ~0.06 apart with vLLM's "vec" kernels)."""
    return greedy_tolerance([(only(ref, f"warm{p}"), only(ref, f"cold{p}")) for p in ("", "_c", "_d", "_e")])


def test_hybrid_engine_loads_what_another_engine_stored(runs: dict[str, Any]) -> None:
    got = only(runs["B"], "p")
    assert got["cached"] == len(PROMPT)  # every full block and the last partial block
    assert_same_greedy(got, only(runs["ref"], "warm"), tolerance(runs["ref"]))
    assert got["tokens"] == only(runs["ref"], "cold")["tokens"]


def test_each_group_stores_its_own_keys_and_the_window_loads_only_what_it_needs(runs: dict[str, Any]) -> None:
    stored_full = set(keys_of(runs["A"], "put", FULL_KEYS))
    stored_window = set(keys_of(runs["A"], "put", SWA_KEYS))
    assert len(stored_full) == len(stored_window) == (HIT + HIT_C) // BLOCK + 2
    loaded_full, loaded_window = keys_of(runs["B"], "get", FULL_KEYS), keys_of(runs["B"], "get", SWA_KEYS)
    assert len(set(loaded_full)) == HIT // BLOCK + 1  # every block of the hit
    # Only the blocks inside the window of the hit's end: vLLM hands null blocks for the others.
    assert WINDOW // BLOCK <= len(set(loaded_window)) <= WINDOW // BLOCK + 1, loaded_window
    assert set(loaded_window) <= stored_window and set(loaded_full) <= stored_full


def test_other_prompts_values_are_refused_and_recomputed(runs: dict[str, Any]) -> None:
    """PROMPT_C's full-attention keys hold one of PROMPT's blocks (a well-formed value under the wrong
    key): D finds them, refuses each on load (the value names another key; each group's values are
    verified under its own fingerprint), recomputes the request in every group, and its tokens are the
    reference's. The negative control without verification (wrong KV changes the tokens) is
    tests/vllm/test_vllm_verify.py's."""
    run = runs["D"]
    assert set(keys_of(run, "get", FULL_KEYS)) == set(runs["c_full_keys"])
    assert "failed verification (identity" in run["log"]
    assert run["stats"]["events"]["load_error_requests"] == 1
    assert only(run, "c")["tokens"] == only(runs["ref"], "cold_c")["tokens"]


def test_a_failure_in_one_group_recomputes_the_range_in_every_group(runs: dict[str, Any]) -> None:
    """E's sliding-window gets all fail; its full-attention gets succeed (D stored those chunks again
    after refusing the planted values). The whole hit counts failed in every group: vLLM recomputes
    it, and outputs are right."""
    run = runs["E"]
    assert set(keys_of(run, "get", FULL_KEYS)) == set(runs["c_full_keys"])  # loaded, then not used
    assert not keys_of(run, "get", SWA_KEYS)  # every one failed (the wrapper logs served gets only)
    assert run["stats"]["events"]["load_error_requests"] == 1
    assert only(run, "c")["tokens"] == only(runs["ref"], "cold_c")["tokens"]
    assert_same_greedy(only(run, "c"), only(runs["ref"], "cold_c"), tolerance(runs["ref"]))


def test_a_full_attention_engine_never_reads_hybrid_chunks(runs: dict[str, Any]) -> None:
    """The same model with the hybrid allocator off has one full-attention group over both layers: its
    keys are other keys, so it misses everything A stored (and computes the prompt right)."""
    run = runs["F"]
    got = only(run, "p")
    assert got["cached"] == 0
    puts = keys_of(run, "put", "")
    assert puts and not any("hma-" in key for key in puts)
    assert got["tokens"] == only(runs["ref"], "cold")["tokens"]


def test_concurrent_requests_sharing_a_stored_prefix(runs: dict[str, Any], world: dict[str, Any]) -> None:
    """Three requests sharing 1,536 of A's tokens arrive together at a fresh engine: each gets the
    shared blocks (from the store, or from the one that loaded them first), with the right outputs."""
    run = with_connector(world, "G", [generate("shared", SHARED), {"op": "stats"}])
    assert_each_gets_the_prefix(run, runs["ref"], "shared", SHARED_PREFIX, tolerance(runs["ref"]))
    assert set(keys_of(run, "get", FULL_KEYS)) <= set(keys_of(runs["A"], "put", FULL_KEYS))
    assert len(set(keys_of(run, "get", FULL_KEYS))) == SHARED_PREFIX // BLOCK
    assert run["stats"]["events"].get("load_error_blocks", 0) == 0


def test_interop_with_vllms_mooncake_store_connector(
    world: dict[str, Any], reference: dict[str, Any]
) -> None:
    """key_format "vllm" on the hybrid model: vLLM's connector stores D, aiokv loads it and stores E,
    vLLM's loads E; every group's keys are vLLM's (``@group:G@``)."""
    full = 1300 // BLOCK * BLOCK
    run_vllm_connector_engine(
        world, "vllm_stores", [generate("d", [INTEROP_D], logprobs=False), {"op": "sleep", "seconds": 4}]
    )
    log = world["root"] / "aiokv_vllm_format.keys.jsonl"
    ours = run_engine(
        world["root"],
        "aiokv_vllm_format",
        model=world["model"],
        env={**MOONCAKE_ENV, "AIOKV_TEST_KEY_LOG": str(log)},
        kv_transfer_config=connector(
            {
                "backend": "tests.vllm.support:key_log_mooncake",
                "mooncake_config": str(world["mooncake_config"]),
                "key_format": "vllm",
            }
        ),
        steps=[generate("d", [INTEROP_D]), generate("e", [INTEROP_E]), {"op": "flush"}],
    )
    ours["keys"] = read_key_log(log)
    got = only(ours, "d")
    assert got["cached"] == full
    limit = tolerance(reference)
    assert_same_greedy(got, only(reference, "warm_d"), limit)
    assert got["tokens"] == only(reference, "cold_d")["tokens"]
    loaded = keys_of(ours, "get", "@group:")
    assert {key.split("@group:")[1][0] for key in loaded} == {"0", "1"}, loaded
    theirs = run_vllm_connector_engine(world, "vllm_loads", [generate("e", [INTEROP_E])])
    got = only(theirs, "e")
    assert got["cached"] == full
    assert_same_greedy(got, only(reference, "warm_e"), limit)
    assert got["tokens"] == only(reference, "cold_e")["tokens"]


def test_host_tier_is_refused_on_hybrid_engines(world: dict[str, Any]) -> None:
    """The host tier holds one KV cache group's chunks: a hybrid engine with backend "memory" does not
    start, and says why."""
    with pytest.raises(AssertionError) as failed:
        run_engine(
            world["root"],
            "hybrid_tier",
            model=world["model"],
            kv_transfer_config=connector({"backend": "memory"}),
            steps=[generate("p", [PROMPT])],
        )
    message = str(failed.value)
    assert "supports models with one KV cache group; this model has 2" in message, message
    assert "swa256, full" in message, message
