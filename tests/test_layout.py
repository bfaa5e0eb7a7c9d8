"""KVLayout: geometry validation, prepare_values vs the scalar reference, bad input, regions_for_chunks."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv import InvalidRequestError, KVLayout, MemoryBackend
from benchmarks.prepare import build_inputs, run_prepare_benchmark
from benchmarks.reference import reference_prepare_value, writeup_prepare_values

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_INT64_MAX = int(np.iinfo(np.int64).max)


def small_layout(**overrides: object) -> KVLayout:
    """Three regions, block lengths (64, 32) cycled, 16 tokens per block, 100 blocks."""
    args: dict[str, object] = {
        "base_addrs": [1 << 20, 2 << 20, 3 << 20],
        "block_lens": [64, 32],
        "block_size": 16,
        "num_blocks": 100,
    }
    args.update(overrides)
    return KVLayout(**args)  # type: ignore[arg-type]


def reference_all(
    layout: KVLayout, chunks: list[tuple[int, int]], block_ids: list[int]
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    rows = [reference_prepare_value(layout, s, e, block_ids) for s, e in chunks]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


# -- geometry ------------------------------------------------------------------------------------


def test_geometry_attributes_and_cycled_block_lens() -> None:
    layout = small_layout()
    assert layout.num_regions == 3
    assert layout.block_lens.tolist() == [64, 32]
    assert layout.region_block_lens.tolist() == [64, 32, 64]
    assert layout.chunk_bytes_per_block == 160
    assert layout.region_spans() == [(1 << 20, 6400), (2 << 20, 3200), (3 << 20, 6400)]
    assert all(type(a) is int and type(n) is int for a, n in layout.region_spans())
    assert layout.dtype == "bytes"
    assert "num_regions=3" in repr(layout)


def test_geometry_arrays_are_read_only() -> None:
    layout = small_layout()
    for array in (layout.base_addrs, layout.block_lens, layout.region_block_lens):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"base_addrs": []}, "base_addrs must name at least one"),
        ({"block_lens": []}, "block_lens must hold at least one"),
        ({"block_lens": [1, 2, 3, 4]}, "block_lens has 4 entries but there are only 3 regions"),
        ({"base_addrs": [4096, 0, 8192]}, r"base_addrs\[1\] must be a positive address"),
        ({"base_addrs": [4096, 8192, -1]}, r"base_addrs\[2\] must be a positive address"),
        ({"block_lens": [64, -32]}, r"block_lens\[1\] must be positive"),
        ({"block_size": 0}, "block_size must be positive"),
        ({"num_blocks": -3}, "num_blocks must be positive"),
        ({"base_addrs": [1, 2, _INT64_MAX - 100]}, "region 2 ends past the int64 address range"),
        ({"base_addrs": [[1, 2, 3]]}, "base_addrs must be 1-dimensional"),
        ({"block_lens": [64.0]}, "block_lens must hold integers"),
        ({"base_addrs": [1, 2, 2**64]}, "base_addrs must hold integers within int64"),
    ],
)
def test_geometry_validated_at_construction(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_layout(**overrides)


@pytest.mark.parametrize(
    "overrides",
    [{"block_size": 16.0}, {"block_size": True}, {"num_blocks": "100"}, {"dtype": ""}, {"dtype": 3}],
)
def test_geometry_scalar_types_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        small_layout(**overrides)


def test_fingerprint_from_geometry_and_dtype_never_addresses() -> None:
    base = small_layout()
    # Other addresses, another cache size, the same cycled lengths spelled out: same bytes per chunk.
    same = [
        small_layout(base_addrs=[7 << 30, 9 << 30, 11 << 30]),
        small_layout(num_blocks=5),
        small_layout(block_lens=[64, 32, 64]),
    ]
    assert {layout.fingerprint for layout in same} == {base.fingerprint}
    different = [
        small_layout(dtype="bfloat16"),
        small_layout(block_size=32),
        small_layout(block_lens=[32, 64]),
        small_layout(base_addrs=[1 << 20, 2 << 20]),
    ]
    prints = [layout.fingerprint for layout in different]
    assert base.fingerprint not in prints
    assert len(set(prints)) == len(prints)
    assert re.fullmatch(r"[0-9a-f]{12}", base.fingerprint)


# -- prepare_values: examples ----------------------------------------------------------------------


def test_prepare_values_hand_computed() -> None:
    layout = small_layout()
    block_ids = [7, 3, 50, 9]
    addrs, sizes, bids = layout.prepare_values([(0, 16), (16, 48), (48, 64)], block_ids)
    assert bids.tolist() == [7, 3, 9]
    assert addrs.tolist() == [
        [(1 << 20) + 7 * 64, (2 << 20) + 7 * 32, (3 << 20) + 7 * 64],
        [(1 << 20) + 3 * 64, (2 << 20) + 3 * 32, (3 << 20) + 3 * 64],
        [(1 << 20) + 9 * 64, (2 << 20) + 9 * 32, (3 << 20) + 9 * 64],
    ]
    assert sizes.tolist() == [[64, 32, 64], [128, 64, 128], [64, 32, 64]]
    for array in (addrs, sizes, bids):
        assert array.dtype == np.int64


def test_prepare_values_equal_spans_broadcast_and_array_input() -> None:
    layout = small_layout()
    chunks = np.array([[0, 32], [64, 96]], dtype=np.int32)
    block_ids = np.array([10, 11, 0, 0, 40, 41], dtype=np.uint16)
    addrs, sizes, bids = layout.prepare_values(chunks, block_ids)
    assert (addrs.tolist(), sizes.tolist(), bids.tolist()) == reference_all(
        layout, chunks.tolist(), block_ids.tolist()
    )
    assert sizes.shape == (2, 3)


def test_prepare_value_plain_ints_and_matches_reference() -> None:
    layout = small_layout()
    block_ids = [5, 6, 7, 8]
    addrs, sizes, bid = layout.prepare_value(np.int64(16), 48, block_ids)
    assert (addrs, sizes, bid) == reference_prepare_value(layout, 16, 48, block_ids)
    assert all(type(x) is int for x in [*addrs, *sizes, bid])
    assert isinstance(addrs, list) and isinstance(sizes, list)


@pytest.mark.parametrize("chunks", [[], (), np.empty((0, 2), dtype=np.int64)])
def test_empty_chunks_give_empty_arrays(chunks: object) -> None:
    addrs, sizes, bids = small_layout().prepare_values(chunks, [1, 2])  # type: ignore[arg-type]
    assert addrs.shape == (0, 3) and sizes.shape == (0, 3) and bids.shape == (0,)
    assert addrs.dtype == sizes.dtype == bids.dtype == np.int64


def test_writeup_baseline_matches_reference() -> None:
    layout = small_layout()
    chunks = [(0, 16), (16, 48), (48, 64), (16, 32)]
    block_ids = [7, 3, 50, 9]
    assert writeup_prepare_values(layout, chunks, block_ids) == reference_all(layout, chunks, block_ids)
    assert writeup_prepare_values(layout, [], block_ids) == ([], [], [])


def test_baselines_keep_the_original_span_check() -> None:
    layout = small_layout()
    with pytest.raises(ValueError, match="multiple of block_size 16"):
        reference_prepare_value(layout, 0, 20, [1, 2])
    with pytest.raises(ValueError, match="multiple of block_size 16"):
        writeup_prepare_values(layout, [(0, 16), (16, 40)], [1, 2, 3])


# -- prepare_values: bad input ---------------------------------------------------------------------

BAD_CHUNKS = [
    # (chunks, block_ids, expected message)
    ([(0, 16), (16, 20)], [1, 2], r"chunk 1 \(16, 20\): span 4 is not a positive multiple of block_size 16"),
    ([(0, 16), (32, 32)], [1, 2, 3], r"chunk 1 \(32, 32\): span 0 is not a positive multiple"),
    ([(32, 16)], [1, 2, 3], r"chunk 0 \(32, 16\): span -16 is not a positive multiple"),
    ([(0, 16), (8, 24)], [1, 2], r"chunk 1 \(8, 24\): start is not aligned to block_size 16"),
    ([(-16, 0)], [1, 2], r"chunk 0 \(-16, 0\): start is negative"),
    (
        [(0, 16), (16, 32), (32, 48)],
        [1, 2],
        r"chunk 2 \(32, 48\): block index 2 is past the end of block_ids \(length 2\)",
    ),
    ([(0, 16), (16, 32)], [1, -1], r"chunk 1 \(16, 32\): physical blocks \[-1, 0\) fall outside"),
    ([(0, 16)], [100], r"chunk 0 \(0, 16\): physical blocks \[100, 101\) fall outside the cache's 100"),
    ([(0, 32)], [99, 0], r"chunk 0 \(0, 32\): physical blocks \[99, 101\) fall outside"),
    ([(0, 16 * 101)], [0], r"chunk 0 \(0, 1616\): physical blocks \[0, 101\) fall outside"),
]


@pytest.mark.parametrize(("chunks", "block_ids", "message"), BAD_CHUNKS)
def test_bad_chunks_name_the_chunk(chunks: list[tuple[int, int]], block_ids: list[int], message: str) -> None:
    layout = small_layout()
    with pytest.raises(InvalidRequestError, match=message):
        layout.prepare_values(chunks, block_ids)
    # The single-chunk wrapper reports the same problem for the offending chunk.
    start, end = chunks[int(re.search(r"chunk (\d+)", message).group(1))]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=message.split(": ", 1)[1]):
        layout.prepare_value(start, end, block_ids)


def test_first_bad_chunk_is_named_when_several_are_bad() -> None:
    with pytest.raises(InvalidRequestError, match=r"^chunk 1 \(16, 17\)"):
        small_layout().prepare_values([(0, 16), (16, 17), (3, 4)], [1, 2, 3])
    # The first bad chunk overall, even when a later one fails an earlier check.
    with pytest.raises(InvalidRequestError, match=r"^chunk 0 \(0, 16\): physical blocks \[100, 101\)"):
        small_layout().prepare_values([(0, 16), (16, 17)], [100, 2])


def test_negative_end_cannot_wrap_into_a_valid_span() -> None:
    # end - start wraps around int64 to +2**62, one whole block: it must still be refused.
    layout = small_layout(block_size=2**62)
    with pytest.raises(InvalidRequestError, match=r"^chunk 0 .*span -\d+ is not a positive multiple"):
        layout.prepare_values([(2**62, -(2**63))], [0, 1])


@pytest.mark.parametrize(
    ("chunks", "block_ids", "message"),
    [
        ([(0, 16.0)], [1], "chunks must hold integers"),
        ([(0, float("nan"))], [1], "chunks must hold integers"),
        ([(0, "16")], [1], "chunks must hold integers"),
        (np.array([[False, True]]), [1], "chunks must hold integers"),
        ([(0, 2**64)], [1], "chunks must hold integers within int64"),
        ([(0, 16), (16,)], [1, 2], "chunks is not a regular array"),
        ([0, 16], [1], r"chunks must be \(start, end\) pairs, got an array of shape \(2,\)"),
        ([(0, 16, 32)], [1], r"chunks must be \(start, end\) pairs"),
        ([(0, 16)], [1.0], "block_ids must hold integers"),
        ([(0, 16)], [float("nan")], "block_ids must hold integers"),
        ([(0, 16)], [True], "block_ids must hold integers"),
        ([(0, 16)], ["1"], "block_ids must hold integers"),
        ([(0, 16)], [2**63], "block_ids has a value past the int64 range"),
        ([(0, 16)], np.array([2**64 - 1], dtype=np.uint64), "block_ids has a value past the int64 range"),
        ([(0, 16)], [[1, 2]], "block_ids must be 1-dimensional"),
    ],
)
def test_non_integer_values_are_value_errors(chunks: object, block_ids: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_layout().prepare_values(chunks, block_ids)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("start", "end", "name"),
    [
        (0.0, 16, "start"),
        (0, 16.9, "end"),
        (True, 16, "start"),
        ("0", "16", "start"),
        (0, float("nan"), "end"),
        (None, 16, "start"),
    ],
)
def test_prepare_value_refuses_non_int_bounds(start: object, end: object, name: str) -> None:
    # np.array(..., dtype=int64) would truncate 16.9 to 16 or parse "16": must be refused instead.
    with pytest.raises(ValueError, match=rf"^chunk 0 \(.*\): {name} must be an int"):
        small_layout().prepare_value(start, end, [1, 2])  # type: ignore[arg-type]


def test_prepare_value_past_int64_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="int64"):
        small_layout().prepare_value(0, 2**64, [1])


@pytest.mark.parametrize("bad", ["0,16", b"\x00\x10", 5, np.int64(5)])
def test_non_sequence_arguments_are_type_errors(bad: object) -> None:
    with pytest.raises(TypeError):
        small_layout().prepare_values(bad, [1])  # type: ignore[arg-type]


# -- prepare_values: properties vs the scalar reference --------------------------------------------


@dataclass
class Case:
    layout: KVLayout
    chunks: list[tuple[int, int]]
    block_ids: list[int]


@st.composite
def geometries(draw: st.DrawFn) -> KVLayout:
    regions = draw(st.integers(1, 128))
    num_lens = draw(st.integers(1, regions))
    block_lens = draw(st.lists(st.integers(1, 1 << 20), min_size=num_lens, max_size=num_lens))
    block_size = draw(st.sampled_from([1, 2, 16, 64, 128, 256]))
    num_blocks = draw(st.integers(1, 5000))
    # Region bases anywhere low enough that every region ends inside int64, in any order.
    top = (1 << 62) // regions
    base_addrs = draw(st.lists(st.integers(1, top), min_size=regions, max_size=regions))
    return KVLayout(base_addrs, block_lens, block_size, num_blocks)


@st.composite
def valid_cases(draw: st.DrawFn) -> Case:
    layout = draw(geometries())
    bs, nb = layout.block_size, layout.num_blocks
    table_len = draw(st.integers(1, 64))
    block_ids = draw(st.lists(st.integers(0, nb - 1), min_size=table_len, max_size=table_len))
    chunks = []
    for _ in range(draw(st.integers(0, 24))):
        first = draw(st.integers(0, table_len - 1))
        # Multi-block chunks are only valid while their blocks stay inside the cache.
        blocks = draw(st.integers(1, max(1, min(8, nb - block_ids[first]))))
        chunks.append((first * bs, (first + blocks) * bs))
    return Case(layout, chunks, block_ids)


@PROPERTY
@given(valid_cases())
def test_prepare_values_bit_for_bit_equal_to_reference(case: Case) -> None:
    layout, chunks, block_ids = case.layout, case.chunks, case.block_ids
    addrs, sizes, bids = layout.prepare_values(chunks, block_ids)
    n, r = len(chunks), layout.num_regions
    assert addrs.shape == (n, r) and sizes.shape == (n, r) and bids.shape == (n,)
    expected = reference_all(layout, chunks, block_ids)
    assert (addrs.tolist(), sizes.tolist(), bids.tolist()) == expected
    # Same answer from array inputs and from the vectorised baseline.
    as_arrays = layout.prepare_values(
        np.asarray(chunks, dtype=np.int64).reshape(-1, 2), np.asarray(block_ids)
    )
    assert tuple(a.tolist() for a in as_arrays) == expected
    assert writeup_prepare_values(layout, chunks, block_ids) == (expected if chunks else ([], [], []))
    # Never an address outside the cache.
    spans = layout.region_spans()
    for row_addrs, row_sizes in zip(addrs.tolist(), sizes.tolist(), strict=True):
        for (region_addr, region_len), addr, size in zip(spans, row_addrs, row_sizes, strict=True):
            assert region_addr <= addr and addr + size <= region_addr + region_len


@PROPERTY
@given(valid_cases())
def test_prepare_value_equals_reference_with_plain_ints(case: Case) -> None:
    for start, end in case.chunks[:4]:
        got = case.layout.prepare_value(start, end, case.block_ids)
        assert got == reference_prepare_value(case.layout, start, end, case.block_ids)
        assert all(type(x) is int for x in [*got[0], *got[1], got[2]])


def _first_problem(layout: KVLayout, chunks: list[tuple[int, int]], block_ids: list[int]) -> int | None:
    """Index of the first chunk the spec says must be refused, computed in plain Python."""
    bs, nb = layout.block_size, layout.num_blocks
    for k, (start, end) in enumerate(chunks):
        span = end - start
        if start < 0 or span <= 0 or span % bs or start % bs:
            return k
        index = start // bs
        if index >= len(block_ids):
            return k
        bid = block_ids[index]
        if bid < 0 or bid + span // bs > nb:
            return k
    return None


@PROPERTY
@given(
    geometries(),
    st.lists(st.tuples(st.integers(-300, 3000), st.integers(-300, 3000)), max_size=12),
    st.lists(st.integers(-2, 6000), min_size=1, max_size=16),
)
def test_prepare_values_refuses_exactly_the_bad_chunks(
    layout: KVLayout, chunks: list[tuple[int, int]], block_ids: list[int]
) -> None:
    bad = _first_problem(layout, chunks, block_ids)
    if bad is None:
        got = layout.prepare_values(chunks, block_ids)
        assert tuple(a.tolist() for a in got) == (
            reference_all(layout, chunks, block_ids) if chunks else ([], [], [])
        )
    else:
        start, end = chunks[bad]
        with pytest.raises(InvalidRequestError, match=rf"^chunk {bad} \({start}, {end}\): "):
            layout.prepare_values(chunks, block_ids)


# -- regions_for_chunks ----------------------------------------------------------------------------


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent (addr, size) intervals merged: equal lists mean the same bytes in the same order."""
    out: list[tuple[int, int]] = []
    for addr, size in intervals:
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((addr, size))
    return out


def _per_block_reference(layout: KVLayout, blocks: list[int]) -> list[tuple[int, int]]:
    """A chunk's value, region by region, each region's blocks in token order, one block at a time."""
    out = []
    for base, blen in zip(layout.base_addrs.tolist(), layout.region_block_lens.tolist(), strict=True):
        out.extend((base + bid * blen, blen) for bid in blocks)
    return out


@st.composite
def chunk_block_tables(draw: st.DrawFn) -> tuple[KVLayout, np.ndarray]:
    layout = draw(geometries())
    nb = layout.num_blocks
    per_chunk = draw(st.integers(1, min(6, nb)))
    n = draw(st.integers(0, 12))
    rows = []
    for _ in range(n):
        if draw(st.booleans()):
            first = draw(st.integers(0, nb - per_chunk))
            rows.append(list(range(first, first + per_chunk)))  # physically consecutive
        else:
            rows.append(draw(st.lists(st.integers(0, nb - 1), min_size=per_chunk, max_size=per_chunk)))
    return layout, np.asarray(rows, dtype=np.int64).reshape(n, per_chunk)


@PROPERTY
@given(chunk_block_tables())
def test_regions_for_chunks_moves_the_per_block_bytes(table: tuple[KVLayout, np.ndarray]) -> None:
    layout, chunk_blocks = table
    batches = layout.regions_for_chunks(chunk_blocks)
    seen: list[int] = []
    for batch in batches:
        assert batch.addrs.shape == batch.sizes.shape == (batch.rows.size, batch.addrs.shape[1])
        for row, row_addrs, row_sizes in zip(
            batch.rows.tolist(), batch.addrs.tolist(), batch.sizes.tolist(), strict=True
        ):
            seen.append(row)
            got = _merged(list(zip(row_addrs, row_sizes, strict=True)))
            assert got == _merged(_per_block_reference(layout, chunk_blocks[row].tolist()))
    assert sorted(seen) == list(range(chunk_blocks.shape[0]))
    assert len(batches) <= 2


def test_regions_for_chunks_coalesces_consecutive_chunks_only() -> None:
    layout = small_layout()
    chunk_blocks = np.array([[4, 5, 6], [9, 2, 3], [10, 11, 12]], dtype=np.int64)
    whole, split = layout.regions_for_chunks(chunk_blocks)
    assert whole.rows.tolist() == [0, 2]
    assert whole.addrs.tolist() == [
        [(1 << 20) + 4 * 64, (2 << 20) + 4 * 32, (3 << 20) + 4 * 64],
        [(1 << 20) + 10 * 64, (2 << 20) + 10 * 32, (3 << 20) + 10 * 64],
    ]
    assert whole.sizes.tolist() == [[192, 96, 192]] * 2
    assert split.rows.tolist() == [1]
    assert split.addrs.shape == (1, 9)
    assert split.addrs[0, :3].tolist() == [(1 << 20) + 9 * 64, (1 << 20) + 2 * 64, (1 << 20) + 3 * 64]
    assert split.sizes.tolist() == [[64, 64, 64, 32, 32, 32, 64, 64, 64]]
    assert layout.regions_for_chunks(np.empty((0, 3), dtype=np.int64)) == []


def test_regions_for_chunks_refuses_blocks_outside_the_cache() -> None:
    with pytest.raises(InvalidRequestError, match="fall outside the cache's 100 blocks"):
        small_layout().regions_for_chunks(np.array([[1, 5], [99, 100]], dtype=np.int64))


def test_regions_for_chunks_real_bytes_round_trip() -> None:
    """Store chunks from a real cache through regions_for_chunks; read each value back contiguously
    and compare with the chunk's bytes assembled block by block."""
    rng = np.random.default_rng(7)
    regions, num_blocks, block_lens = 4, 32, [48, 16]
    region_lens = [block_lens[i % 2] for i in range(regions)]
    caches = [rng.integers(0, 256, size=blen * num_blocks, dtype=np.uint8) for blen in region_lens]
    layout = KVLayout([c.ctypes.data for c in caches], block_lens, 16, num_blocks)
    chunk_blocks = np.array([[3, 4, 5], [20, 7, 8], [0, 1, 2], [31, 30, 29]], dtype=np.int64)
    backend = MemoryBackend()
    for addr, size in layout.region_spans():
        backend.register_buffer(addr, size)
    keys = [f"chunk{k}" for k in range(chunk_blocks.shape[0])]
    for batch in layout.regions_for_chunks(chunk_blocks):
        codes = backend.batch_put([keys[r] for r in batch.rows.tolist()], batch.addrs, batch.sizes)
        assert codes == [0] * batch.rows.size
    value_len = 3 * sum(region_lens)
    out = np.zeros((len(keys), value_len), dtype=np.uint8)
    backend.register_buffer(out.ctypes.data, out.nbytes)
    starts = [[out.ctypes.data + k * value_len] for k in range(len(keys))]
    assert backend.batch_get(keys, starts, [[value_len]] * len(keys)) == [value_len] * len(keys)
    for k, blocks in enumerate(chunk_blocks.tolist()):
        expected = np.concatenate(
            [
                cache[b * blen : (b + 1) * blen]
                for cache, blen in zip(caches, region_lens, strict=True)
                for b in blocks
            ]
        )
        assert np.array_equal(out[k], expected)
    backend.close()


# -- the benchmark's inputs and plumbing (not its timings) -----------------------------------------


def test_benchmark_inputs_are_valid_multi_block_chunks() -> None:
    layout, chunks, block_ids = build_inputs(tokens=2048, block_size=16, regions=3, chunk_tokens=64)
    assert len(chunks) == 32 and len(block_ids) == 128
    addrs, sizes, bids = layout.prepare_values(chunks, block_ids)
    assert (addrs.tolist(), sizes.tolist(), bids.tolist()) == reference_all(layout, chunks, block_ids)
    # Each chunk's four blocks are physically consecutive, as prepare_values assumes.
    table = np.asarray(block_ids).reshape(32, 4)
    assert (np.diff(table, axis=1) == 1).all()
    assert len(set(table[:, 0].tolist())) == 32


def test_benchmark_runs_and_reports_every_figure() -> None:
    result = run_prepare_benchmark(
        tokens=4096, block_size=16, regions=4, chunk_tokens=32, repeats=2, min_sample_s=0
    )
    assert result["config"]["chunks"] == 128
    assert set(result["timings"]) == {
        "scalar_reference",
        "writeup_vectorised",
        "prepare_values_lists",
        "prepare_values_arrays",
        "chunk_hashes_int64_array",
        "chunk_hashes_list",
    }
    for timing in result["timings"].values():
        assert 0 < timing["best_ms"] <= timing["median_ms"]
        assert timing["samples"] == 2
    for ratio in result["speedups"].values():
        assert ratio["best"] > 0 and ratio["median"] > 0
    assert set(result["hashing"]) == {"chunk_hashes_int64_array", "chunk_hashes_list"}
    assert all(isinstance(met, bool) for met in result["goals_met"].values())


def test_benchmark_refuses_chunks_that_split_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        build_inputs(tokens=4096, block_size=16, regions=2, chunk_tokens=24)
