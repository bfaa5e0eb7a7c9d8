"""The connector's configuration, key formats and KV cache geometry, checked without an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.support import require_vllm


@pytest.fixture(autouse=True)
def _vllm() -> None:
    require_vllm()


def test_defaults_and_every_key_checked() -> None:
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig

    config = ConnectorConfig.from_extra_config({})
    assert (config.backend, config.key_format, config.chunk_blocks, config.load_async) == (
        "mooncake",
        "aiokv",
        1,
        True,
    )
    assert ConnectorConfig.from_extra_config({"key_format": "vllm"}).chunk_blocks == 1
    with pytest.raises(ValueError, match="chunk_blcks"):
        ConnectorConfig.from_extra_config({"chunk_blcks": 2})
    with pytest.raises(ValueError, match="chunk_blocks must be 1"):
        ConnectorConfig.from_extra_config({"key_format": "vllm", "chunk_blocks": 4})
    with pytest.raises(ValueError, match="'load_async'"):
        ConnectorConfig.from_extra_config({"load_async": "yes"})
    with pytest.raises(ValueError, match="'lookup_timeout_s'"):
        ConnectorConfig.from_extra_config({"lookup_timeout_s": 0})
    with pytest.raises(ValueError, match="'backend'"):
        ConnectorConfig.from_extra_config({"backend": "redis"})
    assert (config.executor_threads, config.idle_wait_s) == (1, 0.002)
    assert ConnectorConfig.from_extra_config({"idle_wait_s": 0}).idle_wait_s == 0.0  # 0: never waits
    with pytest.raises(ValueError, match="'idle_wait_s'"):
        ConnectorConfig.from_extra_config({"idle_wait_s": -1})
    # Keys of vLLM's own connector are accepted (ignored) so its config can be reused.
    assert ConnectorConfig.from_extra_config({"lookup_async": True}).backend == "mooncake"
    # Values are verified by default with aiokv's keys, never with vLLM's (byte-identical values).
    assert config.verify_values is True
    assert ConnectorConfig.from_extra_config({"verify_values": False}).verify_values is False
    assert ConnectorConfig.from_extra_config({"key_format": "vllm"}).verify_values is False
    with pytest.raises(ValueError, match="verify_values must be false"):
        ConnectorConfig.from_extra_config({"key_format": "vllm", "verify_values": True})
    with pytest.raises(ValueError, match="'verify_values'"):
        ConnectorConfig.from_extra_config({"verify_values": "sometimes"})


def test_mooncake_json_as_vllm_users_write_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.backends.mooncake import MooncakeConfig
    from aiokv.integrations.vllm.common.connector_config import mooncake_client_config

    vllm_json: dict[str, Any] = {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": "127.0.0.1:50051",
        "protocol": "tcp",
        "device_name": "",
        "mode": "standalone-store",
        "tenant_id": "default",
        "enable_offload": True,
        "local_buffer_size": "64MB",
    }
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(vllm_json))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    monkeypatch.setenv("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "127.0.0.1")
    config = MooncakeConfig.from_dict(mooncake_client_config(None, pure_client=False))
    assert (config.global_segment_size, config.local_hostname) == (0, "127.0.0.1")
    embedded = mooncake_client_config(
        {**vllm_json, "mode": "embedded", "global_segment_size": "1GB"}, pure_client=False
    )
    assert MooncakeConfig.from_dict(embedded).global_segment_size == 1 << 30
    lookup_client = mooncake_client_config({**vllm_json, "mode": "embedded"}, pure_client=True)
    assert lookup_client["global_segment_size"] == 0
    with pytest.raises(ValueError, match="'global_segment_size' 0"):
        mooncake_client_config({**vllm_json, "global_segment_size": "1GB"}, pure_client=False)
    with pytest.raises(ValueError, match="'mode'"):
        mooncake_client_config({**vllm_json, "mode": "cluster"}, pure_client=False)
    with pytest.raises(ValueError, match="'tenant_id'"):
        mooncake_client_config({**vllm_json, "tenant_id": "team-a"}, pure_client=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    with pytest.raises(ValueError, match="MOONCAKE_CONFIG_PATH"):
        mooncake_client_config(None, pure_client=False)


def _kv_cache_config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_geometry_and_refusals() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from aiokv.integrations.vllm.common.from_vllm import kv_geometry, kv_layout_from_tensors

    full = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    (group,) = kv_geometry(_kv_cache_config(full)).groups
    assert (group.block_size, group.page_bytes, group.dtype, group.kind) == (128, 65536, "bfloat16", "full")
    window = SlidingWindowSpec(
        block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
    )
    hybrid = kv_geometry(_kv_cache_config(full, window))
    assert hybrid.hybrid and [g.kind for g in hybrid.groups] == ["full", "swa64"]
    small = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="different block sizes"):
        kv_geometry(_kv_cache_config(full, small))
    finer = _kv_cache_config(full)
    finer.hash_block_size = 16
    with pytest.raises(
        ValueError, match=r"hashes prefixes every 16 tokens \(prefix_match_unit\) and its blocks hold 128"
    ):
        kv_geometry(finer)
    finer.hash_block_size = 128
    assert kv_geometry(finer).groups[0].block_size == 128

    caches = [torch.zeros(16, 2, 128, 128, dtype=torch.bfloat16) for _ in range(2)]
    layout = kv_layout_from_tensors(caches, block_size=128, page_bytes=65536, dtype="bfloat16")
    assert layout.base_addrs.tolist() == [c.data_ptr() for c in caches] and layout.num_blocks == 16
    import numpy as np

    scratch = np.zeros(65536, dtype=np.uint8)
    # The scheduler's lookup layout must name the same keys as the worker's engine layout.
    one_layer = kv_layout_from_tensors(caches[:1], block_size=128, page_bytes=65536, dtype="bfloat16")
    assert group.lookup_layout(scratch, 128).fingerprint == one_layer.fingerprint
    with pytest.raises(ValueError, match="contiguous"):
        kv_layout_from_tensors(
            [caches[0].transpose(1, 2)], block_size=128, page_bytes=65536, dtype="bfloat16"
        )
    with pytest.raises(ValueError, match="a block is"):
        kv_layout_from_tensors(
            [torch.zeros(2, 16, 2, 128, 64)], block_size=128, page_bytes=65536, dtype="bfloat16"
        )


def test_state_groups_geometry_and_refusals() -> None:
    """A gated-delta-net group in "align" mode: its lookup layout (the scheduler's) names the same
    keys as the layout over the engine's state tensors (the worker's); other modes are refused."""
    import dataclasses

    import numpy as np
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from aiokv.integrations.vllm.common.from_vllm import engine_layout, kv_geometry

    full = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    state = MambaSpec(
        block_size=256,
        shapes=((3, 512), (4, 64, 64)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=full.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    geometry = kv_geometry(_kv_cache_config(state, full))
    group = geometry.groups[0]
    assert geometry.has_state and [g.kind for g in geometry.groups] == ["state-gdn_attn", "full"]
    assert group.state_parts == ((3072, "bfloat16"), (65536, "float32")) and group.block_bytes == 68608
    assert group.chunk_bytes(4) == 68608 and geometry.groups[1].chunk_bytes(4) == 4 * 131072
    # The engine's page: conv state then SSM state at its start, pages 131072 bytes apart.
    pool = torch.zeros(16, 131072, dtype=torch.uint8)
    conv = pool[:, :3072].view(torch.bfloat16).view(16, 3, 512)
    ssm = pool[:, 3072 : 3072 + 65536].view(torch.float32).view(16, 4, 64, 64)
    layout = engine_layout({"model.layers.0.self_attn.attn": [conv, ssm]}, group, 256)
    assert layout.base_addrs.tolist() == [pool.data_ptr(), pool.data_ptr() + 3072]
    assert layout.region_block_strides.tolist() == [131072, 131072] and layout.num_blocks == 16
    assert layout.device == "cpu" and layout.dtype == "bfloat16+float32"
    scratch = np.zeros(131072, dtype=np.uint8)
    assert group.lookup_layout(scratch, 256).fingerprint == layout.fingerprint
    assert group.lookup_layout(scratch, 512).fingerprint != layout.fingerprint  # chunk size is in keys
    with pytest.raises(ValueError, match="not back to back"):
        engine_layout({"model.layers.0.self_attn.attn": [ssm, conv]}, group, 256)
    # vLLM's CPU runner registers the page itself (the state's bytes, then padding).
    page = pool[:, :68608].view(16, 1, 1, 68608)
    assert (
        engine_layout({"model.layers.0.self_attn.attn": page}, group, 256).fingerprint == layout.fingerprint
    )
    with pytest.raises(ValueError, match="less than the 68608-byte state"):
        engine_layout({"model.layers.0.self_attn.attn": pool[:, :4096]}, group, 256)
    with pytest.raises(ValueError, match=r"only with mamba_cache_mode='align'.*runs mamba_cache_mode='none'"):
        kv_geometry(_kv_cache_config(dataclasses.replace(state, mamba_cache_mode="none"), full))
    with pytest.raises(ValueError, match="speculative"):
        kv_geometry(_kv_cache_config(dataclasses.replace(state, num_speculative_blocks=1), full))
    # key_format "vllm": the whole page per layer, padding included, as vLLM's connector moves it.
    pages = engine_layout({"model.layers.0.self_attn.attn": [conv, ssm]}, group, 256, whole_state_pages=True)
    assert pages.base_addrs.tolist() == [pool.data_ptr()] and pages.block_lens.tolist() == [131072]
    assert pages.region_block_strides.tolist() == [131072] and pages.num_blocks == 16


def test_vllm_key_format_is_vllms_own() -> None:
    """Keys under key_format "vllm" are exactly vLLM's MooncakeStoreConnector keys."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, PoolKey

    from aiokv.integrations.vllm.common.block_keys import VllmKeyNamespace, hashed_prompt
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig

    block_hashes = [bytes([i]) * 32 for i in range(3)]
    for cache_prefix in ("", "prod"):
        namespace = VllmKeyNamespace("tiny-llama", tp_rank=1, pp_rank=2, cache_prefix=cache_prefix)
        config = ConnectorConfig.from_extra_config({"key_format": "vllm", "cache_prefix": cache_prefix})
        prompt = hashed_prompt(block_hashes, 3, config, 128)
        ours = namespace.keys(prompt.hashes, "any-fingerprint", 0)
        meta = KeyMetadata(
            "tiny-llama", tp_rank=1, pcp_rank=0, dcp_rank=0, pp_rank=2, cache_prefix=cache_prefix
        )
        theirs = [PoolKey(meta, h.hex()).to_string() for h in block_hashes]
        assert ours == theirs


def test_hybrid_groups_are_keyed_apart() -> None:
    """A hybrid engine's groups have keys of their own, apart from a full-attention engine's; in vLLM's
    format a group's keys are vLLM's for that group id."""
    from dataclasses import replace
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, PoolKey

    from aiokv.integrations.vllm.common.block_keys import key_namespace
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.common.geometry import EngineGeometry, KVGeometry

    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="/models/tiny", get_total_num_kv_heads=lambda: 2),
    )
    full = KVGeometry(("l1",), block_size=128, page_bytes=65536, dtype="bfloat16", is_mla=False)
    window = replace(full, layer_names=("l0",), sliding_window=256)
    hybrid, plain = EngineGeometry((window, full)), EngineGeometry((full,))
    config = ConnectorConfig.from_extra_config({})
    prefixes = {
        key_namespace(vllm_config, config, geometry, tp_rank=0, pp_rank=0, group=g).prefix("fp", 0)
        for geometry, g in ((hybrid, 0), (hybrid, 1), (plain, 0))
    }
    assert len(prefixes) == 3 and any("hma-g0-swa256" in p for p in prefixes), prefixes
    vllm_format = ConnectorConfig.from_extra_config({"key_format": "vllm"})
    namespace = key_namespace(vllm_config, vllm_format, hybrid, tp_rank=0, pp_rank=0, group=1)
    meta = KeyMetadata("tiny", tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0, group_id=1)
    assert namespace.keys(["ab"], "fp", 0) == [PoolKey(meta, "ab").to_string()]
    # TP 4 over 2 KV heads: attention ranks 2 and 3 share one key (byte-identical replicas, as vLLM's
    # connector keys them), a linear-attention state group's ranks each keep their own (their shards).
    vllm_config.parallel_config.tensor_parallel_size = 4
    state = replace(full, layer_names=("l0",), state_parts=((64, "float32"),), state_kind="state-gdn_attn")
    linear = EngineGeometry((state, full))
    ranks = {
        g: [
            key_namespace(vllm_config, vllm_format, linear, tp_rank=r, pp_rank=0, group=g).tp_rank
            for r in range(4)
        ]
        for g in (0, 1)
    }
    assert ranks == {0: [0, 1, 2, 3], 1: [0, 0, 1, 1]}, ranks


def test_sliding_window_groups_move_only_chunks_after_their_null_blocks() -> None:
    from aiokv.integrations.vllm.common.geometry import usable_from

    assert usable_from([5, 6, 7, 8], 1) == 0
    assert usable_from([0, 0, 7, 8], 1) == 2
    assert usable_from([0, 6, 7, 8, 9], 2) == 1  # the fifth block is no whole chunk
    assert usable_from([0, 0, 0], 1) == 3


def test_a_sliding_window_group_reads_the_window_before_the_hit() -> None:
    from aiokv.integrations.vllm.common.geometry import KVGeometry

    window = KVGeometry(
        ("l0",), block_size=128, page_bytes=1, dtype="bfloat16", is_mla=False, sliding_window=256
    )
    assert [window.window_first_chunk(end, 128) for end in (0, 1, 2, 3, 15)] == [0, 0, 0, 1, 13]
    assert window.window_first_chunk(8, 256) == 7  # tokens 1,792..2,048: the last 256-token chunk
    full = KVGeometry(("l1",), block_size=128, page_bytes=1, dtype="bfloat16", is_mla=False)
    assert full.window_first_chunk(15, 128) == 0


def test_layer_groups_cut_the_layers_into_runs_and_are_checked() -> None:
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.common.from_vllm import check_tiers_fit
    from aiokv.integrations.vllm.common.geometry import EngineGeometry, KVGeometry, layer_slices

    full = KVGeometry(
        tuple(f"l{i}" for i in range(5)), block_size=16, page_bytes=4, dtype="bf16", is_mla=False
    )
    runs = layer_slices(full, 2)
    assert [run.layer_names for run in runs] == [("l0", "l1", "l2"), ("l3", "l4")]
    assert sum(run.block_bytes for run in runs) == full.block_bytes
    assert layer_slices(full, 1) == (full,)
    for wrong in ({"layer_groups": 0}, {"layer_groups": 2.5}):
        with pytest.raises(ValueError, match="'layer_groups'"):
            ConnectorConfig.from_extra_config(wrong)
    for extra in ({"backend": "tiered"}, {"backend": "disk", "disk_path": "/tmp"}, {"key_format": "vllm"}):
        with pytest.raises(ValueError, match="layer_groups"):
            ConnectorConfig.from_extra_config({"layer_groups": 2, **extra})
    config = ConnectorConfig.from_extra_config({"layer_groups": 5})
    check_tiers_fit(config, EngineGeometry((full,)))
    with pytest.raises(ValueError, match="more than the model's 5 layers"):
        check_tiers_fit(ConnectorConfig.from_extra_config({"layer_groups": 6}), EngineGeometry((full,)))
    window = KVGeometry(("w0",), block_size=16, page_bytes=4, dtype="bf16", is_mla=False, sliding_window=64)
    with pytest.raises(ValueError, match="one attention KV cache group"):
        check_tiers_fit(config, EngineGeometry((full, window)))


def test_aiokv_keys_chain_whole_chunks_of_block_hashes() -> None:
    from aiokv.integrations.vllm.common.block_keys import hashed_prompt
    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig

    config = ConnectorConfig.from_extra_config({"chunk_blocks": 2})
    hashes = [bytes([i]) * 32 for i in range(5)]
    prompt = hashed_prompt(hashes, 5, config, 128)
    assert len(prompt.hashes) == 2 and prompt.chunk_tokens == 256  # the fifth block is no whole chunk
    changed = hashed_prompt([*hashes[:2], b"x" * 32, *hashes[3:]], 5, config, 128)
    assert changed.hashes[0] == prompt.hashes[0] and changed.hashes[1] != prompt.hashes[1]


def test_stats_through_vllms_hooks() -> None:
    """Worker counters reach vLLM's stats logger (aggregated over workers) and Prometheus."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from aiokv.integrations.vllm.connector import AiokvConnector

    stats = AiokvConnector.build_kv_connector_stats({"chunks_loaded": 3, "bytes_get": 100})
    stats = stats.aggregate(AiokvConnector.build_kv_connector_stats({"chunks_loaded": 1}))
    assert stats.reduce() == {"chunks_loaded": 4, "bytes_get": 100} and not stats.is_empty()

    registry = CollectorRegistry()

    class LocalCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    prom = AiokvConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: LocalCounter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    prom.observe(stats.data, engine_idx=0)
    assert registry.get_sample_value("vllm:aiokv_chunks_loaded_total", {"engine": "0"}) == 4
    prom.observe({"chunks_verify_failed": 2}, engine_idx=0)
    assert registry.get_sample_value("vllm:aiokv_chunks_verify_failed_total", {"engine": "0"}) == 2


def test_aiokv_records_go_through_vllms_handlers_only_when_nothing_else_is_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_vllm()
    import logging

    from aiokv.integrations.vllm.connector import log_through_vllm

    ours, root, theirs = logging.getLogger("aiokv"), logging.getLogger(), logging.getLogger("vllm")
    handler = logging.NullHandler()
    monkeypatch.setattr(theirs, "handlers", [handler])
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # the application's own
    log_through_vllm()
    assert ours.handlers == []
    monkeypatch.setattr(root, "handlers", [])
    log_through_vllm()
    assert ours.handlers == [handler] and ours.level == theirs.getEffectiveLevel()
    log_through_vllm()  # idempotent: aiokv now has a handler
    assert ours.handlers == [handler]
