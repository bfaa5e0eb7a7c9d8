"""A memory level in front of the disk tier (``memory_cache_capacity``) on real engines: host memory
in front of the disk alone (``backend "disk"``, no server) and in front of the disk in front of a real
Mooncake master (``"disk-tiered"``).

Each engine stores two prompts (30 chunks; the memory level holds 24), drops vLLM's prefix cache and
runs them again: every block hits, from memory where a copy is left and from the disk otherwise (then
promoted into memory), with the outputs of the run without a connector. Run inside a private network
namespace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import MOONCAKE_ENV, connector, generate, run_engine, store_world
from tests.vllm.test_vllm_host_tier import PROMPTS, REFERENCE_STEPS, WHOLE_PROMPTS, assert_matches_reference

pytestmark = pytest.mark.mooncake

KEYS = 15 + 1 + 13 + 1  # P's and Q's full blocks and last partial blocks: one key each (chunk_blocks 1)
MEMORY = "3MiB"  # 24 blocks of the tiny model (2 layers x 64 KiB per block): fewer than KEYS
STEPS = [
    generate("first", PROMPTS),  # computed: stored onto the disk (and Mooncake), copied into memory
    {"op": "flush"},
    {"op": "evict"},  # vLLM's prefix cache dropped: what hits now comes from the tier
    generate("hit", PROMPTS),
    {"op": "stats"},
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-memory-disk"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / "tiny-llama")
        yield world


@pytest.fixture(scope="module")
def runs(world: dict[str, Any]) -> dict[str, Any]:
    def engine(name: str, steps: list[dict[str, Any]], kv: dict[str, Any] | None = None) -> dict[str, Any]:
        return run_engine(
            world["root"], name, model=world["model"], steps=steps, kv_transfer_config=kv, env=MOONCAKE_ENV
        )

    def levels(backend: str, **extra: Any) -> dict[str, Any]:
        disk = world["root"] / f"disk-{backend}"
        disk.mkdir()
        return connector(
            {
                "backend": backend,
                "disk_path": str(disk),
                "disk_capacity": "64MiB",
                "memory_cache_capacity": MEMORY,
                "chunk_blocks": 1,
                **extra,
            }
        )

    return {
        "reference": engine("reference", REFERENCE_STEPS),
        "two": engine("memory-disk", STEPS, levels("disk")),
        "three": engine(
            "memory-disk-mooncake",
            STEPS,
            levels("disk-tiered", mooncake_config=str(world["mooncake_config"])),
        ),
    }


def check_levels(run: dict[str, Any], reference: dict[str, Any], what: str) -> dict[str, Any]:
    """Every block of the second run hit the tier, from one level or the other, with the reference's
    outputs; the tier's counters."""
    assert run["evict"] is True
    assert [out["cached"] for out in run["hit"]["outputs"]] == WHOLE_PROMPTS
    assert_matches_reference(run["first"]["outputs"], reference, f"{what}, computed")
    assert_matches_reference(run["hit"]["outputs"], reference, f"{what}, from the tier")
    tier = run["stats"]["host_tier"]
    assert tier["hits"] == KEYS
    assert tier["memory_hits"] + tier["disk_hits"] == KEYS
    assert tier["memory_hits"] > 0 and tier["disk_hits"] > 0  # 24 copies in memory for 30 chunks
    assert 0 < tier["memory_promotions"] <= tier["disk_hits"]  # disk hits copied into memory
    assert tier["memory_evictions"] > 0 and tier["disk_evictions"] == 0
    assert tier["memory_verify_failed"] == 0
    return tier


def test_memory_in_front_of_the_disk_serves_and_promotes(runs: dict[str, Any]) -> None:
    check_levels(runs["two"], runs["reference"], "memory-disk")
    assert runs["two"]["stats"]["chunks"].get("loaded", 0) == KEYS  # no store behind: the tier's own


def test_memory_disk_and_mooncake_serve_from_the_tier(runs: dict[str, Any]) -> None:
    three = runs["three"]
    check_levels(three, runs["reference"], "memory-disk-mooncake")
    # Mooncake got every block too (and the evict step's short prompt); nothing was read from it.
    assert three["stats"]["chunks"]["stored"] == KEYS + 1
    assert three["stats"]["chunks"].get("loaded", 0) == 0
