"""Shared test utilities on top of :mod:`aiokv.testing` (the test double and the toy paged cache):

- :func:`recording_backend`: a MemoryBackend in a :class:`~aiokv.testing.FaultInjectingBackend`.
- small helpers: :func:`wait_until` (poll from asyncio without blocking the loop), :func:`chunk_keys`,
  :func:`read_value`, :func:`covers`, :func:`aiokv_threads`,
  :func:`scattered_block_ids`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokv import KeyNamespace, KVLayout, MemoryBackend, ThreadedKVWorker, chunk_hashes
from aiokv.testing import FaultInjectingBackend, PagedCache, same_blocks

SAFETY_TIMEOUT_S = 30.0  # how long a wait may last before the test fails


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    layout: KVLayout,
    group: int,
    namespace: KeyNamespace | str,
) -> list[str]:
    """The store keys a worker builds for ``tokens``' whole chunks in one group."""
    ns = KeyNamespace(namespace) if isinstance(namespace, str) else namespace
    return ns.keys(chunk_hashes(tokens, chunk_tokens), layout.fingerprint, group)


def read_value(backend: Any, key: str, size: int) -> bytes | None:
    """Read one key's value through the backend protocol into a scratch buffer (None if absent)."""
    scratch = np.zeros(max(size, 1), dtype=np.uint8)
    addr = int(scratch.ctypes.data)
    backend.register_buffer(addr, scratch.nbytes)
    try:
        code = backend.batch_get([key], [[addr]], [[size]])[0]
    finally:
        unregister = getattr(backend, "unregister_buffer", None)
        if callable(unregister):
            unregister(addr)
    if code < 0:
        return None
    return scratch[:size].tobytes()


def scattered_block_ids(
    rng: np.random.Generator, num_blocks: int, count: int, *, exclude: Sequence[int] = ()
) -> np.ndarray:
    """``count`` distinct random block ids from ``[0, num_blocks)`` minus ``exclude``."""
    pool = np.setdiff1d(np.arange(num_blocks), np.asarray(exclude, dtype=np.int64))
    if pool.size < count:
        raise ValueError(f"only {pool.size} blocks to pick {count} from")
    return rng.permutation(pool)[:count].astype(np.int64)


def covers(spans: Sequence[tuple[int, int]], addr: int, size: int) -> bool:
    """True when ``[addr, addr + size)`` lies wholly inside one of ``spans`` (``(addr, size)`` pairs)."""
    return any(start <= addr and addr + size <= start + length for start, length in spans)


def aiokv_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("aiokv")}


async def wait_until(predicate: Callable[[], bool], timeout: float = SAFETY_TIMEOUT_S) -> None:
    """Poll ``predicate`` on the loop (yielding between polls); fail the test if it never holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.001)


def recording_backend(capacity_bytes: int = 64 << 20) -> FaultInjectingBackend:
    """A real MemoryBackend in aiokv.testing's wrapper, without rules: it records every call, and a test
    can hold (``blocked``), fail or watch (``entered``, ``count``) calls of one op."""
    return FaultInjectingBackend(MemoryBackend(capacity_bytes=capacity_bytes))


# The two-group geometry the worker tests use, on the embedded backend and on Mooncake.
TWO_GROUPS_CHUNK_TOKENS = 64  # a multiple of both groups' block sizes
TWO_GROUP_SPECS: list[dict[str, Any]] = [
    # Group 0: blocks of 16 tokens, 4 regions whose block lengths alternate (cycled block_lens).
    {"num_regions": 4, "num_blocks": 64, "block_size": 16, "block_lens": [64, 96]},
    # Group 1: blocks of 32 tokens, 2 regions.
    {"num_regions": 2, "num_blocks": 48, "block_size": 32, "block_lens": 128},
]


def blocks_per_chunk(cache: PagedCache) -> list[int]:
    """Per group, the blocks one chunk of the two-group geometry spans."""
    return [TWO_GROUPS_CHUNK_TOKENS // layout.block_size for layout in cache.layouts]


def prompt(seed: int, chunks: int, extra: int = 0) -> list[int]:
    """Token ids of ``chunks`` whole chunks of the two-group geometry plus ``extra`` tokens."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 32_000, size=chunks * TWO_GROUPS_CHUNK_TOKENS + extra).tolist()


def scattered(cache: PagedCache, chunks: int, seed: int, extra_blocks: int = 0) -> list[np.ndarray]:
    """Random distinct block ids per group: chunk 0 on consecutive blocks (one region per cache region
    after coalescing), every other chunk on random, almost surely non-consecutive blocks."""
    rng = np.random.default_rng(seed)
    tables = []
    for group, per in zip(cache.groups, blocks_per_chunk(cache), strict=True):
        start = int(rng.integers(0, group.num_blocks - per))
        first = np.arange(start, start + per, dtype=np.int64)
        rest = scattered_block_ids(rng, group.num_blocks, (chunks - 1) * per + extra_blocks, exclude=first)
        tables.append(np.concatenate([first, rest]))
    return tables


def assert_loaded(
    src: PagedCache, src_ids: list[np.ndarray], dst: PagedCache, dst_ids: list[np.ndarray], n: int
) -> None:
    """Chunks ``[0, n)`` of ``dst_ids`` hold the bytes of the same chunks of ``src_ids``."""
    for g, per in enumerate(blocks_per_chunk(src)):
        assert same_blocks(src[g], src_ids[g][: n * per], dst[g], dst_ids[g][: n * per]), f"group {g}"


def same_exception(raised: BaseException | None, template: BaseException) -> bool:
    """Whether ``raised`` is a fault rule's firing of ``template``: rules raise a fresh copy each time
    (same type, arguments and attributes), so identity is not the test."""
    return (
        raised is not None
        and type(raised) is type(template)
        and raised.args == template.args
        and vars(raised) == vars(template)
    )


def hold_loop(worker: ThreadedKVWorker) -> threading.Event:
    """Keep the worker's loop thread busy in a callback until the returned event is set."""
    held, release = threading.Event(), threading.Event()  # the loop is private: tests only

    def hold() -> None:
        held.set()
        release.wait(SAFETY_TIMEOUT_S)

    worker._loop.call_soon_threadsafe(hold)
    assert held.wait(SAFETY_TIMEOUT_S)
    return release


@contextlib.contextmanager
def read_only_directory(parent: Path) -> Iterator[Path]:
    """A directory this process may not write, under ``parent`` (writable again afterwards); the test
    is skipped where the user bypasses directory permissions (root outside a user namespace)."""
    locked = parent / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        try:
            (locked / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("this user bypasses directory permissions (root)")
        yield locked
    finally:
        locked.chmod(0o700)
