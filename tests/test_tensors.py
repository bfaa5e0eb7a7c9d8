"""KVLayout.from_tensors: every engine layout in CASES, with NumPy arrays and torch tensors,
round-tripping real bytes through the worker; and the refusals, each naming the tensor."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from aiokv import InvalidRequestError, KVLayout, KVWorker, MemoryBackend
from tests.mooncake_support import in_ci

N = 8  # blocks per cache
BS = 4  # tokens per block
LAYERS, HEADS, DIM = 3, 2, 8
CHUNK_TOKENS = 2 * BS
# Chunk 0 physically consecutive, chunks 1-2 scattered, in both caches.
SRC_IDS = [3, 4, 7, 1, 0, 5]
DST_IDS = [1, 2, 6, 0, 4, 3]


def require_torch() -> ModuleType:
    """torch comes with the vllm extra the test command installs: under CI its absence is a failure."""
    try:
        import torch
    except ImportError as exc:
        if in_ci():
            pytest.fail(f"CI must run the torch layout tests, but torch is missing: {exc}", pytrace=False)
        pytest.skip("torch is not installed (pip install 'aiokv[vllm]')")
    return torch


class Arrays:
    """Random-byte tensors of one framework: NumPy float16 or torch bfloat16 (a dtype NumPy lacks)."""

    def __init__(self, framework: str, seed: int) -> None:
        self.framework = framework
        self.rng = np.random.default_rng(seed)
        self.torch = require_torch() if framework == "torch" else None

    def random(self, *shape: int) -> Any:
        raw = self.rng.integers(0, 256, size=2 * int(np.prod(shape)), dtype=np.uint8)
        if self.torch is None:
            return raw.view(np.float16).reshape(shape)
        return self.torch.from_numpy(raw).view(self.torch.bfloat16).reshape(shape).clone()

    def zeros_like(self, tensor: Any) -> Any:
        if self.torch is None:
            return np.zeros_like(tensor)
        return self.torch.zeros_like(tensor)

    def bits(self, tensor: Any) -> np.ndarray:
        """The tensor's bits as int16 (NaN-safe comparisons)."""
        if self.torch is None:
            return np.asarray(tensor).view(np.int16)
        return tensor.view(self.torch.int16).numpy()


@dataclass
class Case:
    """One engine layout: ``make`` returns (the buffer every tensor views, the tensors)."""

    name: str
    make: Callable[[Arrays, Callable[..., Any]], tuple[Any, list[Any]]]
    block_dim: int
    regions: int
    pairs_one_block: int  # pairs per chunk of one block
    pairs_two_blocks: int  # pairs per chunk of two consecutive blocks


def _per_layer(shape: tuple[int, ...]) -> Callable[[Arrays, Callable[..., Any]], tuple[Any, list[Any]]]:
    """One separately allocated tensor per layer."""

    def make(arrays: Arrays, alloc: Callable[..., Any]) -> tuple[Any, list[Any]]:
        tensors = [alloc(*shape) for _ in range(LAYERS)]
        return tensors, tensors

    return make


def _views(
    shape: tuple[int, ...], split: Callable[[Any], list[Any]]
) -> Callable[[Arrays, Callable[..., Any]], tuple[Any, list[Any]]]:
    """Views into one buffer."""

    def make(arrays: Arrays, alloc: Callable[..., Any]) -> tuple[Any, list[Any]]:
        buffer = alloc(*shape)
        return [buffer], split(buffer)

    return make


KV = 2 * HEADS * DIM
CASES = [
    # vLLM FlashAttention: per layer [2, num_blocks, block_size, heads, head_dim]; K and V are 2 regions.
    Case("flash_attention", _per_layer((2, N, BS, HEADS, DIM)), 1, 2 * LAYERS, 2 * LAYERS, 2 * LAYERS),
    # FlashInfer: per layer [num_blocks, 2, block_size, heads, head_dim].
    Case("flashinfer", _per_layer((N, 2, BS, HEADS, DIM)), 0, LAYERS, LAYERS, LAYERS),
    # vLLM CPU: per layer [num_blocks, heads, block_size, 2 * head_dim], every layer a view of one buffer.
    Case(
        "vllm_cpu",
        _views((LAYERS, N, HEADS, BS, 2 * DIM), lambda b: [b[i] for i in range(LAYERS)]),
        0,
        LAYERS,
        LAYERS,
        LAYERS,
    ),
    # MLA: per layer [num_blocks, block_size, latent dim].
    Case("mla", _per_layer((N, BS, 72)), 0, LAYERS, LAYERS, LAYERS),
    # Cross-layer (block-major): one region holding every layer of a block.
    Case("cross_layer", _views((N, LAYERS, 2, BS, HEADS, DIM), lambda b: [b]), 0, 1, 1, 1),
    # Per-layer views into the cross-layer buffer: strided regions that interleave; one-block chunks
    # coalesce to one pair, two-block chunks cannot (value order is layer by layer).
    Case(
        "cross_layer_views",
        _views((N, LAYERS, 2, BS, HEADS, DIM), lambda b: [b[:, i] for i in range(LAYERS)]),
        0,
        LAYERS,
        1,
        2 * LAYERS,
    ),
    # Per-layer views with gaps: each block is padded by 16 elements.
    Case(
        "padded_views",
        _views((LAYERS, N, BS * KV + 16), lambda b: [b[i, :, : BS * KV] for i in range(LAYERS)]),
        0,
        LAYERS,
        LAYERS,
        2 * LAYERS,
    ),
    # SGLang host pool, layer first: [2, layers, tokens, heads, dim] seen as pages of block_size tokens.
    Case(
        "sglang_layer_first",
        _views((2, LAYERS, N * BS, HEADS, DIM), lambda b: [b.reshape(2, LAYERS, N, BS, HEADS, DIM)]),
        2,
        2 * LAYERS,
        2 * LAYERS,
        2 * LAYERS,
    ),
    # SGLang host pool, page first: [2, tokens, layers, heads, dim]; a page holds every layer.
    Case(
        "sglang_page_first",
        _views((2, N * BS, LAYERS, HEADS, DIM), lambda b: [b.reshape(2, N, BS, LAYERS, HEADS, DIM)]),
        1,
        2,
        2,
        2,
    ),
    # SGLang page_first_direct: [2, pages, layers, page_size, heads, dim].
    Case("sglang_page_first_direct", _views((2, N, LAYERS, BS, HEADS, DIM), lambda b: [b]), 1, 2, 2, 2),
]


def _take(arrays: Arrays, tensor: Any, block_dim: int, block: int) -> np.ndarray:
    """Block ``block`` of a tensor (the slice at ``block`` along ``block_dim``) as int16 bits."""
    return arrays.bits(tensor)[(slice(None),) * block_dim + (block,)]


def _build(case: Case, framework: str, seed: int) -> tuple[Arrays, Any, list[Any], KVLayout]:
    arrays = Arrays(framework, seed)
    owner, tensors = case.make(arrays, arrays.random)
    return arrays, owner, tensors, KVLayout.from_tensors(tensors, block_size=BS, block_dim=case.block_dim)


def _zeroed_copy(case: Case, arrays: Arrays) -> tuple[Any, list[Any], KVLayout]:
    owner, tensors = case.make(arrays, lambda *shape: arrays.zeros_like(arrays.random(*shape)))
    return owner, tensors, KVLayout.from_tensors(tensors, block_size=BS, block_dim=case.block_dim)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_geometry_of_each_engine_layout(case: Case, framework: str) -> None:
    arrays, _, tensors, layout = _build(case, framework, seed=1)
    assert layout.num_regions == case.regions
    assert layout.num_blocks == N and layout.block_size == BS
    assert layout.dtype == ("float16" if framework == "numpy" else "bfloat16")
    assert layout.device == "cpu"
    # Every block of every tensor is covered, once: the value of a block is all its bytes.
    block_bytes = sum(int(np.prod(_take(arrays, t, case.block_dim, 0).shape)) * 2 for t in tensors)
    assert layout.chunk_bytes_per_block == block_bytes
    assert layout.pairs_per_chunk(1) == case.pairs_one_block
    assert layout.pairs_per_chunk(2) == case.pairs_two_blocks
    # Registered spans lie inside the tensors' memory.
    lows = [_data_ptr(t) for t in tensors]
    highs = [_data_ptr(t) + _extent(t) for t in tensors]
    for addr, size in layout.region_spans():
        assert any(lo <= addr and addr + size <= hi for lo, hi in zip(lows, highs, strict=True))


def _data_ptr(tensor: Any) -> int:
    return int(tensor.ctypes.data) if isinstance(tensor, np.ndarray) else int(tensor.data_ptr())


def _extent(tensor: Any) -> int:
    """Bytes from the tensor's first element to the end of its last (non-negative strides)."""
    if isinstance(tensor, np.ndarray):
        strides, itemsize = tensor.strides, tensor.itemsize
    else:
        itemsize = tensor.element_size()
        strides = [s * itemsize for s in tensor.stride()]
    return sum((n - 1) * s for n, s in zip(tensor.shape, strides, strict=True)) + itemsize


@pytest.mark.asyncio
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_round_trip_through_the_worker(case: Case, framework: str) -> None:
    """Store chunks from one cache built from tensors, load them into a zeroed cache of the same
    geometry: every loaded block equals its source block, every other block stays zero."""
    arrays, _, src_tensors, src_layout = _build(case, framework, seed=2)
    _, dst_tensors, dst_layout = _zeroed_copy(case, arrays)
    assert dst_layout.fingerprint == src_layout.fingerprint
    tokens = list(range(1000, 1000 + len(SRC_IDS) * BS))
    backend = MemoryBackend()
    try:
        async with KVWorker(src_layout, backend, namespace="m", chunk_tokens=CHUNK_TOKENS) as worker:
            stored = await worker.store(tokens, [SRC_IDS])
        assert (stored.stored, stored.failed) == (3, 0)
        async with KVWorker(dst_layout, backend, namespace="m", chunk_tokens=CHUNK_TOKENS) as worker:
            loaded = await worker.load(tokens, [DST_IDS])
        assert loaded.loaded_tokens == len(tokens) and loaded.ok
    finally:
        backend.close()
    for src, dst in zip(src_tensors, dst_tensors, strict=True):
        for src_block, dst_block in zip(SRC_IDS, DST_IDS, strict=True):
            assert np.array_equal(
                _take(arrays, dst, case.block_dim, dst_block), _take(arrays, src, case.block_dim, src_block)
            )
        for untouched in sorted(set(range(N)) - set(DST_IDS)):
            assert not _take(arrays, dst, case.block_dim, untouched).any()


@pytest.mark.asyncio
async def test_block_major_views_share_keys_and_bytes_with_a_layer_major_cache() -> None:
    """Equal geometry, different allocation: a layer-major cache stores, per-layer views of a
    block-major buffer load, and the blocks arrive intact (the value order does not depend on it)."""
    arrays = Arrays("numpy", seed=3)
    layer_major = [arrays.random(N, 2, BS, HEADS, DIM) for _ in range(LAYERS)]
    block_major = np.zeros((N, LAYERS, 2, BS, HEADS, DIM), dtype=np.float16)
    views = [block_major[:, i] for i in range(LAYERS)]
    src = KVLayout.from_tensors(layer_major, block_size=BS)
    dst = KVLayout.from_tensors(views, block_size=BS)
    assert src.fingerprint == dst.fingerprint
    assert (src.pairs_per_chunk(1), dst.pairs_per_chunk(1)) == (LAYERS, 1)
    tokens = list(range(len(SRC_IDS) * BS))
    backend = MemoryBackend()
    try:
        async with KVWorker(src, backend, namespace="m", chunk_tokens=BS) as worker:
            assert (await worker.store(tokens, [SRC_IDS])).stored == len(SRC_IDS)
        async with KVWorker(dst, backend, namespace="m", chunk_tokens=BS) as worker:
            assert (await worker.load(tokens, [DST_IDS])).ok
    finally:
        backend.close()
    for layer in range(LAYERS):
        for s, d in zip(SRC_IDS, DST_IDS, strict=True):
            assert np.array_equal(block_major[d, layer].view(np.int16), layer_major[layer][s].view(np.int16))


def test_mapping_names_tensors_and_the_layout_keeps_them_alive() -> None:
    caches = {
        f"model.layers.{i}.self_attn.attn": np.zeros((N, HEADS, BS, 2 * DIM), np.float16) for i in (0, 1)
    }
    layout = KVLayout.from_tensors(caches, block_size=BS)
    assert layout.base_addrs.tolist() == [c.ctypes.data for c in caches.values()]
    assert layout.region_block_strides.tolist() == [HEADS * BS * 2 * DIM * 2] * 2
    before = layout.base_addrs.tolist()
    del caches
    # The tensors live on with the layout: their memory cannot be reused under it.
    assert [t.ctypes.data for t in layout._owners] == before  # type: ignore[attr-defined]
    bad = {"layer.0": np.zeros((N, 4)), "layer.1": np.zeros((N + 1, 4))}
    with pytest.raises(
        ValueError, match=r"tensor 'layer\.1' has 9 blocks along block_dim but tensor 'layer\.0' has 8"
    ):
        KVLayout.from_tensors(bad, block_size=BS)


def test_torch_device_and_dtype_are_read_without_importing_torch_in_aiokv() -> None:
    torch = require_torch()
    tensor = torch.zeros((N, BS, 16), dtype=torch.float8_e4m3fn)
    layout = KVLayout.from_tensors([tensor], block_size=BS)
    assert (layout.dtype, layout.device) == ("float8_e4m3fn", "cpu")
    assert layout.base_addrs.tolist() == [tensor.data_ptr()]
    # A view with a storage offset: the layout starts at the view's first element.
    view = torch.zeros((2 * N, BS, 16))[N:]
    assert KVLayout.from_tensors([view], block_size=BS).base_addrs.tolist() == [view.data_ptr()]
    meta = torch.empty((N, BS, 16), device="meta")
    with pytest.raises(ValueError, match=r"tensors\[0\] has no memory"):
        KVLayout.from_tensors([meta], block_size=BS)


def test_importing_aiokv_does_not_import_torch() -> None:
    import subprocess

    code = "import sys, numpy as np, aiokv; aiokv.KVLayout.from_tensors([np.zeros((2, 4))], block_size=1); "
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- refusals -------------------------------------------------------------------------------------


def _overlapping_strides() -> list[np.ndarray]:
    big = np.zeros(N * 16, dtype=np.uint8)
    # Stride 8 and stride 16 over one buffer; bytes 3..4 of the first block are in both.
    return [big[: N * 8].reshape(N, 8)[:, :4], big.reshape(N, 16)[:, 3:5]]


REFUSALS: list[tuple[str, Callable[[], list[Any]], int, type[Exception], str]] = [
    (
        "non-contiguous trailing dims",
        lambda: [np.zeros((N, 4)), np.zeros((N, 4, 8))[:, :, ::2]],
        0,
        InvalidRequestError,
        r"tensors\[1\]: the dims after block_dim 0 are not C-contiguous",
    ),
    (
        "transposed trailing dims",
        lambda: [np.zeros((N, 8, 4)).transpose(0, 2, 1)],
        0,
        InvalidRequestError,
        r"tensors\[0\]: the dims after block_dim 0 are not C-contiguous",
    ),
    (
        "block_dim too large",
        lambda: [np.zeros((N, 4))],
        2,
        InvalidRequestError,
        r"tensors\[0\]: block_dim 2 is out of range",
    ),
    (
        "block_dim too small",
        lambda: [np.zeros((N, 4))],
        -3,
        InvalidRequestError,
        r"tensors\[0\]: block_dim -3 is out",
    ),
    (
        "mismatched block counts",
        lambda: [np.zeros((N, 4)), np.zeros((N - 1, 4))],
        0,
        InvalidRequestError,
        r"tensors\[1\] has 7 blocks along block_dim but tensors\[0\] has 8",
    ),
    ("empty blocks", lambda: [np.zeros((0, 4))], 0, InvalidRequestError, r"tensors\[0\] is empty"),
    (
        "empty trailing dim",
        lambda: [np.zeros((N, 4)), np.zeros((N, 0))],
        0,
        InvalidRequestError,
        r"tensors\[1\] is empty",
    ),
    ("no tensors", lambda: [], 0, InvalidRequestError, "at least one tensor"),
    (
        "negative stride",
        lambda: [np.zeros((N, 4))[::-1]],
        0,
        InvalidRequestError,
        r"tensors\[0\] has a negative stride",
    ),
    (
        "overlapping blocks",
        lambda: [np.lib.stride_tricks.as_strided(np.zeros(64, np.uint8), shape=(N, 8), strides=(4, 1))],
        0,
        InvalidRequestError,
        r"tensors\[0\]: blocks along dim 0 are 4 bytes apart but 8 bytes long",
    ),
    (
        "same tensor twice",
        lambda: [a := np.zeros((N, 4)), a],
        0,
        InvalidRequestError,
        r"tensors\[0\] piece 0 and tensors\[1\] piece 0 share memory",
    ),
    (
        "partial overlap",
        lambda: [(b := np.zeros((2 * N, 4)))[:N], b[N - 1 : 2 * N - 1]],
        0,
        InvalidRequestError,
        r"tensors\[0\] piece 0 and tensors\[1\] piece 0 share memory",
    ),
    (
        "interleaved regions with equal strides that overlap",
        lambda: [(b := np.zeros((N, 8), np.uint8))[:, 0:3], b[:, 2:5]],
        0,
        InvalidRequestError,
        r"tensors\[0\] piece 0 and tensors\[1\] piece 0 share memory",
    ),
    (
        "pieces of one tensor overlapping another",
        lambda: [(b := np.zeros((2, N, 4)))[:, :, :], b[1][None]],
        1,
        InvalidRequestError,
        r"tensors\[0\] piece 1 and tensors\[1\] piece 0 share memory",
    ),
    ("different strides that overlap", _overlapping_strides, 0, InvalidRequestError, "share memory"),
    (
        "mixed dtypes",
        lambda: [np.zeros((N, 4), np.float16), np.zeros((N, 4), np.float32)],
        0,
        InvalidRequestError,
        r"tensors\[1\] has dtype float32 but tensors\[0\] has float16",
    ),
    ("not a tensor", lambda: [[1, 2, 3]], 0, TypeError, r"tensors\[0\] is a list, not a torch.Tensor"),
]


@pytest.mark.parametrize(
    ("tensors", "block_dim", "error", "message"),
    [r[1:] for r in REFUSALS],
    ids=[r[0] for r in REFUSALS],
)
def test_refusals_name_the_tensor(
    tensors: Callable[[], list[Any]], block_dim: int, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        KVLayout.from_tensors(tensors(), block_size=BS, block_dim=block_dim)


def test_refused_arguments() -> None:
    array = np.zeros((N, 4))
    with pytest.raises(TypeError, match="wrap a single tensor in a list"):
        KVLayout.from_tensors(array, block_size=BS)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_dim must be an int"):
        KVLayout.from_tensors([array], block_size=BS, block_dim=True)
    with pytest.raises(TypeError, match="block_size must be an int"):
        KVLayout.from_tensors([array], block_size=4.0)  # type: ignore[arg-type]


def test_interleaving_without_shared_bytes_is_accepted() -> None:
    big = np.zeros(N * 16, dtype=np.uint8)
    # Stride 8 (bytes 0-3 of each 8) and stride 16 (bytes 4-5 of each 16): interleaved, disjoint.
    layout = KVLayout.from_tensors(
        [big[: N * 8].reshape(N, 8)[:, :4], big.reshape(N, 16)[:, 4:6]], block_size=1
    )
    assert layout.region_block_strides.tolist() == [8, 16]
    b = np.zeros((N, 8), np.uint8)
    assert KVLayout.from_tensors([b[:, 0:3], b[:, 3:5], b[:, 6:8]], block_size=1).pairs_per_chunk(1) == 2


class DeviceTensor:
    """A tensor on a device this machine does not have: only the duck-typed surface from_tensors reads
    (its pointer is never dereferenced; the layout is arithmetic)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], device: str) -> None:
        self.ptr, self.shape, self.device, self.dtype = ptr, shape, device, "torch.bfloat16"

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return 2

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        return tuple(reversed(strides))


def test_device_tensors_record_their_device() -> None:
    shape = (2, N, BS, HEADS, DIM)
    tensors = [DeviceTensor((1 << 40) + i * (1 << 30), shape, "cuda:0") for i in range(2)]
    layout = KVLayout.from_tensors(tensors, block_size=BS, block_dim=1)
    assert (layout.device, layout.dtype, layout.num_regions) == ("cuda:0", "bfloat16", 4)
    assert layout.base_addrs.tolist()[:2] == [1 << 40, (1 << 40) + N * BS * HEADS * DIM * 2]
    assert "device='cuda:0'" in repr(layout)
    mixed = [tensors[0], DeviceTensor(1 << 42, shape, "cuda:1")]
    with pytest.raises(
        InvalidRequestError, match=r"tensors\[1\] has device cuda:1 but tensors\[0\] has cuda:0"
    ):
        KVLayout.from_tensors(mixed, block_size=BS, block_dim=1)
