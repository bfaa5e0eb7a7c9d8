"""Strided regions and coalescing: the semantics of ``block_strides``, and a property test that the
coalesced (address, size) pairs gather exactly the bytes of the unmerged pieces, in real memory."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv import InvalidRequestError, KVLayout

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def strided(**overrides: object) -> KVLayout:
    """Two regions of 64-byte blocks 256 bytes apart, 16 tokens per block, 10 blocks."""
    args: dict[str, object] = {
        "base_addrs": [1 << 20, (1 << 20) + 64],
        "block_lens": [64],
        "block_size": 16,
        "num_blocks": 10,
        "block_strides": [256],
    }
    args.update(overrides)
    return KVLayout(**args)  # type: ignore[arg-type]


# -- geometry -------------------------------------------------------------------------------------


def test_strides_default_to_block_lengths() -> None:
    layout = KVLayout([4096, 8192, 16384], [64, 32], 16, 10)
    assert layout.block_strides.tolist() == [64, 32]
    assert layout.region_block_strides.tolist() == [64, 32, 64]
    assert layout.device == "cpu"
    assert "block_strides" not in repr(layout) and "device" not in repr(layout)


def test_strided_geometry_spans_and_repr() -> None:
    layout = strided(block_strides=[256, 128], block_lens=[64, 32])
    assert layout.region_block_strides.tolist() == [256, 128]
    # A span runs from the first block's start to the last block's end: (10 - 1) * stride + length.
    assert layout.region_spans() == [(1 << 20, 9 * 256 + 64), ((1 << 20) + 64, 9 * 128 + 32)]
    assert layout.chunk_bytes_per_block == 96
    assert "block_strides=[256, 128]" in repr(layout)
    assert "device='cuda:1'" in repr(strided(device="cuda:1"))
    with pytest.raises(ValueError, match="read-only"):
        layout.region_block_strides[0] = 1


def test_fingerprint_ignores_strides_and_device() -> None:
    dense = KVLayout([1 << 20, 2 << 20], [64], 16, 10)
    assert strided().fingerprint == dense.fingerprint
    assert strided(device="cuda:0").fingerprint == dense.fingerprint
    assert strided(dtype="bfloat16").fingerprint != dense.fingerprint
    assert strided(block_lens=[32]).fingerprint != dense.fingerprint


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (
            {"block_strides": [32]},
            InvalidRequestError,
            "region 0: block stride 32 is shorter than its block length 64",
        ),
        ({"block_strides": [256, 0]}, InvalidRequestError, r"block_strides\[1\] must be positive"),
        ({"block_strides": [-256]}, InvalidRequestError, r"block_strides\[0\] must be positive"),
        (
            {"block_strides": [256, 256, 256]},
            InvalidRequestError,
            "block_strides has 3 entries but there are only 2",
        ),
        ({"block_strides": []}, InvalidRequestError, "block_strides must hold at least one value"),
        ({"block_strides": [256.0]}, ValueError, "block_strides must hold integers"),
        ({"block_strides": [2**62]}, InvalidRequestError, "region 0 ends past the int64 address range"),
        ({"device": ""}, TypeError, "device must be a non-empty str"),
        ({"device": 0}, TypeError, "device must be a non-empty str"),
    ],
)
def test_bad_strides_and_device_refused(
    overrides: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        strided(**overrides)


# -- prepare_values on strided regions --------------------------------------------------------------


def test_prepare_values_single_block_chunks_use_the_stride() -> None:
    layout = strided()
    addrs, sizes, bids = layout.prepare_values([(0, 16), (32, 48)], [7, 0, 3])
    assert addrs.tolist() == [
        [(1 << 20) + 7 * 256, (1 << 20) + 64 + 7 * 256],
        [(1 << 20) + 3 * 256, (1 << 20) + 64 + 3 * 256],
    ]
    assert sizes.tolist() == [[64, 64], [64, 64]] and bids.tolist() == [7, 3]


def test_prepare_values_refuses_multi_block_chunks_in_strided_regions() -> None:
    with pytest.raises(
        InvalidRequestError, match=r"chunk 1 \(16, 48\): its 2 blocks are not contiguous in region 0"
    ):
        strided().prepare_values([(0, 16), (16, 48)], [1, 2, 3])
    # Only regions that have gaps matter: a dense region keeps multi-block chunks.
    mixed = strided(block_strides=[64, 256], base_addrs=[1 << 20, 2 << 20])
    with pytest.raises(InvalidRequestError, match="not contiguous in region 1"):
        mixed.prepare_values([(0, 32)], [1, 2])
    dense = strided(block_strides=None)
    assert dense.prepare_values([(0, 32)], [1, 2])[1].tolist() == [[128, 128]]


# -- coalescing -----------------------------------------------------------------------------------


def test_block_major_cache_moves_one_pair_per_chunk_whatever_the_layers() -> None:
    for layers in (1, 2, 96):
        block = 64
        # Per-layer views into a block-major buffer: region i at i * block, stride layers * block.
        layout = KVLayout(
            [4096 + i * block for i in range(layers)], [block], 128, 50, block_strides=[layers * block]
        )
        assert layout.pairs_per_chunk(1) == 1
        (batch,) = layout.regions_for_chunks(np.array([[3], [49], [0]], dtype=np.int64))
        assert batch.addrs.tolist() == [[4096 + 3 * layers * block], [4096 + 49 * layers * block], [4096]]
        assert batch.sizes.tolist() == [[layers * block]] * 3
        # One region holding every layer (the cross-layer tensor): one pair for any consecutive chunk.
        cross = KVLayout([4096], [layers * block], 128, 50)
        assert [cross.pairs_per_chunk(n) for n in (1, 4, 16)] == [1, 1, 1]
        (batch,) = cross.regions_for_chunks(np.array([[5, 6, 7, 8]], dtype=np.int64))
        assert (batch.addrs.tolist(), batch.sizes.tolist()) == (
            [[4096 + 5 * layers * block]],
            [[4 * layers * block]],
        )


def test_pairs_per_chunk_layer_major_and_scattered() -> None:
    layer_major = KVLayout([(i + 1) << 30 for i in range(96)], [16384], 128, 100)
    assert layer_major.pairs_per_chunk(1) == 96
    assert layer_major.pairs_per_chunk(16) == 96
    assert layer_major.pairs_per_chunk(16, consecutive=False) == 96 * 16
    assert layer_major.pairs_per_chunk(1, consecutive=False) == 96
    # Regions back to back in one buffer, chunk = whole region: the static rule merges them too.
    packed = KVLayout([4096 + i * 4 * 64 for i in range(8)], [64], 16, 4)
    assert packed.pairs_per_chunk(4) == 1 and packed.pairs_per_chunk(2) == 8
    with pytest.raises(TypeError):
        packed.pairs_per_chunk(1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        packed.pairs_per_chunk(0)


def test_regions_for_chunks_refuses_bad_tables() -> None:
    layout = strided()
    with pytest.raises(
        InvalidRequestError, match=r"chunk 1: physical blocks \[9, 10\] fall outside the cache's 10"
    ):
        layout.regions_for_chunks(np.array([[1, 2], [9, 10]], dtype=np.int64))
    with pytest.raises(InvalidRequestError, match="chunk 0: physical blocks"):
        layout.regions_for_chunks(np.array([[-1]], dtype=np.int64))
    with pytest.raises(InvalidRequestError, match="chunk_blocks must be 2-dimensional"):
        layout.regions_for_chunks(np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="chunk_blocks must hold integers"):
        layout.regions_for_chunks(np.array([[1.0]]))


@dataclass
class Memory:
    """A layout over real memory: ``offsets[i]`` is region ``i``'s base inside ``buffer``."""

    buffer: np.ndarray
    offsets: list[int]
    lens: list[int]
    strides: list[int]
    num_blocks: int

    @property
    def layout(self) -> KVLayout:
        base = self.buffer.ctypes.data
        return KVLayout(
            [base + o for o in self.offsets], self.lens, 1, self.num_blocks, block_strides=self.strides
        )

    def gather(self, pairs: list[tuple[int, int]]) -> bytes:
        base = self.buffer.ctypes.data
        return b"".join(self.buffer[a - base : a - base + s].tobytes() for a, s in pairs)

    def reference(self, blocks: list[int]) -> bytes:
        """The value without coalescing: region by region, one block at a time in token order."""
        return b"".join(
            self.buffer[o + b * s : o + b * s + n].tobytes()
            for o, n, s in zip(self.offsets, self.lens, self.strides, strict=True)
            for b in blocks
        )


@st.composite
def memories(draw: st.DrawFn) -> tuple[Memory, int]:
    regions = draw(st.integers(1, 6))
    per_chunk = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(per_chunk, 12))
    kind = draw(st.sampled_from(["block_major", "mixed"]))
    lens = [draw(st.integers(1, 24)) for _ in range(regions)]
    if kind == "block_major":
        # Per-layer views of a block-major buffer, with an optional pad after each block.
        stride = sum(lens) + draw(st.integers(0, 8))
        strides = [stride] * regions
        offsets = [sum(lens[:i]) for i in range(regions)]
    else:
        strides = [n + draw(st.sampled_from([0, 0, 1, 7, 16])) for n in lens]
        offsets = [draw(st.integers(0, 512))]
        for i in range(1, regions):
            prev_len, prev_stride = lens[i - 1], strides[i - 1]
            placement = draw(
                st.sampled_from(["after_block", "after_piece", "after_region", "same_stride", "random"])
            )
            if placement == "same_stride":
                strides[i] = max(prev_stride, lens[i])
            offsets.append(
                {
                    "after_block": offsets[-1] + prev_len,
                    "same_stride": offsets[-1] + prev_len,
                    "after_piece": offsets[-1] + (per_chunk - 1) * prev_stride + prev_len,
                    "after_region": offsets[-1] + (num_blocks - 1) * prev_stride + prev_len,
                    "random": draw(st.integers(0, 2048)),
                }[placement]
            )
    size = max(o + (num_blocks - 1) * s + n for o, n, s in zip(offsets, lens, strides, strict=True))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    buffer = rng.integers(0, 256, size=size, dtype=np.uint8)
    return Memory(buffer, offsets, lens, strides, num_blocks), per_chunk


@PROPERTY
@given(memories(), st.data())
def test_coalesced_pairs_gather_the_same_bytes(memory_case: tuple[Memory, int], data: st.DataObject) -> None:
    memory, per_chunk = memory_case
    layout = memory.layout
    nb = memory.num_blocks
    rows = []
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            first = data.draw(st.integers(0, nb - per_chunk))
            rows.append(list(range(first, first + per_chunk)))
        else:
            rows.append(data.draw(st.lists(st.integers(0, nb - 1), min_size=per_chunk, max_size=per_chunk)))
    table = np.asarray(rows, dtype=np.int64)
    batches = layout.regions_for_chunks(table)
    spans = sorted(layout.region_spans())
    seen = []
    for batch in batches:
        width = batch.addrs.shape[1]
        assert batch.sizes.shape == batch.addrs.shape == (batch.rows.size, width)
        for row, addrs, sizes in zip(
            batch.rows.tolist(), batch.addrs.tolist(), batch.sizes.tolist(), strict=True
        ):
            seen.append(row)
            pairs = list(zip(addrs, sizes, strict=True))
            assert memory.gather(pairs) == memory.reference(rows[row])
            consecutive = all(b == a + 1 for a, b in itertools.pairwise(rows[row]))
            assert width == layout.pairs_per_chunk(per_chunk, consecutive=consecutive)
            # Every byte sent lies inside a registered span (merged pairs may cross regions).
            for addr, size in pairs:
                assert all(_covered(spans, a) for a in range(addr, addr + size))
    assert sorted(seen) == list(range(len(rows)))
    assert len(batches) <= 2
    if per_chunk == 1 and len(set(memory.strides)) == 1:
        block_major = all(
            memory.offsets[i + 1] == memory.offsets[i] + memory.lens[i] for i in range(len(memory.lens) - 1)
        )
        assert block_major == (layout.pairs_per_chunk(1) == 1)


def _covered(spans: list[tuple[int, int]], address: int) -> bool:
    return any(start <= address < start + size for start, size in spans)
