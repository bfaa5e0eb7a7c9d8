"""Shared test utilities: NumPy-backed paged KV caches, expected chunk bytes, a controllable backend.

- :class:`GroupCache` / :class:`PagedCache`: caches of one or more KV-cache groups, each ``R`` regions of
  ``num_blocks`` blocks, with the matching :class:`~aiokv.KVLayout`\\ s.
- :func:`chunk_value`: the bytes a store holds for one chunk (region by region, the chunk's blocks in
  token order), computed from the cache, whatever the physical placement of the blocks.
- :class:`ControlledBackend`: wraps a real backend (a :class:`~aiokv.MemoryBackend` by default) and
  can block a call on a :class:`threading.Event`, raise on demand, and records every call, the keys,
  regions and threads it saw.
- small helpers: :func:`wait_until` (poll from asyncio without blocking the loop), :func:`chunk_keys`,
  :func:`read_value`, :func:`same_blocks`, :func:`covers`, :func:`aiokv_threads`,
  :func:`scattered_block_ids`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiokv import KeyNamespace, KVLayout, MemoryBackend, chunk_hashes

SAFETY_TIMEOUT_S = 30.0  # how long a blocked backend call or a wait may last before the test fails
SENTINEL = 0xA5  # the byte unwritten blocks of a destination cache hold


@dataclass
class GroupCache:
    """One KV-cache group: ``regions[i]`` is a ``(num_blocks, block_lens[i])`` uint8 array."""

    regions: list[np.ndarray]
    layout: KVLayout

    @classmethod
    def allocate(
        cls,
        *,
        num_regions: int,
        num_blocks: int,
        block_size: int,
        block_lens: int | Sequence[int],
        fill: str | int = "random",
        seed: int = 0,
        dtype: str = "bytes",
    ) -> GroupCache:
        """``block_lens``: one length, or several cycled over the regions (as :class:`KVLayout` does).
        ``fill``: ``"random"`` bytes (from ``seed``) or a byte value for every byte."""
        lens = [block_lens] if isinstance(block_lens, int) else list(block_lens)
        rng = np.random.default_rng(seed)
        regions = []
        for i in range(num_regions):
            shape = (num_blocks, lens[i % len(lens)])
            if fill == "random":
                regions.append(rng.integers(0, 256, size=shape, dtype=np.uint8))
            else:
                regions.append(np.full(shape, int(fill), dtype=np.uint8))
        layout = KVLayout([r.ctypes.data for r in regions], lens, block_size, num_blocks, dtype=dtype)
        return cls(regions, layout)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def blocks(self, block_ids: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Copies of the given blocks, one array per region."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return [region[ids].copy() for region in self.regions]

    def fill(self, value: int) -> None:
        for region in self.regions:
            region[:] = value

    def untouched(self, block_ids: Sequence[int] | np.ndarray, value: int = SENTINEL) -> bool:
        """True when every byte of the given blocks, in every region, still equals ``value``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return all(bool((region[ids] == value).all()) for region in self.regions)

    def written_blocks(self, value: int = SENTINEL) -> set[int]:
        """Block ids holding any byte other than ``value`` in some region."""
        written = np.zeros(self.num_blocks, dtype=bool)
        for region in self.regions:
            written |= (region != value).any(axis=1)
        return set(np.flatnonzero(written).tolist())


@dataclass
class PagedCache:
    """An engine's KV cache of several groups (e.g. full attention and sliding window)."""

    groups: list[GroupCache]

    @classmethod
    def allocate(
        cls,
        specs: Sequence[dict[str, Any]],
        *,
        fill: str | int = "random",
        seed: int = 0,
    ) -> PagedCache:
        """One group per spec: keyword arguments of :meth:`GroupCache.allocate` (``fill`` and ``seed``
        default to the ones given here; each group gets its own seed)."""
        groups = [
            GroupCache.allocate(**{"fill": fill, "seed": seed + 1000 * g, **spec})
            for g, spec in enumerate(specs)
        ]
        return cls(groups)

    @property
    def layouts(self) -> list[KVLayout]:
        return [g.layout for g in self.groups]

    def __getitem__(self, group: int) -> GroupCache:
        return self.groups[group]

    def __len__(self) -> int:
        return len(self.groups)

    def fill(self, value: int) -> None:
        for group in self.groups:
            group.fill(value)


def chunk_value(cache: GroupCache, chunk_block_ids: Sequence[int] | np.ndarray) -> bytes:
    """The value a store must hold for a chunk made of these blocks (in token order): region by region,
    the blocks' bytes concatenated."""
    ids = [int(b) for b in chunk_block_ids]
    return b"".join(region[b].tobytes() for region in cache.regions for b in ids)


def same_blocks(
    src: GroupCache,
    src_ids: Sequence[int] | np.ndarray,
    dst: GroupCache,
    dst_ids: Sequence[int] | np.ndarray,
) -> bool:
    """True when block ``dst_ids[i]`` of ``dst`` equals block ``src_ids[i]`` of ``src`` in every region."""
    s, d = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source blocks against {d.size} destination blocks")
    return all(np.array_equal(a[s], b[d]) for a, b in zip(src.regions, dst.regions, strict=True))


def chunk_block_ids(block_ids: Sequence[int] | np.ndarray, chunk: int, per_chunk: int) -> list[int]:
    """The block ids of chunk ``chunk`` when each chunk spans ``per_chunk`` blocks."""
    return [int(b) for b in block_ids[chunk * per_chunk : (chunk + 1) * per_chunk]]


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


_OPS = ("register_buffer", "unregister_buffer", "batch_exists", "batch_put", "batch_get", "close")


@dataclass
class CallRecord:
    op: str
    keys: list[str]
    addrs: np.ndarray | None
    sizes: np.ndarray | None
    thread: str


@dataclass
class ControlledBackend:
    """A backend that delegates to a real one (``inner``) and lets a test control and observe it.

    ``block(op)`` (or ``with blocked(op):``) makes calls of ``op`` (e.g. ``"batch_put"``) wait, once
    entered, until ``release(op)`` (``entered(op)`` is set as soon as a call of ``op`` is inside);
    ``fail(op, exc, times)`` makes the next ``times`` calls raise ``exc`` (before touching ``inner``).
    Every call is recorded in ``records`` (keys, region arrays, thread name) and counted in ``calls``.
    """

    inner: Any = field(default_factory=lambda: MemoryBackend(capacity_bytes=64 << 20))
    records: list[CallRecord] = field(default_factory=list)
    registered: list[tuple[int, int]] = field(default_factory=list)  # (addr, size) of register_buffer
    calls: Counter[str] = field(default_factory=Counter)
    _gates: dict[str, threading.Event] = field(default_factory=dict)
    _entered: dict[str, threading.Event] = field(
        default_factory=lambda: {op: threading.Event() for op in _OPS}
    )
    _failures: dict[str, list[BaseException]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- control ----------------------------------------------------------------------------------

    def block(self, op: str) -> threading.Event:
        """Make calls of ``op`` wait until released; returns the gate."""
        self._check_op(op)
        gate = self._gates[op] = threading.Event()
        self._entered[op].clear()
        return gate

    @contextlib.contextmanager
    def blocked(self, op: str) -> Iterator[threading.Event]:
        """``block(op)`` for the ``with`` body; released on exit, also when the body fails (so a failing
        test does not leave a worker waiting on the gate). The body may :meth:`release` earlier."""
        gate = self.block(op)
        try:
            yield gate
        finally:
            self.release(op)

    def release(self, op: str | None = None) -> None:
        """Let blocked calls of ``op`` (of every op when None) go on; later calls no longer block."""
        for name in [op] if op is not None else list(self._gates):
            gate = self._gates.pop(name, None)
            if gate is not None:
                gate.set()

    def entered(self, op: str) -> threading.Event:
        """Set once a call of ``op`` has started (since the last :meth:`block` of it)."""
        self._check_op(op)
        return self._entered[op]

    def fail(self, op: str, exc: BaseException, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` raise ``exc`` without reaching ``inner``."""
        self._check_op(op)
        self._failures.setdefault(op, []).extend([exc] * times)

    # -- observation ------------------------------------------------------------------------------

    def keys_seen(self, op: str) -> list[str]:
        """Every key passed to ``op``, in call order (with repeats)."""
        return [key for r in self.records if r.op == op for key in r.keys]

    def all_keys_seen(self) -> set[str]:
        return {key for r in self.records for key in r.keys}

    def threads_seen(self) -> set[str]:
        return {r.thread for r in self.records}

    def reset_records(self) -> None:
        with self._lock:
            self.records.clear()
            self.calls.clear()

    # -- protocol ---------------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        self._enter("register_buffer", [], None, None)
        self.inner.register_buffer(addr, size)
        self.registered.append((int(addr), int(size)))

    def unregister_buffer(self, addr: int) -> None:
        self._enter("unregister_buffer", [], None, None)
        unregister = getattr(self.inner, "unregister_buffer", None)
        if callable(unregister):
            unregister(addr)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._enter("batch_exists", keys, None, None)
        return self.inner.batch_exists(keys)

    def batch_put(self, keys: Sequence[str], addrs: Any, sizes: Any) -> list[int]:
        self._enter("batch_put", keys, addrs, sizes)
        return self.inner.batch_put(keys, addrs, sizes)

    def batch_get(self, keys: Sequence[str], addrs: Any, sizes: Any) -> list[int]:
        self._enter("batch_get", keys, addrs, sizes)
        return self.inner.batch_get(keys, addrs, sizes)

    def close(self) -> None:
        self._enter("close", [], None, None)
        self.inner.close()

    # -- internals --------------------------------------------------------------------------------

    def _check_op(self, op: str) -> None:
        if op not in _OPS:
            raise ValueError(f"unknown backend call {op!r}; one of {_OPS}")

    def _enter(self, op: str, keys: Sequence[str], addrs: Any, sizes: Any) -> None:
        record = CallRecord(
            op,
            list(keys),
            None if addrs is None else np.array(addrs, dtype=np.int64, copy=True),
            None if sizes is None else np.array(sizes, dtype=np.int64, copy=True),
            threading.current_thread().name,
        )
        with self._lock:
            self.records.append(record)
            self.calls[op] += 1
            gate = self._gates.get(op)
            failures = self._failures.get(op)
            exc = failures.pop(0) if failures else None
        self._entered[op].set()
        if gate is not None and not gate.wait(SAFETY_TIMEOUT_S):
            raise AssertionError(f"{op} stayed blocked for {SAFETY_TIMEOUT_S} s: the test never released it")
        if exc is not None:
            raise exc


# The two-group geometry the worker tests use, on the embedded backend and on Mooncake.
TWO_GROUPS_CHUNK_TOKENS = 64  # a multiple of both groups' block sizes
TWO_GROUP_SPECS: list[dict[str, Any]] = [
    # Group 0: blocks of 16 tokens, 4 regions whose block lengths alternate (cycled block_lens).
    {"num_regions": 4, "num_blocks": 64, "block_size": 16, "block_lens": [64, 96]},
    # Group 1: blocks of 32 tokens, 2 regions.
    {"num_regions": 2, "num_blocks": 48, "block_size": 32, "block_lens": 128},
]
