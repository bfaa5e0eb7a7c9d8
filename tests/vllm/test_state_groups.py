"""The scheduler's rules for linear-attention / Mamba state groups (state_groups.py), on vLLM's own
geometry objects and plain request data: which hand-offs are stored, which hit ends are taken, which
block a state loads into. The engines' end-to-end proof is test_vllm_linear.py."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

import pytest

from tests.vllm.support import require_vllm

BLOCK = 256


def _answered(value: int) -> concurrent.futures.Future[int]:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    future.set_result(value)
    return future


def _state_groups(**extra: Any) -> Any:
    """StateGroups of a (state group 0, full attention group 1) engine, 256-token blocks."""
    require_vllm()
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.common.from_vllm import kv_geometry
    from aiokv.integrations.vllm.scheduler_side.state_groups import StateGroups

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    state = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 512), (4, 64, 64)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=full.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    groups = [KVCacheGroupSpec(["linear"], state), KVCacheGroupSpec(["attn"], full)]
    geometry = kv_geometry(KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups))
    return StateGroups(geometry, ConnectorConfig.from_extra_config(extra))


def _request(num_tokens: int, prompt_tokens: int | None = None) -> Any:
    hashes = [bytes([i]) * 32 for i in range(num_tokens // BLOCK)]
    return SimpleNamespace(block_hashes=hashes, num_prompt_tokens=prompt_tokens or num_tokens)


def test_only_handed_over_states_at_chunk_ends_of_the_prompt_are_stored() -> None:
    states = _state_groups()
    request = _request(2000)
    offloads = {
        "r": [
            (0, 7, 1792),  # the prompt's last boundary: stored
            (0, 0, 1536),  # a null block: never
            (1, 9, 1536),  # not a state group
            (0, 8, 1700),  # not a chunk end
        ],
        "gone": [(0, 5, 256)],  # a request the scheduler does not know
    }
    (spec,) = states.stores(SimpleNamespace(boundary_state_offloads=offloads), {"r": request})
    assert spec.req_id == "r" and spec.block_ids == ((7,), ()) and spec.first_chunks == (0, 0)
    # The key is the chunk digest of the prefix the state ends (7 blocks): the attention group's 7th.
    from aiokv.integrations.vllm.common.block_keys import hashed_prompt

    prefix = hashed_prompt(request.block_hashes, 7, states.config, BLOCK)
    assert spec.prompt.hashes == prefix.hashes[-1:]
    # Past the prompt (decode) only with save_decode_cache.
    decoding = {"r": [(0, 7, 1792)]}
    short = _request(2000, prompt_tokens=1500)
    assert not states.stores(SimpleNamespace(boundary_state_offloads=decoding), {"r": short})
    saving = _state_groups(save_decode_cache=True)
    assert len(saving.stores(SimpleNamespace(boundary_state_offloads=decoding), {"r": short})) == 1


def test_the_hit_is_the_longest_end_with_every_state() -> None:
    states = _state_groups()
    present = {0: [_answered(BLOCK * int(i in (2, 5))) for i in range(7)]}  # states after 3 and 6 chunks
    assert states.hit(7, present) == 6
    assert states.hit(5, present) == 3  # the attention groups serve 5 chunks: the state at 3
    assert states.hit(2, present) == 0
    assert states.hit(7, {0: present[0], 2: [_answered(BLOCK)] * 3}) == 3  # a second state group


def test_lookups_leave_a_token_to_compute() -> None:
    from aiokv.keys import HashedPrompt

    states = _state_groups()
    asked: list[list[HashedPrompt]] = []
    client = SimpleNamespace(
        lookup_many=lambda prompts: asked.append(prompts) or [_answered(0)] * len(prompts)
    )
    prompt = HashedPrompt(tuple(f"{i:032x}" for i in range(7)), BLOCK)
    states.ask([client, None], prompt, num_tokens=1792)  # the state at 1,792 would leave none
    assert [p.hashes for p in asked[0]] == [(h,) for h in prompt.hashes[:6]]


@pytest.mark.parametrize(
    ("end_token", "loaded_end", "expected"),
    [
        (1792, 1792, ((7,), ())),  # the last block of the hit holds the state
        (1792, 1536, ((), (1, 2, 3, 4, 5, 6, 7))),  # attention chunks short: the state cannot load
        (1700, 1700, ((), (1, 2, 3, 4, 5, 6))),  # not a chunk end
    ],
)
def test_the_state_loads_into_the_block_at_the_hits_end(
    end_token: int, loaded_end: int, expected: tuple[tuple[int, ...], tuple[int, ...]]
) -> None:
    assert _state_groups().load_blocks([1, 2, 3, 4, 5, 6, 7], end_token, loaded_end) == expected


def test_a_null_block_at_the_hits_end_fails_the_load() -> None:
    state, unloaded = _state_groups().load_blocks([0, 0, 0, 0, 0, 0, 0], 1792, 1792)
    assert state == () and unloaded  # reported failed: vLLM recomputes the request in every group


def test_the_tiny_qwen3_next_is_seeded_and_checks_its_arguments(tmp_path: Any) -> None:
    """Equal arguments write equal bytes (engines in different processes load the same model);
    other seeds other weights; bad arguments are refused before anything is written."""
    require_vllm()  # torch and safetensors come with vLLM
    from aiokv.testing.tiny_qwen3_next import write_tiny_qwen3_next

    first, again, other = (
        write_tiny_qwen3_next(tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1))
    )
    weights = [(path / "model.safetensors").read_bytes() for path in (first, again, other)]
    assert weights[0] == weights[1] != weights[2]
    assert (first / "config.json").read_text() == (again / "config.json").read_text()
    with pytest.raises(ValueError, match="layer_types"):
        write_tiny_qwen3_next(tmp_path / "bad", layer_types=("mamba", "full_attention"))
    with pytest.raises(ValueError, match="multiple"):
        write_tiny_qwen3_next(tmp_path / "bad", linear_heads=3)
    assert not (tmp_path / "bad").exists()
