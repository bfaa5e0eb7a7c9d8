"""Verified values on real vLLM engines (CPU build) against a real Mooncake store.

Engine A stores four prompts; between A's store and B's load the test damages the store the way a
bad disk or a store bug would: one bit of one value flipped, and two equal-size values swapped
between keys of two prompts. B (another process) reports exactly those chunks failed (stats:
``VERIFY_FAILED``, by reason), recomputes them, and its greedy outputs are the no-connector run's.
The same damage with verification off is the negative control: every chunk counts as loaded, nothing
is recomputed, and the swapped values change the outputs. Run inside a private network namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiokv import Code
from aiokv.testing.tiny_model import write_tiny_llama
from tests.mooncake_support import registered
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    read_key_log,
    read_value,
    run_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

PROMPT_TOKENS = 1100  # 8 full blocks (chunk_blocks 1: 8 keys), and decode stays in the ninth
CHUNKS = (PROMPT_TOKENS - 1) // BLOCK
KEYS = CHUNKS + 1  # and the prompt's last partial block (store_prompt_tails): a hit is the whole prompt
PROMPTS = {"ok": tokens(51, PROMPT_TOKENS), "flip": tokens(52, PROMPT_TOKENS)}
PROMPTS |= {"swap1": tokens(53, PROMPT_TOKENS), "swap2": tokens(54, PROMPT_TOKENS)}
FLIPPED_CHUNK = 5
SWAPPED = (2, 6)  # swap1's chunk 2 <-> swap2's chunk 6
FLIPPED_BYTE, FLIPPED_BIT = 1001, 0x40  # an exponent bit of a bfloat16 (little-endian high byte)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-verify"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / "tiny-llama")
        yield world


def engine(world: dict[str, Any], name: str, steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """An engine with the connector on Mooncake, its puts and gets recorded (``run["keys"]``)."""
    log = world["root"] / f"{name}.keys.jsonl"
    run = run_engine(
        world["root"],
        name,
        model=world["model"],
        env={**MOONCAKE_ENV, "AIOKV_TEST_KEY_LOG": str(log)},
        kv_transfer_config=connector(
            {
                "backend": "tests.vllm.support:key_log_mooncake",
                "mooncake_config": str(world["mooncake_config"]),
                **extra,
            }
        ),
        steps=steps,
    )
    run["keys"] = read_key_log(log)
    return run


def stored_keys(run: dict[str, Any]) -> dict[str, tuple[list[str], int]]:
    """Per prompt, its keys in block order and their value size: A stores the prompts one at a time
    (a flush after each), so its puts come prompt by prompt."""
    puts = [entry for entry in run["keys"] if entry["op"] == "put"]
    assert all(code >= 0 for entry in puts for code in entry["codes"]), puts
    keys = list(dict.fromkeys(key for entry in puts for key in entry["keys"]))
    sizes = {size for entry in puts for size in entry["sizes"]}
    assert len(keys) == KEYS * len(PROMPTS) and len(sizes) == 1, (len(keys), sizes)
    size = sizes.pop()
    return {name: (keys[i * KEYS : (i + 1) * KEYS], size) for i, name in enumerate(PROMPTS)}


def damage(backend: Any, keys: dict[str, tuple[list[str], int]]) -> list[str]:
    """Flip one bit of one value and swap two values, straight in the store; the damaged keys."""
    flip_key = keys["flip"][0][FLIPPED_CHUNK]
    a, b = keys["swap1"][0][SWAPPED[0]], keys["swap2"][0][SWAPPED[1]]
    size = keys["flip"][1]
    values = {key: bytearray(read_value(backend, key, size)) for key in (flip_key, a, b)}
    values[flip_key][FLIPPED_BYTE] ^= FLIPPED_BIT
    values[a], values[b] = values[b], values[a]
    assert backend.batch_remove(list(values), force=True) == [0] * 3
    buffer = np.frombuffer(b"".join(values.values()), dtype=np.uint8).copy()
    with registered(backend, buffer) as addr:
        codes = backend.batch_put(list(values), [[addr + i * size] for i in range(3)], [[size]] * 3)
    assert codes == [0] * 3, codes
    return list(values)


def store_steps() -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    for name, prompt in PROMPTS.items():
        steps += [generate(name, [prompt], max_tokens=MAX_TOKENS, logprobs=False), {"op": "flush"}]
    return steps


def load_steps() -> list[dict[str, Any]]:
    loads = [generate(name, [prompt], max_tokens=MAX_TOKENS) for name, prompt in PROMPTS.items()]
    return [*loads, {"op": "flush"}, {"op": "stats"}]


@pytest.fixture(scope="module")
def runs(world: dict[str, Any], mooncake_backend: Any) -> dict[str, Any]:
    """The reference (no connector, each prompt from an empty prefix cache); A stores, the store is
    damaged, B loads; then the same with verification off under another cache prefix (A_off, C_off)."""
    out: dict[str, Any] = {}
    reference_steps: list[dict[str, Any]] = []
    for name, prompt in PROMPTS.items():
        reference_steps += [{"op": "evict"}, generate(name, [prompt], max_tokens=MAX_TOKENS)]
    out["ref"] = run_engine(world["root"], "reference", model=world["model"], steps=reference_steps)
    for suffix, extra in (("", {}), ("_off", {"verify_values": False, "cache_prefix": "unverified"})):
        out["A" + suffix] = engine(world, "A" + suffix, store_steps(), **extra)
        out["damaged" + suffix] = damage(mooncake_backend, stored_keys(out["A" + suffix]))
        out["B" + suffix] = engine(world, "B" + suffix, load_steps(), **extra)
    return out


def only(run: dict[str, Any], name: str) -> dict[str, Any]:
    (output,) = run[name]["outputs"]
    return output


def test_damaged_chunks_fail_and_are_recomputed_to_the_reference_outputs(runs: dict[str, Any]) -> None:
    b, ref = runs["B"], runs["ref"]
    # The control that sizes the logprob tolerance: the undamaged prompt, loaded whole.
    ok = only(b, "ok")
    assert ok["cached"] == PROMPT_TOKENS
    tolerance = greedy_tolerance([(ok, only(ref, "ok"))])
    for name in PROMPTS:
        assert_same_greedy(only(b, name), only(ref, name), tolerance, name)
    stats = b["stats"]
    # Exactly the three damaged chunks failed, each for what was done to it.
    assert stats["backend_errors"] == {str(int(Code.VERIFY_FAILED)): 3}, stats["backend_errors"]
    verification = stats["verification"]
    assert (verification["checksum"], verification["identity"]) == (1, 2), verification
    assert verification["fingerprint"] == verification["format"] == verification["length"] == 0
    assert stats["events"]["load_error_blocks"] >= 3
    # The broken values were dropped, so B stored those chunks again once it had recomputed them.
    assert stats["chunks"]["stored"] == 3, stats["chunks"]
    # Each logged once, naming its key.
    for key in runs["damaged"]:
        assert sum(key in line and "failed verification" in line for line in b["log"].splitlines()) == 1


def test_without_verification_the_damage_is_loaded_and_changes_the_outputs(runs: dict[str, Any]) -> None:
    """Negative control: every chunk counts as loaded, none failed, and the swapped values change the
    outputs of both prompts (so the comparisons above would catch wrong KV)."""
    b, ref = runs["B_off"], runs["ref"]
    stats = b["stats"]
    assert "verification" not in stats
    assert not stats["backend_errors"], stats["backend_errors"]
    assert stats["chunks"]["loaded"] == KEYS * len(PROMPTS), stats["chunks"]
    assert stats["chunks"].get("stored", 0) == 0  # nothing failed, so nothing was written again
    for name in ("swap1", "swap2"):
        got = only(b, name)
        assert got["cached"] == PROMPT_TOKENS
        assert got["tokens"] != only(ref, name)["tokens"], name
