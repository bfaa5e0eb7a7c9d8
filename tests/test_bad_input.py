"""Bad input to every public entry point: wrong type, negative, out of range, too short, NaN, huge,
empty. Each raises ValueError/TypeError naming the argument (at the call, or through the request's
future), nothing reaches the backend, and the worker keeps serving.

The backend is aiokv.testing's FaultInjectingBackend without rules, only to record calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv import (
    HashedPrompt,
    InvalidRequestError,
    KeyNamespace,
    KVLayout,
    KVWorker,
    MemoryBackend,
    chunk_hashes,
)
from aiokv.testing import SENTINEL, FaultInjectingBackend, PagedCache

NAN, INF = math.nan, math.inf
HUGE = 2**70
CHUNK = 8
SPECS = [
    {"num_regions": 2, "num_blocks": 16, "block_size": 4, "block_lens": 32},
    {"num_regions": 1, "num_blocks": 8, "block_size": 8, "block_lens": 64},
]
EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_region = np.zeros((16, 64), dtype=np.uint8)
BASE = int(_region.ctypes.data)
LAYOUT = KVLayout([BASE], [64], 4, 16)


def check_raises(call: Callable[[], object], named: str) -> BaseException:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert named in str(info.value), f"{info.value!r} does not name {named!r}"
    return info.value


# -- constructors and pure functions ----------------------------------------------------------------


def layout(**kwargs: Any) -> Callable[[], object]:
    args: dict[str, Any] = {"base_addrs": [BASE], "block_lens": [64], "block_size": 4, "num_blocks": 16}
    args.update(kwargs)
    return lambda: KVLayout(**args)


SYNC_CASES: list[tuple[str, Callable[[], object], str]] = [
    # KVLayout
    ("base_addrs-str", layout(base_addrs="0x1000"), "base_addrs"),
    ("base_addrs-scalar", layout(base_addrs=BASE), "base_addrs"),
    ("base_addrs-none", layout(base_addrs=None), "base_addrs"),
    ("base_addrs-empty", layout(base_addrs=[]), "base_addrs"),
    ("base_addrs-zero", layout(base_addrs=[0]), "base_addrs"),
    ("base_addrs-negative", layout(base_addrs=[-4096]), "base_addrs"),
    ("base_addrs-float", layout(base_addrs=[float(BASE)]), "base_addrs"),
    ("base_addrs-nan", layout(base_addrs=[NAN]), "base_addrs"),
    ("base_addrs-huge", layout(base_addrs=[HUGE]), "base_addrs"),
    ("base_addrs-2d", layout(base_addrs=[[BASE]]), "base_addrs"),
    ("block_lens-empty", layout(block_lens=[]), "block_lens"),
    ("block_lens-zero", layout(block_lens=[0]), "block_lens"),
    ("block_lens-negative", layout(block_lens=[-64]), "block_lens"),
    ("block_lens-nan", layout(block_lens=[NAN]), "block_lens"),
    ("block_lens-too-many", layout(block_lens=[64, 64]), "block_lens"),
    ("block_lens-huge", layout(block_lens=[2**62]), "block_lens"),
    ("block_lens-str", layout(block_lens="64"), "block_lens"),
    *[
        (f"{arg}-{label}", layout(**{arg: value}), arg)
        for arg in ("block_size", "num_blocks")
        for label, value in [
            ("zero", 0),
            ("negative", -1),
            ("float", 4.0),
            ("nan", NAN),
            ("inf", INF),
            ("str", "4"),
            ("bool", True),
            ("none", None),
            ("huge", HUGE),
        ]
    ],
    ("num_blocks-past-address-space", layout(num_blocks=2**60), "num_blocks"),
    ("dtype-empty", layout(dtype=""), "dtype"),
    ("dtype-int", layout(dtype=2), "dtype"),
    # prepare_values / prepare_value
    ("chunks-str", lambda: LAYOUT.prepare_values("0,4", [0]), "chunks"),
    ("chunks-not-pairs", lambda: LAYOUT.prepare_values([0, 4], [0]), "chunks"),
    ("chunks-negative", lambda: LAYOUT.prepare_values([(-4, 0)], [0]), "start is negative"),
    ("chunks-misaligned", lambda: LAYOUT.prepare_values([(1, 5)], [0, 1]), "aligned"),
    ("chunks-empty-span", lambda: LAYOUT.prepare_values([(4, 4)], [0, 1]), "span"),
    ("chunks-nan", lambda: LAYOUT.prepare_values([(0, NAN)], [0]), "chunks"),
    ("chunks-huge", lambda: LAYOUT.prepare_values([(0, HUGE)], [0]), "chunks"),
    ("chunks-past-cache", lambda: LAYOUT.prepare_values([(0, 4 * 17)], [0]), "outside the cache"),
    ("block_ids-too-short", lambda: LAYOUT.prepare_values([(4, 8)], [0]), "block_ids"),
    ("block_ids-out-of-range", lambda: LAYOUT.prepare_values([(0, 4)], [16]), "outside the cache"),
    ("block_ids-negative", lambda: LAYOUT.prepare_values([(0, 4)], [-1]), "outside the cache"),
    ("block_ids-float", lambda: LAYOUT.prepare_values([(0, 4)], [0.0]), "block_ids"),
    ("block_ids-nan", lambda: LAYOUT.prepare_values([(0, 4)], [NAN]), "block_ids"),
    ("block_ids-huge", lambda: LAYOUT.prepare_values([(0, 4)], [HUGE]), "block_ids"),
    ("block_ids-none", lambda: LAYOUT.prepare_values([(0, 4)], None), "block_ids"),
    ("start-float", lambda: LAYOUT.prepare_value(0.0, 4, [0]), "start"),
    ("start-str", lambda: LAYOUT.prepare_value("0", 4, [0]), "start"),
    ("end-none", lambda: LAYOUT.prepare_value(0, None, [0]), "end"),
    ("end-nan", lambda: LAYOUT.prepare_value(0, NAN, [0]), "end"),
    ("end-huge", lambda: LAYOUT.prepare_value(0, HUGE, [0]), "chunks"),
    ("start-negative", lambda: LAYOUT.prepare_value(-4, 0, [0]), "start is negative"),
    ("prepare_value-block_ids-empty", lambda: LAYOUT.prepare_value(0, 4, []), "block_ids"),
    # chunk_hashes / HashedPrompt
    ("token_ids-negative", lambda: chunk_hashes([-1] * 8, 4), "token_ids"),
    ("token_ids-2**32", lambda: chunk_hashes([2**32] * 8, 4), "token_ids"),
    ("token_ids-huge", lambda: chunk_hashes([HUGE] * 8, 4), "token_ids"),
    ("token_ids-float", lambda: chunk_hashes([1.0] * 8, 4), "token_ids"),
    ("token_ids-nan", lambda: chunk_hashes([NAN] * 8, 4), "token_ids"),
    ("token_ids-str", lambda: chunk_hashes("abcdefgh", 4), "token_ids"),
    ("token_ids-none", lambda: chunk_hashes(None, 4), "token_ids"),  # type: ignore[arg-type]
    ("token_ids-2d", lambda: chunk_hashes([[1, 2, 3, 4]], 4), "token_ids"),
    ("token_ids-mixed", lambda: chunk_hashes([1, "2", 3, 4], 4), "token_ids"),
    ("token_ids-bool", lambda: chunk_hashes([True] * 4, 4), "token_ids"),
    *[
        (f"chunk_tokens-{label}", lambda v=value: chunk_hashes([1] * 8, v), "chunk_tokens")
        for label, value in [
            ("zero", 0),
            ("negative", -4),
            ("float", 4.0),
            ("nan", NAN),
            ("str", "4"),
            ("huge", HUGE),
        ]
    ],
    ("from_tokens-nan", lambda: HashedPrompt.from_tokens([NAN] * 8, 4), "token_ids"),
    ("from_tokens-chunk_tokens", lambda: HashedPrompt.from_tokens([1] * 8, 0), "chunk_tokens"),
    ("block_hashes-str", lambda: HashedPrompt.from_block_hashes("abc", 4, 8), "block_hashes"),
    ("block_hashes-none", lambda: HashedPrompt.from_block_hashes(None, 4, 8), "block_hashes"),  # type: ignore[arg-type]
    ("block_hashes-int", lambda: HashedPrompt.from_block_hashes(7, 4, 8), "block_hashes"),  # type: ignore[arg-type]
    ("block_hashes-float", lambda: HashedPrompt.from_block_hashes([1.5, 2], 4, 8), "block_hashes[0]"),
    ("block_hashes-nan", lambda: HashedPrompt.from_block_hashes([b"a", NAN], 4, 8), "block_hashes[1]"),
    ("block_hashes-none-item", lambda: HashedPrompt.from_block_hashes([None], 4, 8), "block_hashes[0]"),
    ("block_hashes-bool-item", lambda: HashedPrompt.from_block_hashes([True], 4, 8), "block_hashes[0]"),
    ("from_block_hashes-block_size", lambda: HashedPrompt.from_block_hashes([1], 0, 8), "block_size"),
    ("from_block_hashes-block_size-float", lambda: HashedPrompt.from_block_hashes([1], 4.0, 8), "block_size"),
    ("from_block_hashes-chunk_tokens", lambda: HashedPrompt.from_block_hashes([1], 4, -8), "chunk_tokens"),
    ("from_block_hashes-misaligned", lambda: HashedPrompt.from_block_hashes([1], 4, 6), "chunk_tokens"),
    # KeyNamespace
    ("model-empty", lambda: KeyNamespace(""), "model"),
    ("model-int", lambda: KeyNamespace(5), "model"),  # type: ignore[arg-type]
    ("model-none", lambda: KeyNamespace(None), "model"),  # type: ignore[arg-type]
    ("model-space", lambda: KeyNamespace("my model"), "model"),
    ("model-newline", lambda: KeyNamespace("m\n"), "model"),
    ("tp_rank-negative", lambda: KeyNamespace("m", tp_rank=-1), "tp_rank"),
    ("tp_rank-float", lambda: KeyNamespace("m", tp_rank=1.0), "tp_rank"),  # type: ignore[arg-type]
    ("tp_rank-bool", lambda: KeyNamespace("m", tp_rank=True), "tp_rank"),
    ("pp_rank-nan", lambda: KeyNamespace("m", pp_rank=NAN), "pp_rank"),  # type: ignore[arg-type]
    ("pp_rank-str", lambda: KeyNamespace("m", pp_rank="0"), "pp_rank"),  # type: ignore[arg-type]
    ("share_across_tp-str", lambda: KeyNamespace("m", share_across_tp="yes"), "share_across_tp"),  # type: ignore[arg-type]
    # MemoryBackend
    *[
        (f"capacity_bytes-{label}", lambda v=value: MemoryBackend(v), "capacity_bytes")
        for label, value in [
            ("zero", 0),
            ("negative", -1),
            ("float", 1024.0),
            ("nan", NAN),
            ("inf", INF),
            ("str", "1024"),
            ("bool", True),
            ("none", None),
        ]
    ],
]


@pytest.mark.parametrize(("call", "named"), [c[1:] for c in SYNC_CASES], ids=[c[0] for c in SYNC_CASES])
def test_bad_arguments_raise_naming_the_argument(call: Callable[[], object], named: str) -> None:
    check_raises(call, named)


def test_invalid_request_error_is_a_value_error() -> None:
    error = check_raises(layout(block_size=0), "block_size")
    assert isinstance(error, InvalidRequestError) and isinstance(error, ValueError)


# -- KVWorker(...) --------------------------------------------------------------------------------------


def worker_args(cache: PagedCache, backend: Any, **kwargs: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "layouts": cache.layouts,
        "backend": backend,
        "namespace": "bad-input",
        "chunk_tokens": CHUNK,
    }
    args.update(kwargs)
    return args


WORKER_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("layouts-empty", {"layouts": []}, "layouts"),
    ("layouts-none", {"layouts": None}, "layouts"),
    ("layouts-str", {"layouts": "layout"}, "layouts"),
    ("layouts-ints", {"layouts": [1, 2]}, "layouts"),
    ("backend-object", {"backend": object()}, "backend"),
    ("backend-none", {"backend": None}, "backend"),
    ("namespace-int", {"namespace": 5}, "namespace"),
    ("namespace-none", {"namespace": None}, "namespace"),
    ("namespace-empty", {"namespace": ""}, "model"),  # a str namespace is the model name
    *[
        (f"chunk_tokens-{label}", {"chunk_tokens": value}, "chunk_tokens")
        for label, value in [
            ("zero", 0),
            ("negative", -8),
            ("float", 8.0),
            ("nan", NAN),
            ("str", "8"),
            ("huge", HUGE),
            ("misaligned", 6),
            ("smaller-than-a-block", 4),  # group 1's block holds 8 tokens
        ]
    ],
    *[
        (f"{arg}-{label}", {arg: value}, arg)
        for arg in ("max_regions_per_call", "max_concurrent_batches", "executor_threads")
        for label, value in [("zero", 0), ("negative", -1), ("float", 2.0), ("nan", NAN), ("huge", HUGE)]
    ],
    *[
        (f"pressure_backoff_s-{label}", {"pressure_backoff_s": value}, "pressure_backoff_s")
        for label, value in [("negative", -1.0), ("nan", NAN), ("str", "1"), ("bool", True), ("none", None)]
    ],
]


@pytest.mark.parametrize(("kwargs", "named"), [c[1:] for c in WORKER_CASES], ids=[c[0] for c in WORKER_CASES])
def test_bad_worker_arguments_raise_and_never_touch_the_backend(kwargs: dict[str, Any], named: str) -> None:
    cache = PagedCache.allocate(SPECS)
    backend = FaultInjectingBackend(MemoryBackend())
    args = {**worker_args(cache, backend), **kwargs}
    check_raises(lambda: KVWorker(args.pop("layouts"), args.pop("backend"), **args), named)
    assert backend.calls == []


# -- store / load / lookup ---------------------------------------------------------------------------


class Served:
    """A started worker on a recording backend, with a source cache (random) and a sentinel-filled
    destination cache of the same geometry."""

    def __init__(self) -> None:
        self.src = PagedCache.allocate(SPECS, seed=3)
        self.dst = PagedCache.allocate(SPECS, fill=SENTINEL)
        self.backend = FaultInjectingBackend(MemoryBackend(capacity_bytes=16 << 20))
        self.storer = KVWorker(**worker_args(self.src, self.backend))
        self.loader = KVWorker(**worker_args(self.dst, self.backend))
        self.serial = 0

    async def __aenter__(self) -> Served:
        await self.storer.start()
        await self.loader.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.storer.close()
        await self.loader.close()

    def good_ids(self, chunks: int) -> list[np.ndarray]:
        return [np.arange(chunks * CHUNK // g.block_size, dtype=np.int64) for g in self.src.groups]

    async def still_serving(self) -> None:
        """A fresh prompt stores, is found, and loads byte for byte."""
        self.serial += 1
        tokens = np.arange(2 * CHUNK, dtype=np.int64) + 10_000 * self.serial
        ids = self.good_ids(2)
        stored = await self.storer.store(tokens, ids)
        assert stored.failed == 0 and stored.stored + stored.skipped == 2
        assert await self.loader.lookup(tokens) == 2 * CHUNK
        loaded = await self.loader.load(tokens, ids)
        assert loaded.loaded_tokens == 2 * CHUNK
        for src, dst, group_ids in zip(self.src.groups, self.dst.groups, ids, strict=True):
            for a, b in zip(src.regions, dst.regions, strict=True):
                assert np.array_equal(a[group_ids], b[group_ids])
            dst.fill(SENTINEL)


async def expect_refused(submit: Callable[[], Any], named: str) -> None:
    """The call raises at once, or its future (or coroutine) fails; either way naming the argument."""
    try:
        pending = submit()
    except (ValueError, TypeError) as exc:
        assert named in str(exc), f"{exc!r} does not name {named!r}"
        return
    with pytest.raises((ValueError, TypeError)) as info:
        await pending
    assert named in str(info.value), f"{info.value!r} does not name {named!r}"


TOKENS = list(range(2 * CHUNK))
GOOD_IDS = [list(range(4)), list(range(2))]

REQUEST_CASES: list[tuple[str, Any, Any, dict[str, Any], str]] = [
    # (id, token_ids, block_ids, options, named)
    ("tokens-str", "abcdefghijklmnop", GOOD_IDS, {}, "token_ids"),
    ("tokens-bytes", b"abcdefghijklmnop", GOOD_IDS, {}, "token_ids"),
    ("tokens-int", 16, GOOD_IDS, {}, "token_ids"),
    ("tokens-none", None, GOOD_IDS, {}, "token_ids"),
    ("tokens-dict", dict.fromkeys(range(16), 0), GOOD_IDS, {}, "token_ids"),
    ("tokens-set", set(range(16)), GOOD_IDS, {}, "token_ids"),
    ("tokens-2d", np.zeros((2, 8), dtype=np.int64), GOOD_IDS, {}, "token_ids"),
    ("tokens-float-array", np.zeros(16), GOOD_IDS, {}, "token_ids"),
    ("tokens-float-list", [0.5] * 16, GOOD_IDS, {}, "token_ids"),
    ("tokens-nan", [*TOKENS[:15], NAN], GOOD_IDS, {}, "token_ids"),
    ("tokens-negative", [*TOKENS[:15], -1], GOOD_IDS, {}, "token_ids"),
    ("tokens-2**32", [2**32, *TOKENS[1:]], GOOD_IDS, {}, "token_ids"),
    ("tokens-huge", [*TOKENS[:15], HUGE], GOOD_IDS, {}, "token_ids"),
    ("tokens-mixed", [*TOKENS[:15], "15"], GOOD_IDS, {}, "token_ids"),
    ("tokens-hashed-other-chunking", HashedPrompt.from_tokens(TOKENS, 4), GOOD_IDS, {}, "HashedPrompt"),
    ("block_ids-none", TOKENS, None, {}, "block_ids"),
    ("block_ids-int", TOKENS, 3, {}, "block_ids"),
    ("block_ids-str", TOKENS, "0123", {}, "block_ids"),
    ("block_ids-flat", TOKENS, np.arange(4), {}, "block_ids"),
    ("block_ids-one-group", TOKENS, [list(range(4))], {}, "block_ids"),
    ("block_ids-three-groups", TOKENS, [*GOOD_IDS, [0]], {}, "block_ids"),
    ("block_ids-empty", TOKENS, [], {}, "block_ids"),
    ("block_ids-group-empty", TOKENS, [[], [0, 1]], {}, "block_ids[0]"),
    ("block_ids-too-short", TOKENS, [[0, 1, 2], [0, 1]], {}, "block_ids[0]"),
    ("block_ids-out-of-range", TOKENS, [[0, 1, 2, 16], [0, 1]], {}, "block_ids[0][3]"),
    ("block_ids-negative", TOKENS, [[0, 1, 2, 3], [-1, 1]], {}, "block_ids[1][0]"),
    ("block_ids-float", TOKENS, [[0, 1, 2, 3.0], [0, 1]], {}, "block_ids[0]"),
    ("block_ids-nan", TOKENS, [[0, 1, 2, 3], [0, NAN]], {}, "block_ids[1]"),
    ("block_ids-huge", TOKENS, [[0, 1, 2, HUGE], [0, 1]], {}, "block_ids[0]"),
    ("block_ids-scalar-group", TOKENS, [5, [0, 1]], {}, "block_ids[0]"),
    ("block_ids-str-group", TOKENS, ["0123", [0, 1]], {}, "block_ids[0]"),
    ("block_ids-nested", TOKENS, [[[0, 1], [2, 3]], [0, 1]], {}, "block_ids[0]"),
    *[
        (f"timeout-{label}", TOKENS, GOOD_IDS, {"timeout": value}, "timeout")
        for label, value in [
            ("zero", 0),
            ("negative", -1.0),
            ("nan", NAN),
            ("minus-inf", -INF),
            ("str", "1"),
            ("bool", True),
        ]
    ],
]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["store", "load"])
@pytest.mark.parametrize(
    ("tokens", "block_ids", "options", "named"),
    [c[1:] for c in REQUEST_CASES],
    ids=[c[0] for c in REQUEST_CASES],
)
async def test_bad_requests_are_refused_before_the_backend_and_the_worker_keeps_serving(
    kind: str, tokens: Any, block_ids: Any, options: dict[str, Any], named: str
) -> None:
    async with Served() as served:
        worker = served.storer if kind == "store" else served.loader
        await expect_refused(lambda: getattr(worker, kind)(tokens, block_ids, **options), named)
        assert served.backend.data_calls() == []
        await served.still_serving()


LOOKUP_CASES = [c for c in REQUEST_CASES if c[0].startswith("tokens-")]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("tokens", "named"), [(c[1], c[4]) for c in LOOKUP_CASES], ids=[c[0] for c in LOOKUP_CASES]
)
async def test_bad_lookups_are_refused_before_the_backend(tokens: Any, named: str) -> None:
    async with Served() as served:
        await expect_refused(lambda: served.loader.lookup(tokens), named)
        assert served.backend.data_calls() == []
        await served.still_serving()


@pytest.mark.asyncio
async def test_a_bad_request_in_a_batch_fails_alone() -> None:
    async with Served() as served:
        good_tokens = np.arange(2 * CHUNK, dtype=np.int64) + 777
        bad = served.storer.store([*TOKENS[:15], -5], GOOD_IDS)
        good = served.storer.store(good_tokens, served.good_ids(2))  # drained into the same batch
        with pytest.raises(InvalidRequestError, match="token_ids"):
            await bad
        assert (await good).stored == 2
        put = served.backend.sent_keys("put")
        good_hashes = chunk_hashes(good_tokens, CHUNK)
        assert len(put) == 4 and all(any(key.endswith(h) for h in good_hashes) for key in put)
        assert served.storer.stats()["requests_failed"] == {"store": 1}


@pytest.mark.asyncio
async def test_huge_and_infinite_timeouts_mean_no_deadline() -> None:
    async with Served() as served:
        for timeout in (INF, 1e300, HUGE):
            result = await served.storer.store(TOKENS, GOOD_IDS, timeout=timeout)
            assert result.failed == 0


# -- hypothesis-generated garbage ------------------------------------------------------------------


BAD_TOKEN = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=2**32),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.none(),
    st.binary(max_size=2),
)  # not bools: Python's True is the int 1, and NumPy reads [True, 0] as integers


@st.composite
def garbage_tokens(draw: st.DrawFn) -> Any:
    """Token ids that are wrong as a whole, or hold one wrong value inside their whole chunks."""
    whole = st.one_of(
        st.text(),
        st.binary(),
        st.integers(),
        st.floats(allow_nan=True),
        st.none(),
        st.dictionaries(st.integers(), st.integers(), max_size=4),
        st.frozensets(st.integers(), max_size=4),
        st.builds(lambda n: np.zeros(n, dtype=np.float32), st.integers(0, 32)),
        st.builds(lambda n: np.zeros((n, 2), dtype=np.int64), st.integers(1, 16)),
    )
    if draw(st.booleans()):
        return draw(whole)
    chunks = draw(st.integers(1, 2))  # GOOD_IDS cover two chunks
    tokens: list[Any] = draw(
        st.lists(st.integers(0, 2**32 - 1), min_size=chunks * CHUNK, max_size=chunks * CHUNK + CHUNK - 1)
    )
    tokens[draw(st.integers(0, chunks * CHUNK - 1))] = draw(BAD_TOKEN)
    return tokens


BAD_ID = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=16, max_value=HUGE),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=2),
    st.none(),
)


@st.composite
def garbage_block_ids(draw: st.DrawFn) -> Any:
    """Block ids for two whole chunks (4 + 2 ids) that are wrong in one way."""
    ids: list[list[Any]] = [list(range(4)), list(range(2))]
    how = draw(st.sampled_from(["whole", "groups", "short", "value"]))
    if how == "whole":
        return draw(st.one_of(st.none(), st.integers(), st.text(), st.floats(allow_nan=True)))
    if how == "groups":
        return draw(st.sampled_from([[], [ids[0]], [*ids, [0]], ids[0]]))
    group = draw(st.integers(0, 1))
    if how == "short":
        ids[group] = ids[group][: draw(st.integers(0, len(ids[group]) - 1))]
    else:
        ids[group][draw(st.integers(0, len(ids[group]) - 1))] = draw(BAD_ID)
    return ids


GARBAGE_TIMEOUT = st.one_of(
    st.floats(max_value=0.0),
    st.just(NAN),
    st.integers(max_value=0),
    st.text(max_size=3),
    st.booleans(),
    st.lists(st.floats(0.1, 1.0), max_size=2),
)


@pytest.mark.asyncio
@EXAMPLES
@given(tokens=garbage_tokens(), kind=st.sampled_from(["store", "load", "lookup"]))
async def test_garbage_token_ids(tokens: Any, kind: str) -> None:
    async with Served() as served:
        if kind == "lookup":
            await expect_refused(lambda: served.loader.lookup(tokens), "token_ids")
        else:
            worker = served.storer if kind == "store" else served.loader
            await expect_refused(lambda: getattr(worker, kind)(tokens, GOOD_IDS), "token_ids")
        assert served.backend.data_calls() == []
        await served.still_serving()


@pytest.mark.asyncio
@EXAMPLES
@given(block_ids=garbage_block_ids(), kind=st.sampled_from(["store", "load"]))
async def test_garbage_block_ids(block_ids: Any, kind: str) -> None:
    async with Served() as served:
        worker = served.storer if kind == "store" else served.loader
        await expect_refused(lambda: getattr(worker, kind)(TOKENS, block_ids), "block_ids")
        assert served.backend.data_calls() == []
        for dst in served.dst.groups:
            assert dst.written_blocks() == set()
        await served.still_serving()


@pytest.mark.asyncio
@EXAMPLES
@given(timeout=GARBAGE_TIMEOUT)
async def test_garbage_timeouts(timeout: Any) -> None:
    async with Served() as served:
        await expect_refused(lambda: served.storer.store(TOKENS, GOOD_IDS, timeout=timeout), "timeout")
        assert served.backend.data_calls() == []
        await served.still_serving()


@EXAMPLES
@given(
    chunks=st.lists(
        st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=6
    ),
    block_ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6),
)
def test_prepare_values_garbage_is_refused_or_stays_inside_the_cache(
    chunks: list[tuple[int, int]], block_ids: list[int]
) -> None:
    try:
        addrs, sizes, _ = LAYOUT.prepare_values(chunks, block_ids)
    except (ValueError, TypeError):
        return
    assert (addrs >= BASE).all() and (addrs + sizes <= BASE + 16 * 64).all()


@EXAMPLES
@given(
    base_addrs=st.one_of(
        st.lists(st.one_of(st.integers(), st.floats(allow_nan=True)), max_size=3), st.integers()
    ),
    block_lens=st.lists(st.integers(-(2**64), 2**64), max_size=3),
    block_size=st.one_of(st.integers(-(2**64), 2**64), st.floats(allow_nan=True), st.none()),
    num_blocks=st.one_of(st.integers(-(2**64), 2**64), st.floats(allow_nan=True), st.text(max_size=2)),
)
def test_layout_garbage_raises_only_value_or_type_errors(
    base_addrs: Any, block_lens: Any, block_size: Any, num_blocks: Any
) -> None:
    try:
        made = KVLayout(base_addrs, block_lens, block_size, num_blocks)
    except (ValueError, TypeError):
        return
    # Accepted: then every region ends inside the int64 address space.
    for addr, size in made.region_spans():
        assert addr > 0 and size > 0 and addr + size <= 2**63 - 1
