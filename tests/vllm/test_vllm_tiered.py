"""The host-memory tier in front of Mooncake (``backend: "tiered"``) on real engines and a real master.

Engine A stores two prompts (into its tier and Mooncake) and hits them from its tier once vLLM's prefix
cache is dropped. Engine B, a fresh process with an empty tier of 24 blocks, loads them from Mooncake
(promoting them into its tier, which holds only 24 of their 28 blocks: the least recently used are
dropped), then hits again from both tiers. A disk tier in front of Mooncake (``"disk-tiered"``): engine
C promotes what it loads from Mooncake onto its disk, and engine D, a fresh process on the same
directory, hits it all from the disk. Every output equals the run without a connector. Run inside a
private network namespace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import MOONCAKE_ENV, connector, generate, run_engine, store_world
from tests.vllm.test_vllm_host_tier import (
    PROMPTS,
    REFERENCE_STEPS,
    WHOLE_PROMPTS,
    P,
    Q,
    assert_matches_reference,
)

pytestmark = pytest.mark.mooncake

KEYS = 15 + 1 + 13 + 1  # P's and Q's full blocks and last partial blocks: one key each (chunk_blocks 1)
SMALL_TIER = "3MiB"  # 24 blocks of the tiny model (2 layers x 64 KiB per block)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-tiered"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / "tiny-llama")
        yield world


def tiered(world: dict[str, Any], capacity: str) -> dict[str, Any]:
    return connector(
        {
            "backend": "tiered",
            "mooncake_config": str(world["mooncake_config"]),
            "memory_capacity": capacity,
            "chunk_blocks": 1,
        }
    )


@pytest.fixture(scope="module")
def runs(world: dict[str, Any]) -> dict[str, Any]:
    def engine(name: str, steps: list[dict[str, Any]], kv: dict[str, Any] | None = None) -> dict[str, Any]:
        return run_engine(
            world["root"], name, model=world["model"], steps=steps, kv_transfer_config=kv, env=MOONCAKE_ENV
        )

    flush_evict: list[dict[str, Any]] = [{"op": "flush"}, {"op": "evict"}]
    return {
        "reference": engine("reference", REFERENCE_STEPS),
        "a": engine(
            "tiered-a",
            [generate("first", PROMPTS), *flush_evict, generate("local", PROMPTS), {"op": "stats"}],
            tiered(world, "64MiB"),
        ),
        "b": engine(
            "tiered-b",
            [
                generate("remote_p", [P]),
                generate("remote_q", [Q]),
                *flush_evict,
                {"op": "stats", "name": "stats_remote"},
                generate("again", PROMPTS),
                {"op": "stats"},
            ],
            tiered(world, SMALL_TIER),
        ),
    }


def test_stores_go_to_both_tiers_and_hits_come_from_the_local_one(runs: dict[str, Any]) -> None:
    a, reference = runs["a"], runs["reference"]
    assert a["evict"] is True
    assert [out["cached"] for out in a["local"]["outputs"]] == WHOLE_PROMPTS
    assert_matches_reference(a["local"]["outputs"], reference, "local")
    tier = a["stats"]["host_tier"]
    assert tier["hits"] == KEYS and tier["promotions"] == 0
    # Mooncake got every block too, and the last partial block of the evict step's short prompt.
    assert a["stats"]["chunks"]["stored"] == KEYS + 1
    assert a["stats"]["chunks"].get("loaded", 0) == 0  # nothing was read from Mooncake


def test_a_remote_hit_is_promoted_and_eviction_pressure_keeps_outputs_exact(runs: dict[str, Any]) -> None:
    b, reference = runs["b"], runs["reference"]
    (remote_p,) = b["remote_p"]["outputs"]
    (remote_q,) = b["remote_q"]["outputs"]
    assert [remote_p["cached"], remote_q["cached"]] == WHOLE_PROMPTS  # from Mooncake: the tier was empty
    assert_matches_reference([remote_p, remote_q], reference, "remote")
    before = b["stats_remote"]
    assert before["host_tier"]["hits"] == 0 and before["chunks"]["loaded"] == KEYS
    # All of P's 16 keys were promoted, then Q's 14, dropping P's least recently used for room (and
    # for the evict step's short prompt, stored too).
    assert before["host_tier"]["promotions"] == KEYS and before["host_tier"]["evictions"] >= KEYS - 24
    assert [out["cached"] for out in b["again"]["outputs"]] == WHOLE_PROMPTS
    assert_matches_reference(b["again"]["outputs"], reference, "again")
    after = b["stats"]
    assert after["host_tier"]["hits"] > 0  # Q (and what is left of P) from the tier...
    assert after["chunks"]["loaded"] > KEYS  # ...P's dropped blocks from Mooncake again
    assert after["host_tier"]["used_bytes"] <= after["host_tier"]["capacity_bytes"]


@pytest.fixture(scope="module")
def disk_runs(world: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """Engines C and D, ``disk-tiered`` on one directory, after engine A filled Mooncake."""
    (world["root"] / "disk").mkdir()
    kv = connector(
        {
            "backend": "disk-tiered",
            "mooncake_config": str(world["mooncake_config"]),
            "disk_path": str(world["root"] / "disk"),
            "disk_capacity": "64MiB",
            "chunk_blocks": 1,
        }
    )

    def engine(name: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
        return run_engine(
            world["root"], name, model=world["model"], steps=steps, kv_transfer_config=kv, env=MOONCAKE_ENV
        )

    return {
        "c": engine("disk-tiered-c", [generate("remote", PROMPTS), {"op": "flush"}, {"op": "stats"}]),
        "d": engine("disk-tiered-d", [generate("restart", PROMPTS), {"op": "stats"}]),
    }


def test_a_disk_tier_in_front_of_mooncake_survives_a_restart(
    runs: dict[str, Any], disk_runs: dict[str, Any]
) -> None:
    c, d, reference = disk_runs["c"], disk_runs["d"], runs["reference"]
    assert [out["cached"] for out in c["remote"]["outputs"]] == WHOLE_PROMPTS  # from Mooncake
    assert c["stats"]["host_tier"]["promotions"] == KEYS
    assert [out["cached"] for out in d["restart"]["outputs"]] == WHOLE_PROMPTS  # from the disk
    assert_matches_reference(c["remote"]["outputs"], reference, "disk-tiered, from Mooncake")
    assert_matches_reference(d["restart"]["outputs"], reference, "disk-tiered, after a restart")
    assert d["stats"]["host_tier"]["hits"] == KEYS and d["stats"]["chunks"].get("loaded", 0) == 0
