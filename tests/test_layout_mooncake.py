"""Layouts from tensors through the worker on the real Mooncake store, across processes: the store's
memory lives in another process, so every pair crosses Mooncake's TCP transport.

Skips (fails under CI) outside a private network namespace; run with
    unshare -rn sh -c 'ip link set lo up && python -m pytest tests/test_layout_mooncake.py'
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from aiokv import KVLayout, KVWorker
from aiokv.backends.mooncake import MooncakeBackend
from aiokv.backends.mooncake_master import MooncakeMaster, segment_holder
from aiokv.testing import FaultInjectingBackend

N, BS, LAYERS, HEADS, DIM = 16, 16, 4, 2, 32
SRC_IDS = [3, 4, 5, 6, 9, 1, 12, 13]
DST_IDS = [0, 1, 2, 3, 15, 7, 10, 11]


@pytest.fixture
def remote_store(
    mooncake_master_factory: Callable[..., MooncakeMaster],
    mooncake_backend_factory: Callable[..., MooncakeBackend],
) -> Iterator[MooncakeBackend]:
    master = mooncake_master_factory()
    with segment_holder(master.address, graceful=True):
        yield mooncake_backend_factory(master.address, global_segment_size=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("chunk_blocks", [1, 2])
async def test_layer_major_store_block_major_load_across_processes(
    remote_store: MooncakeBackend, chunk_blocks: int
) -> None:
    rng = np.random.default_rng(chunk_blocks)
    layer_major = [rng.integers(0, 256, size=(2, N, BS, HEADS, DIM), dtype=np.uint8) for _ in range(LAYERS)]
    # FlashAttention per layer (K and V regions) vs per-layer views of one block-major buffer.
    block_major = np.zeros((N, LAYERS, 2, BS, HEADS, DIM), dtype=np.uint8)
    src = KVLayout.from_tensors(layer_major, block_size=BS, block_dim=1)
    dst = KVLayout.from_tensors(
        [block_major[:, i].transpose(1, 0, 2, 3, 4) for i in range(LAYERS)], block_size=BS, block_dim=1
    )
    assert src.fingerprint == dst.fingerprint
    tokens = list(range(len(SRC_IDS) * BS))
    ns = f"layout-{uuid.uuid4().hex[:8]}"
    recording = FaultInjectingBackend(remote_store)  # no rules: it records every call
    chunk_tokens = chunk_blocks * BS
    async with KVWorker(src, recording, namespace=ns, chunk_tokens=chunk_tokens) as worker:
        stored = await worker.store(tokens, [SRC_IDS])
    assert (stored.stored, stored.failed) == (len(SRC_IDS) // chunk_blocks, 0)
    async with KVWorker(dst, recording, namespace=ns, chunk_tokens=chunk_tokens) as worker:
        loaded = await worker.load(tokens, [DST_IDS])
    assert loaded.ok and loaded.loaded_tokens == len(tokens)
    for layer in range(LAYERS):
        for s, d in zip(SRC_IDS, DST_IDS, strict=True):
            assert np.array_equal(block_major[d, layer], layer_major[layer][:, s])
    untouched = sorted(set(range(N)) - set(DST_IDS))
    assert not block_major[untouched].any()
    # Layer-major: one pair per region (K and V of each layer); block-major one-block chunks: one pair.
    # Scattered two-block chunks: one pair per block per region.
    widths = {
        layout: {
            layout.pairs_per_chunk(chunk_blocks),
            layout.pairs_per_chunk(chunk_blocks, consecutive=False),
        }
        for layout in (src, dst)
    }
    put_widths = {n for call in recording.calls_of("put") for n in call.region_counts}
    get_widths = {n for call in recording.calls_of("get") for n in call.region_counts}
    assert put_widths == widths[src]
    assert get_widths == widths[dst]
    if chunk_blocks == 1:
        assert widths == {src: {2 * LAYERS}, dst: {1}}
    else:
        assert widths == {src: {2 * LAYERS, 4 * LAYERS}, dst: {4 * LAYERS}}
