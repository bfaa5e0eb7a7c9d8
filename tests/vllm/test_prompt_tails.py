"""The rules of a prompt's last partial block (prompt_tails.py) on vLLM's own ``Request`` and block
hasher: which prompts have one, what its key depends on, when it is stored, and the window a
sliding-window group is asked for when a hit ends with one. The engines' proof is
test_vllm_prompt_tails.py."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

import pytest

from tests.vllm.support import require_vllm, tokens

BLOCK = 128


def _geometry(sliding_window: int | None = None) -> Any:
    require_vllm()
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from aiokv.integrations.vllm.common.from_vllm import kv_geometry

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["full"], full)]
    if sliding_window is not None:
        window = SlidingWindowSpec(
            block_size=BLOCK,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.bfloat16,
            sliding_window=sliding_window,
        )
        groups.insert(0, KVCacheGroupSpec(["swa"], window))
    return kv_geometry(KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups))


def _tails(**extra: Any) -> Any:
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.scheduler_side.prompt_tails import PromptTails

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"))
    return PromptTails(vllm_config, ConnectorConfig.from_extra_config(extra), _geometry())


def _request(prompt: list[int], **options: Any) -> Any:
    """vLLM's own request, its full blocks hashed by vLLM's own block hasher (sha256)."""
    require_vllm()
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(
        "r",
        prompt,
        SamplingParams(max_tokens=4),
        None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
        **options,
    )


P = tokens(5, 2000)  # 15 full blocks and 80 tokens


def _ended(request: Any) -> Any:
    """``request`` as it ends after sampling a token."""
    request.append_output_token_ids(1)
    return request


def _tail_key(prompt: list[int], **options: Any) -> str:
    spec = _tails().store_spec(_ended(_request(prompt, **options)), [list(range(1, 17))])
    assert spec is not None
    (digest,) = spec.prompt.hashes
    return str(digest)


def test_a_prompt_of_whole_blocks_has_no_tail() -> None:
    tails = _tails()
    request = _request(tokens(5, 2048))
    assert tails.lookup_hashes(request, 16) == list(request.block_hashes)
    assert tails.store_spec(_ended(request), [list(range(1, 17))]) is None


def test_the_lookup_asks_for_the_tail_after_every_full_block_only() -> None:
    tails = _tails()
    request = _request(P)
    assert len(tails.lookup_hashes(request, 15)) == 16
    # A lookup asking fewer blocks (a lease budget, a shorter local hit) never skips to the tail.
    assert tails.lookup_hashes(request, 14) == list(request.block_hashes[:14])


def test_the_tail_key_is_the_lookups_last_chunk_and_is_stored_from_the_tail_block() -> None:
    from aiokv.integrations.vllm.common.block_keys import hashed_prompt

    tails, request = _tails(), _request(P)
    hashes = tails.lookup_hashes(request, 15)
    looked_up = hashed_prompt(hashes, len(hashes), tails.config, BLOCK)
    spec = tails.store_spec(_ended(request), [[*range(100, 115), 7]])
    assert spec is not None
    assert spec.prompt.hashes == looked_up.hashes[-1:]
    assert spec.block_ids == ((7,),)


def test_the_tail_key_depends_on_every_token_before_it_and_the_cache_salt() -> None:
    key = _tail_key(P)
    assert _tail_key(P) == key  # deterministic
    assert _tail_key(P[:1990]) != key  # ends earlier in the block
    assert _tail_key(P[:1920] + tokens(6, 80)) != key  # other tail tokens
    assert _tail_key([P[0] + 1, *P[1:]]) != key  # another first token: another chain
    assert _tail_key(P, cache_salt="tenant") != key
    short = tokens(7, 90)  # no full block: a tail with no parent
    assert _tail_key(short) != _tail_key(short, cache_salt="tenant")


def test_a_request_ending_before_it_sampled_stores_no_tail() -> None:
    """Aborted during its prefill (or its load): the prompt's KV may be incomplete."""
    assert _tails().store_spec(_request(P), [list(range(1, 17))]) is None


def test_a_null_block_or_a_missing_block_stores_no_tail() -> None:
    tails, request = _tails(), _ended(_request(P))
    assert tails.store_spec(request, [[*range(1, 16), 0]]) is None  # a window moved past it
    assert tails.store_spec(request, [list(range(1, 16))]) is None  # not allocated


@pytest.mark.parametrize(
    "extra",
    [{"store_prompt_tails": False}, {"chunk_blocks": 2}, {"key_format": "vllm", "verify_values": False}],
)
def test_tails_are_off_when_asked_with_multi_block_chunks_and_with_vllms_keys(extra: dict[str, Any]) -> None:
    tails = _tails(**extra)
    request = _ended(_request(P))
    assert not tails.enabled
    assert tails.lookup_hashes(request, 15) == list(request.block_hashes)
    assert tails.store_spec(request, [list(range(1, 17))]) is None


def test_tails_are_off_on_mla_engines() -> None:
    """vLLM 0.32's CPU MLA backend, computing the token left after a loaded partial block, gave logprobs
    0.11-0.25 away from a full prefill's (docs/vllm.md): MLA engines store full blocks only."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.common.from_vllm import kv_geometry
    from aiokv.integrations.vllm.scheduler_side.prompt_tails import PromptTails

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype=torch.float32)
    geometry = kv_geometry(
        KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["mla"], spec)])
    )
    assert geometry.is_mla
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"))
    assert not PromptTails(vllm_config, ConnectorConfig.from_extra_config({}), geometry).enabled


def _answered(value: int) -> concurrent.futures.Future[int]:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    future.set_result(value)
    return future


class _WindowClient:
    """Answers a window lookup with every chunk found, and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[Any] = []

    def lookup_many(self, prompts: list[Any]) -> list[concurrent.futures.Future[int]]:
        self.asked += prompts
        return [_answered(p.num_tokens) for p in prompts]


@pytest.mark.parametrize(("tail", "first"), [(False, 14), (True, 13)])
def test_a_hit_ending_in_a_tail_asks_the_window_from_the_chunk_before(tail: bool, first: int) -> None:
    """A sliding-window group (256 tokens) that holds only a window before the hit's end, a hit of 16
    chunks: ending on a block boundary (2,048 tokens) the window is chunks 14-15; ending in a tail
    (up to 2,047 tokens) the last token computed reaches back into chunk 13, so it is asked too."""
    from aiokv.integrations.vllm.scheduler_side.group_lookups import GroupLookup
    from aiokv.keys import HashedPrompt

    geometry = _geometry(sliding_window=256)
    prompt = HashedPrompt(tuple(f"c{i}" for i in range(16)), BLOCK)
    lookup = GroupLookup([_answered(0), _answered(16 * BLOCK)], prompt, deadline=0.0, tail=tail)
    window = _WindowClient()
    assert lookup.ask_windows(geometry.groups, [window, None], BLOCK, wait_s=0.0)
    (asked,) = window.asked
    assert asked.hashes == prompt.hashes[first:]
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.scheduler_side.state_groups import StateGroups

    no_states = StateGroups(geometry, ConnectorConfig.from_extra_config({}))
    assert lookup.found_chunks(BLOCK, no_states) == 16
