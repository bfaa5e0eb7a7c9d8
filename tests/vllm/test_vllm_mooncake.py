"""AiokvConnector on a real vLLM engine (CPU build) against a real Mooncake store.

Engines run in processes of their own: A stores, B (another process, its own KV cache and block ids)
loads, and every output is compared with a run without any connector (greedy tokens and logprobs).
The Mooncake engines are pure clients ("standalone-store"); the KV lives in a holder process's
segment, so it outlives the engine that wrote it. Run inside a private network namespace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from aiokv import Code
from aiokv.backends.mooncake_master import client_service
from aiokv.testing.tiny_model import write_tiny_llama
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    assert_same_greedy,
    connector,
    generate,
    greedy_tolerance,
    run_engine,
    run_vllm_connector_engine,
    store_world,
    tokens,
)

pytestmark = pytest.mark.mooncake

PROMPT_A = tokens(1, 2100)  # 16 full blocks: 4 chunks of 4 blocks
PROMPT_B = PROMPT_A[:1024] + tokens(2, 700)  # shares 8 blocks (2 chunks) with A
PROMPT_C = tokens(3, 1100)  # the negative control's prompt
PREEMPT = [tokens(10 + i, 1150) for i in range(4)]  # 9 blocks, 2 tokens short of full
INTEROP_D = tokens(30, 1300)
INTEROP_E = tokens(31, 1300)
SLOW_PUTS = "tests.vllm.support:slow_put_mooncake"
MODEL_NAME = "tiny-llama"  # both weight sets store under one name: their keys collide on purpose
# The prompts the reference runs both warm and cold.
WARM_AND_COLD = [("a", PROMPT_A), *((f"p{i}", p) for i, p in enumerate(PREEMPT)), ("d", INTEROP_D)]
WARM_AND_COLD += [("e", INTEROP_E)]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, mooncake_master: Any) -> Iterator[dict[str, Any]]:
    with store_world(tmp_path_factory.mktemp("vllm-mooncake"), mooncake_master.address) as world:
        world["model"] = write_tiny_llama(world["root"] / MODEL_NAME)
        world["other_model"] = write_tiny_llama(world["root"] / "other" / MODEL_NAME, seed=1)
        yield world


def aiokv(world: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return connector({"backend": "mooncake", "mooncake_config": str(world["mooncake_config"]), **extra})


@pytest.fixture(scope="module")
def reference(world: dict[str, Any]) -> dict[str, Any]:
    """Every prompt without a connector. "cold": computed whole from an empty prefix cache. "warm":
    computed with vLLM's own prefix cache holding exactly the blocks the connector loads in the tests
    (the same split into reused and computed tokens). "p_batch": the PREEMPT prompts computed in one
    batch. Cold against warm and against the batch is the control of this CPU's numerics: how far the
    same prompts move with another split or batch (nothing on AMX CPUs; up to ~0.1 without)."""
    evict: dict[str, Any] = {"op": "evict"}
    # Reused blocks as in the tests: A's for A itself and for B (its first 1,024 tokens).
    steps = [evict, generate("a_first", [PROMPT_A]), generate("a", [PROMPT_A])]
    steps += [generate("b", [PROMPT_B])]
    pairs = WARM_AND_COLD[1:]
    for name, prompt in pairs:
        steps += [evict, generate(f"{name}_first", [prompt]), generate(name, [prompt])]
    steps += [evict, generate("c_first", [PROMPT_C]), evict, generate("p_batch", PREEMPT)]
    out = run_engine(world["root"], "reference", model=world["model"], steps=steps)
    ref: dict[Any, Any] = {
        name: out[name]["outputs"][0] for name, _ in [("a", PROMPT_A), ("b", PROMPT_B), *pairs]
    }
    for name, prompt in [("a", PROMPT_A), ("c", PROMPT_C), *pairs]:
        ref[("cold", tuple(prompt))] = out[f"{name}_first"]["outputs"][0]
    for i, prompt in enumerate(PREEMPT):
        ref[("batch", tuple(prompt))] = out["p_batch"]["outputs"][i]
    return ref


@pytest.fixture(scope="module")
def tolerance(reference: dict[Any, Any]) -> float:
    """The logprob tolerance backed by the reference's control (see ``support.greedy_tolerance``)."""
    pairs = [(reference[name], reference[("cold", tuple(prompt))]) for name, prompt in WARM_AND_COLD]
    pairs += [(reference[("batch", tuple(p))], reference[("cold", tuple(p))]) for p in PREEMPT]
    return greedy_tolerance(pairs)


def assert_matches(
    got: dict[str, Any], reference: dict[Any, Any], name: str, prompt: list[int], tolerance: float
) -> None:
    """The warm run's greedy tokens and logprobs, and (where there is one) the cold run's."""
    assert_same_greedy(got, reference[name], tolerance, f"{name} against the warm reference")
    cold = reference.get(("cold", tuple(prompt)))
    if cold is not None:
        assert_same_greedy(got, cold, tolerance, f"{name} against the cold reference")


@pytest.fixture(scope="module")
def loaded(world: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """A stores A, then (small KV cache, puts delayed 3 s) the PREEMPT prompts, whose decode forces
    preemptions while their stores are in flight; A' (other weights, same key names) stores C; then B,
    a fresh process with its own KV cache and block ids, loads everything."""
    runs: dict[str, Any] = {}
    runs["A"] = run_engine(
        world["root"],
        "A",
        model=world["model"],
        env={
            **MOONCAKE_ENV,
            "AIOKV_TEST_PUT_DELAY_S": "3",
            "AIOKV_TEST_PUT_LOG": str(world["root"] / "puts.jsonl"),
        },
        # 27 usable blocks: three 9-block prompts fill the cache and their decode needs more.
        engine={"num_gpu_blocks_override": 28, "max_model_len": 2304},
        kv_transfer_config=aiokv(
            world, model_name=MODEL_NAME, backend="tests.vllm.support:slow_put_mooncake"
        ),
        steps=[
            generate("a", [PROMPT_A], logprobs=False),
            {"op": "flush"},
            {"op": "evict"},  # frees A's blocks: the whole cache is the PREEMPT prompts'
            generate("p", PREEMPT, max_tokens=80, logprobs=False),
            {"op": "flush"},
            {"op": "stats"},
        ],
    )
    runs["A_other_weights"] = run_engine(
        world["root"],
        "A_other",
        model=world["other_model"],
        env=MOONCAKE_ENV,
        kv_transfer_config=aiokv(world, model_name=MODEL_NAME),
        steps=[generate("c", [PROMPT_C], logprobs=False), {"op": "flush"}],
    )
    runs["B"] = run_engine(
        world["root"],
        "B",
        model=world["model"],
        env=MOONCAKE_ENV,
        kv_transfer_config=aiokv(world, model_name=MODEL_NAME),
        steps=[
            generate("a", [PROMPT_A]),
            # Dropping vLLM's prefix cache makes every later hit the store's.
            {"op": "evict"},
            generate("b", [PROMPT_B]),
            generate("c", [PROMPT_C]),
            *[generate(f"p{i}", [prompt]) for i, prompt in enumerate(PREEMPT)],
            {"op": "stats"},
        ],
    )
    return runs


def only(run: dict[str, Any], name: str) -> dict[str, Any]:
    (output,) = run[name]["outputs"]
    return output


def test_other_process_hits_every_full_block_and_matches(
    loaded: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    assert loaded["A"]["stats"]["events"]["stores_submitted"] >= 1
    got = only(loaded["B"], "a")
    assert got["cached"] == len(PROMPT_A)  # every full block of the 2,100-token prompt, and its tail
    assert_matches(got, reference, "a", PROMPT_A, tolerance)


def test_shared_prefix_hits_and_matches(
    loaded: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    got = only(loaded["B"], "b")
    assert got["cached"] == 1024
    assert_matches(got, reference, "b", PROMPT_B, tolerance)


PROMPT_F = tokens(40, 1234)  # stored and loaded through the client service


def test_an_engine_attached_to_a_client_service_loads_and_stores_through_it(
    world: dict[str, Any],
    loaded: dict[str, Any],
    reference: dict[str, Any],
    tolerance: float,
    mooncake_master: Any,
) -> None:
    """An engine attached to Mooncake's client service through shared memory (vLLM's multiprocess
    mode: its scheduler attaches too) loads A, which engine A stored over TCP, and stores F through the
    service, then, its own prefix cache dropped, loads F back."""
    config = json.loads(world["mooncake_config"].read_text())
    # The service mounts no segment: the values live in the world's holder, and the master (shared
    # with the other tests) keeps no dead segment listed after the service is killed.
    with client_service(mooncake_master.address, 0) as service:
        path = world["root"] / "attached.mooncake.json"
        path.write_text(json.dumps({**config, "client_service": service}))
        run = run_engine(
            world["root"],
            "attached",
            model=world["model"],
            env={**MOONCAKE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
            kv_transfer_config=connector(
                {"backend": "mooncake", "mooncake_config": str(path), "model_name": MODEL_NAME}
            ),
            steps=[
                generate("a", [PROMPT_A]),
                generate("f_first", [PROMPT_F]),
                {"op": "sleep", "seconds": 3},  # F's stores land (no flush across processes)
                {"op": "evict"},
                generate("f", [PROMPT_F]),
            ],
        )
    got = only(run, "a")
    assert got["cached"] == len(PROMPT_A)
    assert_matches(got, reference, "a", PROMPT_A, tolerance)
    assert only(run, "f_first")["cached"] == 0
    got = only(run, "f")
    assert got["cached"] == len(PROMPT_F)
    assert_same_greedy(
        got, only(run, "f_first"), tolerance, "F loaded through the service against F computed"
    )


def test_other_weights_under_the_same_keys_are_refused_chunk_by_chunk(
    loaded: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """C's stored KV came from other weights under the same key names (same ``model_name``): B finds
    its 9 keys (8 full blocks and the prompt's last partial block), refuses every one on load (the
    values' fingerprint names another model), recomputes them, and its outputs are the cold run's.
    Without verification B loaded that KV and its outputs differed (the negative control is now
    tests/vllm/test_vllm_verify.py's, with verification off)."""
    got = only(loaded["B"], "c")
    assert_same_greedy(got, reference[("cold", tuple(PROMPT_C))], tolerance, "C, refused and recomputed")
    stats = loaded["B"]["stats"]
    assert stats["verification"]["fingerprint"] == 9, stats["verification"]
    assert stats["backend_errors"] == {str(int(Code.VERIFY_FAILED)): 9}, stats["backend_errors"]


def test_preemption_with_stores_in_flight_stores_right_bytes(
    world: dict[str, Any], loaded: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """Stores still in flight when their request is preempted (puts delayed 3 s) store the bytes the
    engine computed: each put's value, read back, equals the blocks as they were when the put began.
    Then a fresh engine loads each prompt and generates the same tokens as without the connector.
    (The stored KV was computed in a batch, the warm references alone: the control includes the
    reference's own batch against its solo runs.)"""
    events = loaded["A"]["stats"]["events"]
    assert events.get("preemptions_waited", 0) >= 1, events  # a preempted request had stores in flight
    puts = [json.loads(line) for line in (world["root"] / "puts.jsonl").read_text().splitlines()]
    assert sum(put["checked"] for put in puts) >= 4 + 2 * len(PREEMPT)  # A's chunks and the PREEMPT ones
    assert all(put["equal"] == put["checked"] for put in puts), puts
    for i in range(len(PREEMPT)):
        got = only(loaded["B"], f"p{i}")
        assert got["cached"] == len(PREEMPT[i]), (i, got["cached"])  # full blocks and tail
        assert_matches(got, reference, f"p{i}", PREEMPT[i], tolerance)


def test_interop_with_vllms_mooncake_store_connector(
    world: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """key_format "vllm": vLLM's connector stores D, aiokv loads it and stores E, vLLM's loads E
    (the aiokv engine in vLLM's default multiprocess mode)."""
    full = (1300 - 1) // BLOCK * BLOCK
    run_vllm_connector_engine(
        world, "vllm_stores", [generate("d", [INTEROP_D], logprobs=False), {"op": "sleep", "seconds": 4}]
    )
    # vLLM's default multiprocess engine: scheduler, worker and front end in three processes.
    ours = run_engine(
        world["root"],
        "aiokv_vllm_format",
        model=world["model"],
        env={**MOONCAKE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        kv_transfer_config=aiokv(world, key_format="vllm"),
        steps=[generate("d", [INTEROP_D]), generate("e", [INTEROP_E]), {"op": "sleep", "seconds": 3}],
    )
    got = only(ours, "d")
    assert got["cached"] == full
    assert_matches(got, reference, "d", INTEROP_D, tolerance)
    theirs = run_vllm_connector_engine(world, "vllm_loads", [generate("e", [INTEROP_E])])
    got = only(theirs, "e")
    assert got["cached"] == full
    assert_matches(got, reference, "e", INTEROP_E, tolerance)


def test_master_killed_between_store_and_load(
    world: dict[str, Any], reference: dict[str, Any], tolerance: float, mooncake_master_factory: Any
) -> None:
    """The engine stores A in its own segment, its master is killed, A is asked again: the engine
    neither hangs nor fails, and recomputes (outputs equal)."""
    master = mooncake_master_factory()
    config = {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master.address,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": "32MB",
        "local_buffer_size": "16MB",
    }
    out = run_engine(
        world["root"],
        "master_killed",
        model=world["model"],
        env=MOONCAKE_ENV,
        kv_transfer_config=connector(
            {"mooncake_config": config, "lookup_timeout_s": 2, "load_timeout_s": 10}
        ),
        steps=[
            generate("before", [PROMPT_A], logprobs=False),
            {"op": "flush"},
            {"op": "evict"},
            {"op": "kill", "pid": master.pid},
            generate("after", [PROMPT_A]),
        ],
        timeout=240,
    )
    got = only(out, "after")
    assert_same_greedy(got, reference[("cold", tuple(PROMPT_A))], tolerance, "recomputed A")


def test_no_master_at_start_up_means_no_cache_not_a_hang(world: dict[str, Any]) -> None:
    """With nothing at the master address the client setup gives up after a few attempts and the
    connector runs without a store, instead of Mooncake's ~90 s of retries or an error."""
    import os
    import time

    from aiokv.backends.mooncake_master import free_ports
    from aiokv.integrations.vllm.common.backend_handles import acquire_backend
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig

    config = ConnectorConfig.from_extra_config(
        {
            "setup_retries": 1,
            "mooncake_config": {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": f"127.0.0.1:{free_ports(1)[0]}",
                "local_hostname": "127.0.0.1",
                "global_segment_size": 0,
            },
        }
    )
    previous = os.environ.pop("MC_STORE_CLIENT_SETUP_RETRIES", None)
    try:
        began = time.monotonic()
        assert acquire_backend("no-master-engine", config, pure_client=True) is None
        assert time.monotonic() - began < 60  # Mooncake's default retries take ~90 s
    finally:
        os.environ.pop("MC_STORE_CLIENT_SETUP_RETRIES", None)
        if previous is not None:
            os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = previous
