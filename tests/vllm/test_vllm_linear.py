"""AiokvConnector on a linear-attention model: Qwen3-Next's gated delta net beside full attention.

A random 2-layer Qwen3-Next (``write_tiny_qwen3_next``: layer 0 a gated delta net, layer 1 full
attention) in vLLM's ``mamba_cache_mode="align"``: group 0 holds the delta net's states (one per
256-token block boundary), group 1 the attention KV, 256-token blocks. Engine A stores two prompts of
unaligned lengths; engines in other processes load them (Mooncake, standalone store). The state is
stored only where vLLM hands it over (the prompt's last block boundary), and a hit ends only where
both the attention chunks and the state at that very position are stored. Run inside a private
network namespace.

- B loads PROMPT: 1,792 of its 2,000 tokens (7 blocks; the state at 1,792 is the last one vLLM keeps
  before the prompt's end), greedy tokens equal to the run without a connector, logprobs within the
  tolerance a control gives (vLLM's own prefix cache reusing the same state vs. a whole prefill).
- B then loads PROMPT_Q (1,290 tokens: 10 computed after the state at 1,280, so that they and the
  outputs depend on it strongly), whose stored state is PROMPT's (a well-formed value under the wrong key):
  verification refuses it, the request is recomputed in every group and its tokens are right.
- The same swap with verification off (under another cache prefix) is the negative control: the
  wrong state loads, and the tokens change.
- E loads PROMPT with every get of the state group failing: its attention chunks load but the whole
  hit is recomputed in every group, and outputs are right.
- Three prompts sharing PROMPT's first 1,792 tokens arrive together at a fresh engine: each gets them.
- key_format "vllm": vLLM's own MooncakeStoreConnector stores a prompt, the connector loads it (the
  state and the attention blocks under vLLM's keys, whole pages) and stores another, which vLLM's
  connector loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiokv.testing.tiny_qwen3_next import write_tiny_qwen3_next
from tests.vllm.support import (
    assert_each_gets_the_prefix,
    assert_same_greedy,
    cold_and_warm,
    connector,
    generate,
    greedy_tolerance,
    key_logged_engine,
    keys_of,
    overwrite,
    read_value,
    require_vllm,
    run_engine,
    run_vllm_connector_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

BLOCK = 256  # "align" mode gives both groups the state group's block size
PROMPT, PROMPT_Q = tokens(81, 2000), tokens(82, 1290)
HIT, HIT_Q = 1792, 1280  # the last block boundary before each prompt's last token
# Three prompts sharing PROMPT's first 1,792 tokens (its stored state's prefix), suffixes of their own.
SHARED = [PROMPT[:HIT] + tokens(90 + i, 200 + 37 * i) for i in range(3)]
# Interop with vLLM's connector: both keep the state at the last block boundary before the last token.
INTEROP_D, INTEROP_E = tokens(83, 2000), tokens(84, 1700)
HIT_D, HIT_E = 1792, 1536
STATE_KEYS, FULL_KEYS = "hma-g0-state-gdn_attn", "hma-g1-full"
ALIGN = {"mamba_cache_mode": "align"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-linear"), mooncake_master.address) as world:
        world["model"] = write_tiny_qwen3_next(world["root"] / "tiny-qwen3-next")
        yield world


def with_connector(
    world: dict[str, Any], name: str, steps: list[dict[str, Any]], **options: Any
) -> dict[str, Any]:
    """An engine with the connector in "align" mode, its puts and gets recorded (``run["keys"]``)."""
    return key_logged_engine(world, name, steps, engine=ALIGN, **options)


def state_puts(run: dict[str, Any]) -> dict[str, int]:
    """The state keys a run stored, in order, with their value sizes."""
    return {
        key: size
        for entry in run["keys"]
        if entry["op"] == "put"
        for key, size in zip(entry["keys"], entry["sizes"], strict=True)
        if STATE_KEYS in key
    }


def swap_states(backend: Any, run: dict[str, Any]) -> list[str]:
    """Give PROMPT_Q's state key PROMPT's state value (A stored PROMPT first); the keys, in order."""
    (p_key, p_size), (q_key, _) = list(state_puts(run).items())
    overwrite(backend, [q_key], read_value(backend, p_key, p_size))
    return [p_key, q_key]


@pytest.fixture(scope="module")
def runs(world: dict[str, Any], mooncake_backend: Any) -> dict[str, Any]:
    evict: dict[str, Any] = {"op": "evict"}
    out: dict[str, Any] = {}
    out["ref"] = run_engine(
        world["root"],
        "reference",
        model=world["model"],
        engine=ALIGN,
        steps=[
            *cold_and_warm("", PROMPT),
            *cold_and_warm("_q", PROMPT_Q),
            *cold_and_warm("_d", INTEROP_D),
            *cold_and_warm("_e", INTEROP_E),
            generate("cold_shared", SHARED),
            evict,
            generate("prefix", [PROMPT[: HIT + 1]]),  # caches the shared blocks and the state at 1,792
            generate("warm_shared", SHARED),
        ],
    )
    stores = [generate("p", [PROMPT]), {"op": "flush"}, generate("q", [PROMPT_Q]), {"op": "flush"}]
    out["A"] = with_connector(world, "A", stores)
    out["A_off"] = with_connector(world, "A_off", stores, verify_values=False, cache_prefix="off")
    out["swapped"] = swap_states(mooncake_backend, out["A"])
    out["swapped_off"] = swap_states(mooncake_backend, out["A_off"])
    out["B"] = with_connector(
        world, "B", [generate("p", [PROMPT]), generate("q", [PROMPT_Q]), {"op": "stats"}]
    )
    out["C_off"] = with_connector(
        world, "C_off", [generate("q", [PROMPT_Q]), {"op": "stats"}], verify_values=False, cache_prefix="off"
    )
    out["E"] = with_connector(
        world,
        "E",
        [generate("p", [PROMPT]), {"op": "stats"}],
        backend="tests.vllm.support:failing_group_gets_mooncake",
        env={"AIOKV_TEST_FAIL_KEYS_WITH": STATE_KEYS},
    )
    return out


def only(run: dict[str, Any], name: str) -> dict[str, Any]:
    (output,) = run[name]["outputs"]
    return output


def tolerance(ref: dict[str, Any]) -> float:
    """Controls: vLLM reusing its own cached state and blocks vs. computing the whole prompt."""
    return greedy_tolerance([(only(ref, f"warm{p}"), only(ref, f"cold{p}")) for p in ("", "_q")])


def test_the_reference_reuses_the_state_itself(runs: dict[str, Any]) -> None:
    """What the hits below are measured against: vLLM's own prefix cache in "align" mode reuses
    the same boundaries (and the model's tokens depend on what it computes, not only on its weights:
    the two prompts' outputs differ)."""
    ref = runs["ref"]
    assert only(ref, "warm")["cached"] == HIT and only(ref, "warm_q")["cached"] == HIT_Q
    assert only(ref, "cold")["tokens"] != only(ref, "cold_q")["tokens"]


def test_a_linear_attention_engine_loads_what_another_engine_stored(runs: dict[str, Any]) -> None:
    got = only(runs["B"], "p")
    assert got["cached"] == HIT
    assert got["tokens"] == only(runs["ref"], "cold")["tokens"]
    assert_same_greedy(got, only(runs["ref"], "warm"), tolerance(runs["ref"]))


def test_states_are_stored_at_the_handed_boundaries_only(runs: dict[str, Any]) -> None:
    """One state per prompt (at 1,792 and 1,280: where vLLM hands them over), every full block of
    attention; B reads PROMPT's state and the attention chunks before it, nothing more."""
    stored = state_puts(runs["A"])
    assert len(stored) == 2, stored
    assert len(set(keys_of(runs["A"], "put", FULL_KEYS))) == (2000 // BLOCK) + (1290 // BLOCK)
    loaded_state = set(keys_of(runs["B"], "get", STATE_KEYS))
    assert loaded_state == {runs["swapped"][0], runs["swapped"][1]}  # PROMPT's, then PROMPT_Q's
    assert len(set(keys_of(runs["B"], "get", FULL_KEYS))) == (HIT + HIT_Q) // BLOCK


def test_another_prompts_state_is_refused_and_recomputed(runs: dict[str, Any]) -> None:
    """PROMPT_Q's state key holds PROMPT's state: B finds it, verification refuses it (the value
    names another key), the request is recomputed in every group, and its tokens are right."""
    run = runs["B"]
    assert "failed verification (identity" in run["log"]
    assert run["stats"]["events"]["load_error_requests"] == 1
    assert only(run, "q")["tokens"] == only(runs["ref"], "cold_q")["tokens"]


def test_without_verification_the_wrong_state_changes_the_tokens(runs: dict[str, Any]) -> None:
    """The negative control: the same swap with values unverified loads PROMPT's state for PROMPT_Q
    (the attention chunks are PROMPT_Q's own), and the greedy tokens are no longer the reference's."""
    run = runs["C_off"]
    got = only(run, "q")
    assert got["cached"] == HIT_Q
    assert run["stats"]["events"].get("load_error_requests", 0) == 0
    assert set(keys_of(run, "get", STATE_KEYS)) == {runs["swapped_off"][1]}
    assert got["tokens"] != only(runs["ref"], "cold_q")["tokens"]


def test_a_failed_state_load_recomputes_every_group(runs: dict[str, Any]) -> None:
    """E's state gets all fail, its attention gets succeed: the whole hit counts failed in every
    group, vLLM recomputes it, and outputs are right."""
    run = runs["E"]
    assert len(set(keys_of(run, "get", FULL_KEYS))) == HIT // BLOCK  # loaded, then not used
    assert not keys_of(run, "get", STATE_KEYS)  # every one failed (the wrapper logs served gets only)
    assert run["stats"]["events"]["load_error_requests"] == 1
    got = only(run, "p")
    assert got["tokens"] == only(runs["ref"], "cold")["tokens"]
    assert_same_greedy(got, only(runs["ref"], "cold"), tolerance(runs["ref"]))


def test_concurrent_requests_sharing_a_stored_prefix(runs: dict[str, Any], world: dict[str, Any]) -> None:
    """Three other prompts sharing PROMPT's first 1,792 tokens arrive together at a fresh engine: the
    state is keyed by the prefix it ends, so each gets those 1,792 tokens (from the store, or from
    the request that loaded them first), with the right outputs."""
    run = with_connector(world, "G", [generate("shared", SHARED), {"op": "stats"}])
    assert_each_gets_the_prefix(run, runs["ref"], "shared", HIT, tolerance(runs["ref"]))
    assert set(keys_of(run, "get", STATE_KEYS)) == {runs["swapped"][0]}  # PROMPT's state
    assert run["stats"]["events"].get("load_error_requests", 0) == 0


def test_interop_with_vllms_mooncake_store_connector(runs: dict[str, Any], world: dict[str, Any]) -> None:
    """key_format "vllm": vLLM's connector stores D; the connector loads it (the state at 1,792 under
    vLLM's ``@group:0@`` key, the attention blocks before it under ``@group:1@``; every value a whole
    page, as vLLM's) with the reference's tokens, and stores E, which vLLM's connector loads."""
    ref, limit = runs["ref"], tolerance(runs["ref"])
    stores = [generate("d", [INTEROP_D], logprobs=False), {"op": "sleep", "seconds": 4}]
    run_vllm_connector_engine(world, "vllm_stores", stores, engine=ALIGN)
    steps = [generate("d", [INTEROP_D]), generate("e", [INTEROP_E]), {"op": "flush"}]
    ours = with_connector(world, "aiokv_vllm_format", steps, key_format="vllm")
    got = only(ours, "d")
    assert got["cached"] == HIT_D
    assert got["tokens"] == only(ref, "cold_d")["tokens"]
    assert_same_greedy(got, only(ref, "warm_d"), limit)
    gets = [
        (key, size)
        for entry in ours["keys"]
        if entry["op"] == "get"
        for key, size in zip(entry["keys"], entry["sizes"], strict=True)
    ]
    states = [(key, size) for key, size in gets if "@group:0@" in key]
    blocks = [(key, size) for key, size in gets if "@group:1@" in key]
    assert len(states) == 1 and len(blocks) == HIT_D // BLOCK, gets
    assert {size for _, size in states + blocks} == {blocks[0][1]}  # one page each, the state's too
    theirs = run_vllm_connector_engine(world, "vllm_loads", [generate("e", [INTEROP_E])], engine=ALIGN)
    got = only(theirs, "e")
    assert got["cached"] == HIT_E
    assert got["tokens"] == only(ref, "cold_e")["tokens"]
    assert_same_greedy(got, only(ref, "warm_e"), limit)


def start_up_refusal(tmp_path: Path, name: str, engine: dict[str, Any]) -> str:
    """The error of an engine of the test model with the connector that must not start (its log's tail)."""
    require_vllm()
    model = write_tiny_qwen3_next(tmp_path / "tiny-qwen3-next")
    with pytest.raises(AssertionError) as failed:
        run_engine(
            tmp_path,
            name,
            model=model,
            engine=engine,
            kv_transfer_config=connector({"backend": "memory"}),
            steps=[generate("p", [tokens(65, 600)])],
        )
    return str(failed.value)


def test_mode_none_is_refused_with_the_reason(tmp_path: Path) -> None:
    """With prefix caching off vLLM runs the state group in mamba_cache_mode "none" (one running state
    per request, which no prefix key can name; with prefix caching on, "align" is vLLM's default): the
    engine does not start with the connector, and says why."""
    message = start_up_refusal(tmp_path, "qwen3-next-mode-none", {"enable_prefix_caching": False})
    assert "only with mamba_cache_mode='align'" in message, message
    assert "runs mamba_cache_mode='none'" in message and "boundary_state_offloads" in message, message


def test_prefix_hashes_finer_than_a_block_are_refused_at_start_up(tmp_path: Path) -> None:
    """vLLM's ``prefix_match_unit`` (taken on hybrid engines only) below the block size hashes prefixes
    every 16 tokens: the connector would key a block by a shorter prefix than it ends (two prompts
    parting inside it would share its bytes), so the engine does not start, and says why. Proves
    vLLM hands the unit to the connector's scheduler side."""
    message = start_up_refusal(tmp_path, "qwen3-next-finer-hashes", {**ALIGN, "prefix_match_unit": 16})
    assert "hashes prefixes every 16 tokens (prefix_match_unit) and its blocks hold 256" in message, message
