"""aiokv.testing: the fault-injecting backend wrapper itself, against a real MemoryBackend."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from aiokv import Backend, BackendError, BackendUnavailableError, Code, MemoryBackend
from aiokv.testing import (
    BlockingBackend,
    Call,
    FaultInjectingBackend,
    FaultRule,
    HangExpiredError,
    InjectedFault,
)

KEY_BYTES = 64


class Buffers:
    """A random source buffer and a sentinel-filled destination, both registered; key ``i`` uses
    two 32-byte regions at ``i * 64`` of each."""

    SENTINEL = 0xAB

    def __init__(self, backend: Backend, keys: int = 8) -> None:
        rng = np.random.default_rng(7)
        self.src = rng.integers(0, 256, size=keys * KEY_BYTES, dtype=np.uint8)
        self.dst = np.full(keys * KEY_BYTES, self.SENTINEL, dtype=np.uint8)
        backend.register_buffer(self.src.ctypes.data, self.src.nbytes)
        backend.register_buffer(self.dst.ctypes.data, self.dst.nbytes)

    @staticmethod
    def regions(base: int, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        starts = np.asarray(indices, dtype=np.int64) * KEY_BYTES + base
        addrs = np.stack([starts, starts + KEY_BYTES // 2], axis=1)
        return addrs, np.full_like(addrs, KEY_BYTES // 2)

    def put(self, backend: Backend, keys: list[str], indices: list[int]) -> list[int]:
        addrs, sizes = self.regions(self.src.ctypes.data, indices)
        return backend.batch_put(keys, addrs, sizes)

    def get(self, backend: Backend, keys: list[str], indices: list[int]) -> list[int]:
        addrs, sizes = self.regions(self.dst.ctypes.data, indices)
        return backend.batch_get(keys, addrs, sizes)

    def src_of(self, i: int) -> np.ndarray:
        return self.src[i * KEY_BYTES : (i + 1) * KEY_BYTES]

    def dst_of(self, i: int) -> np.ndarray:
        return self.dst[i * KEY_BYTES : (i + 1) * KEY_BYTES]


@pytest.fixture
def inner() -> Iterator[MemoryBackend]:
    backend = MemoryBackend(capacity_bytes=1 << 20)
    yield backend
    backend.close()


KEYS = [f"k{i}" for i in range(8)]


def test_without_rules_it_passes_through_and_records(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(inner)
    assert isinstance(backend, Backend)
    bufs = Buffers(backend)
    assert backend.batch_exists(KEYS[:3]) == [False, False, False]
    assert bufs.put(backend, KEYS[:3], [0, 1, 2]) == [0, 0, 0]
    assert bufs.get(backend, KEYS[:3], [0, 1, 2]) == [KEY_BYTES] * 3
    for i in range(3):
        assert np.array_equal(bufs.dst_of(i), bufs.src_of(i))
    assert (bufs.dst[3 * KEY_BYTES :] == Buffers.SENTINEL).all()
    assert [c.op for c in backend.calls] == ["register", "register", "exists", "put", "get"]
    put = backend.calls_of("put")[0]
    assert put == Call(
        "put",
        keys=tuple(KEYS[:3]),
        region_counts=(2, 2, 2),
        nbytes=(64, 64, 64),
        sent=tuple(KEYS[:3]),
        faulted=(),
        result=(0, 0, 0),
        error=None,
        thread=threading.current_thread().name,
    )
    assert put.total_bytes == 192
    assert backend.calls_of("register")[0].nbytes == (bufs.src.nbytes,)
    assert backend.calls_of("get")[0].result == (64, 64, 64)
    assert backend.sent_keys("put") == KEYS[:3]
    assert len(backend.data_calls()) == 3
    # Extras of the inner backend pass through, unrecorded.
    assert len(backend) == 3
    assert backend.batch_remove(["k0"]) == [0]
    assert len(backend.calls) == 5
    backend.clear_calls()
    assert backend.calls == []


def test_list_regions_are_recorded_and_split(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(
        inner, rules=[FaultRule(op="put", keys={"k1"}, code=Code.TRANSFER_FAILED)]
    )
    bufs = Buffers(backend)
    addrs, sizes = bufs.regions(bufs.src.ctypes.data, [0, 1, 2])
    codes = backend.batch_put(KEYS[:3], addrs.tolist(), sizes.tolist())
    assert codes == [0, Code.TRANSFER_FAILED, 0]
    call = backend.calls_of("put")[0]
    assert call.region_counts == (2, 2, 2) and call.nbytes == (64, 64, 64)
    assert call.sent == ("k0", "k2") and call.faulted == ("k1",)
    assert inner.batch_exists(KEYS[:3]) == [True, False, True]


def test_per_key_put_code_skips_only_the_faulted_keys(inner: MemoryBackend) -> None:
    rule = FaultRule(op="put", keys={"k1", "k3"}, code=Code.NO_SPACE)
    backend = FaultInjectingBackend(inner, rules=[rule])
    bufs = Buffers(backend)
    assert bufs.put(backend, KEYS[:5], [0, 1, 2, 3, 4]) == [0, Code.NO_SPACE, 0, Code.NO_SPACE, 0]
    # The faulted keys never reached the store; the others hold their exact bytes.
    assert inner.batch_exists(KEYS[:5]) == [True, False, True, False, True]
    assert inner.used_bytes == 3 * KEY_BYTES
    backend.clear_rules()
    assert bufs.get(backend, ["k0", "k2", "k4"], [0, 2, 4]) == [KEY_BYTES] * 3
    for i in (0, 2, 4):
        assert np.array_equal(bufs.dst_of(i), bufs.src_of(i))
    assert backend.fired(rule) == 1
    assert backend.calls_of("put")[0].faulted == ("k1", "k3")


def test_per_key_get_code_leaves_the_faulted_keys_bytes_untouched(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(inner)
    bufs = Buffers(backend)
    assert bufs.put(backend, KEYS[:4], [0, 1, 2, 3]) == [0] * 4
    backend.add_rule(FaultRule(op="get", keys=lambda key: key in ("k0", "k2"), code=Code.NOT_FOUND))
    assert bufs.get(backend, KEYS[:4], [0, 1, 2, 3]) == [Code.NOT_FOUND, KEY_BYTES, Code.NOT_FOUND, KEY_BYTES]
    assert (bufs.dst_of(0) == Buffers.SENTINEL).all()
    assert (bufs.dst_of(2) == Buffers.SENTINEL).all()
    assert np.array_equal(bufs.dst_of(1), bufs.src_of(1))
    assert np.array_equal(bufs.dst_of(3), bufs.src_of(3))
    assert backend.calls_of("get")[0].sent == ("k1", "k3")


def test_all_keys_faulted_means_no_inner_call(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(inner, rules=[FaultRule(op="*", code=Code.UNAVAILABLE)])
    bufs = Buffers(backend)
    assert bufs.put(backend, KEYS[:2], [0, 1]) == [Code.UNAVAILABLE, Code.UNAVAILABLE]
    assert backend.batch_exists(KEYS[:2]) == [False, False]
    assert len(inner) == 0
    assert backend.sent_keys("put") == [] and backend.sent_keys("exists") == []


def test_exists_code_answers_absent(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(inner)
    bufs = Buffers(backend)
    bufs.put(backend, KEYS[:3], [0, 1, 2])
    backend.add_rule(FaultRule(op="exists", keys={"k1"}, code=Code.NOT_FOUND))
    assert backend.batch_exists(KEYS[:4]) == [True, False, True, False]


@pytest.mark.parametrize(
    "exception", [RuntimeError, BackendUnavailableError("master gone", code=Code.UNAVAILABLE), InjectedFault]
)
def test_exception_before_the_call_touches_nothing(
    inner: MemoryBackend, exception: BaseException | type[BaseException]
) -> None:
    rule = FaultRule(op="put", exception=exception, times=1)
    backend = FaultInjectingBackend(inner, rules=[rule])
    bufs = Buffers(backend)
    expected = exception if isinstance(exception, type) else type(exception)
    with pytest.raises(expected):
        bufs.put(backend, KEYS[:2], [0, 1])
    assert len(inner) == 0
    failed = backend.calls_of("put")[0]
    assert isinstance(failed.error, expected) and failed.result is None and failed.sent == ()
    # times=1: the next put goes through.
    assert bufs.put(backend, KEYS[:2], [0, 1]) == [0, 0]
    assert len(inner) == 2
    assert backend.fired(rule) == 1


def test_inner_errors_are_recorded_and_reraised(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(inner)
    Buffers(backend)
    inner.close()
    with pytest.raises(BackendError):
        backend.batch_exists(["k0"])
    call = backend.calls_of("exists")[0]
    assert isinstance(call.error, BackendError) and call.sent == ("k0",)


def test_inner_answering_the_wrong_length_is_an_error() -> None:
    class Short(MemoryBackend):
        def batch_exists(self, keys: object) -> list[bool]:
            return [True]

    backend = FaultInjectingBackend(Short(), rules=[FaultRule(op="exists", keys={"a"}, code=Code.NOT_FOUND)])
    with pytest.raises(BackendError, match="answered 1 values for 2 keys"):
        backend.batch_exists(["a", "b", "c"])


def test_register_rule_refuses_the_buffer(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(inner, rules=[FaultRule(op="register", exception=OSError, times=1)])
    data = np.zeros(KEY_BYTES, dtype=np.uint8)
    with pytest.raises(OSError, match="injected"):
        backend.register_buffer(data.ctypes.data, data.nbytes)
    # Not registered with the inner store: a put from it is refused there.
    sizes = np.array([[KEY_BYTES]], dtype=np.int64)
    assert backend.batch_put(["x"], np.array([[data.ctypes.data]]), sizes) == [Code.INVALID]
    backend.register_buffer(data.ctypes.data, data.nbytes)
    assert backend.batch_put(["x"], np.array([[data.ctypes.data]]), sizes) == [0]
    assert [c.error is None for c in backend.calls_of("register")] == [False, True]


def test_probability_is_deterministic_with_a_seed(inner: MemoryBackend) -> None:
    keys = [f"key{i}" for i in range(400)]

    def faulted(seed: int) -> tuple[str, ...]:
        rule = FaultRule(op="exists", per_key=True, probability=0.25, code=Code.NOT_FOUND)
        backend = FaultInjectingBackend(inner, rules=[rule], seed=seed)
        answer = backend.batch_exists(keys)
        call = backend.calls_of("exists")[0]
        assert set(call.sent) | set(call.faulted) == set(keys)
        assert not set(call.sent) & set(call.faulted)
        assert answer == [False] * len(keys)
        assert backend.fired(rule) == len(call.faulted)
        return call.faulted

    first, again, other = faulted(3), faulted(3), faulted(4)
    assert first == again
    assert first != other
    assert 50 < len(first) < 150  # ~100 expected; 400 draws make this certain for a fixed seed


def test_probability_zero_never_fires_and_one_always_does(inner: MemoryBackend) -> None:
    never = FaultRule(op="exists", probability=0.0, code=Code.NOT_FOUND)
    always = FaultRule(op="exists", keys={"b"}, code=Code.NOT_FOUND)
    backend = FaultInjectingBackend(inner, rules=[never, always])
    inner_keys = ["a", "b"]
    Buffers(backend)
    for _ in range(20):
        backend.batch_exists(inner_keys)
    assert backend.fired(never) == 0
    assert backend.fired(always) == 20
    assert all(c.faulted == ("b",) for c in backend.calls_of("exists"))


def test_times_counts_calls_or_keys(inner: MemoryBackend) -> None:
    per_call = FaultRule(op="exists", times=2, code=Code.NOT_FOUND)
    backend = FaultInjectingBackend(inner, rules=[per_call])
    for _ in range(4):
        backend.batch_exists(["a", "b", "c"])
    assert [len(c.faulted) for c in backend.calls_of("exists")] == [3, 3, 0, 0]

    per_key = FaultRule(op="exists", per_key=True, times=4, code=Code.NOT_FOUND)
    backend = FaultInjectingBackend(inner, rules=[per_key])
    for _ in range(3):
        backend.batch_exists(["a", "b", "c"])
    assert [len(c.faulted) for c in backend.calls_of("exists")] == [3, 1, 0]
    assert backend.fired(per_key) == 4


def test_first_rule_wins_a_key_and_delays_add_up(
    inner: MemoryBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("aiokv.testing.faults.time.sleep", slept.append)
    backend = FaultInjectingBackend(
        inner,
        rules=[
            FaultRule(op="put", keys={"k0"}, code=Code.TRANSFER_FAILED, delay_s=0.25),
            FaultRule(op="put", code=Code.NO_SPACE),
            FaultRule(op="get", delay_s=0.5),
        ],
    )
    bufs = Buffers(backend)
    assert bufs.put(backend, KEYS[:2], [0, 1]) == [Code.TRANSFER_FAILED, Code.NO_SPACE]
    assert slept == [0.25]
    assert bufs.get(backend, KEYS[:1], [0]) == [Code.NOT_FOUND]
    assert slept == [0.25, 0.5]


def test_a_delayed_call_holds_no_lock(inner: MemoryBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one call sits in its delay, another thread's call goes through the wrapper."""
    entered, proceed = threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:
        entered.set()
        proceed.wait(10)

    monkeypatch.setattr("aiokv.testing.faults.time.sleep", sleep)
    backend = FaultInjectingBackend(inner, rules=[FaultRule(op="exists", keys={"slow"}, delay_s=0.2)])
    slow_answer: list[list[bool]] = []
    slow = threading.Thread(target=lambda: slow_answer.append(backend.batch_exists(["slow"])))
    slow.start()
    assert entered.wait(10)
    fast_answer: list[list[bool]] = []
    fast = threading.Thread(target=lambda: fast_answer.append(backend.batch_exists(["fast"])))
    fast.start()
    fast.join(10)
    assert fast_answer == [[False]] and slow_answer == [] and backend.in_flight == 1
    proceed.set()
    slow.join(10)
    assert slow_answer == [[False]]
    assert [c.keys for c in backend.calls_of("exists")] == [("fast",), ("slow",)]


def test_hang_blocks_until_released(inner: MemoryBackend) -> None:
    release = threading.Event()
    backend = FaultInjectingBackend(inner, rules=[FaultRule(op="put", hang=release)])
    bufs = Buffers(backend)
    answer: list[list[int]] = []
    thread = threading.Thread(target=lambda: answer.append(bufs.put(backend, KEYS[:2], [0, 1])))
    thread.start()
    assert backend.wait_hanging(1, timeout=10)
    assert backend.hanging == 1 and backend.in_flight == 1
    assert answer == [] and len(inner) == 0 and backend.calls_of("put") == []
    release.set()
    thread.join(10)
    assert answer == [[0, 0]]
    assert backend.hanging == 0 and backend.in_flight == 0
    assert len(inner) == 2


def test_a_forgotten_hang_expires() -> None:
    backend = FaultInjectingBackend(
        MemoryBackend(), rules=[FaultRule(op="exists", hang=threading.Event(), max_hang_s=0.01)]
    )
    with pytest.raises(HangExpiredError):
        backend.batch_exists(["a"])
    assert isinstance(backend.calls_of("exists")[0].error, HangExpiredError)
    assert backend.hanging == 0


def test_wait_hanging_times_out_when_nothing_hangs(inner: MemoryBackend) -> None:
    assert FaultInjectingBackend(inner).wait_hanging(1, timeout=0.01) is False


def test_blocking_backend(inner: MemoryBackend) -> None:
    backend = BlockingBackend(inner, op="get")
    bufs = Buffers(backend)
    assert bufs.put(backend, KEYS[:1], [0]) == [0]  # only gets block
    answer: list[list[int]] = []
    thread = threading.Thread(target=lambda: answer.append(bufs.get(backend, KEYS[:1], [0])))
    thread.start()
    assert backend.wait_hanging(1, timeout=10)
    assert answer == [] and (bufs.dst_of(0) == Buffers.SENTINEL).all()
    backend.release()
    thread.join(10)
    assert answer == [[KEY_BYTES]]
    assert np.array_equal(bufs.dst_of(0), bufs.src_of(0))
    unblocked = BlockingBackend(inner, op="exists", blocked=False)
    assert unblocked.batch_exists(["k0", "zz"]) == [True, False]
    unblocked.block()
    assert not unblocked.gate.is_set()


def test_calls_are_recorded_from_many_threads(inner: MemoryBackend) -> None:
    backend = FaultInjectingBackend(
        inner, rules=[FaultRule(op="exists", per_key=True, probability=0.5, code=-1)]
    )
    threads = [
        threading.Thread(target=lambda t=t: [backend.batch_exists([f"t{t}-{i}"]) for i in range(100)])
        for t in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    calls = backend.calls_of("exists")
    assert len(calls) == 800
    assert sorted(c.keys[0] for c in calls) == sorted(f"t{t}-{i}" for t in range(8) for i in range(100))
    assert sum(len(c.faulted) for c in calls) == backend.fired(backend.rules[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"op": "write", "code": -1}, ValueError, "op"),
        ({"probability": float("nan"), "code": -1}, ValueError, "probability"),
        ({"probability": 1.5, "code": -1}, ValueError, "probability"),
        ({"probability": "1", "code": -1}, TypeError, "probability"),
        ({"code": 5}, ValueError, "code"),
        ({"code": True}, ValueError, "code"),
        ({"op": "register", "code": -1}, ValueError, "code"),
        ({"code": -1, "exception": RuntimeError}, ValueError, "code or exception"),
        ({"exception": "boom"}, TypeError, "exception"),
        ({"delay_s": -1}, ValueError, "delay_s"),
        ({"delay_s": float("inf")}, ValueError, "delay_s"),
        ({"hang": True}, TypeError, "hang"),
        ({"hang": threading.Event(), "max_hang_s": 0}, ValueError, "max_hang_s"),
        ({"code": -1, "times": -1}, ValueError, "times"),
        ({"code": -1, "keys": "k0"}, TypeError, "keys"),
        ({"code": -1, "keys": 3}, TypeError, "keys"),
        ({"op": "register", "exception": OSError, "keys": {"a"}}, ValueError, "keys"),
        ({}, ValueError, "at least one"),
    ],
)
def test_rule_validation(kwargs: dict[str, object], error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        FaultRule(**kwargs)  # type: ignore[arg-type]


def test_backend_validation(inner: MemoryBackend) -> None:
    with pytest.raises(TypeError, match="has no register_buffer"):
        FaultInjectingBackend(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FaultRule"):
        FaultInjectingBackend(inner, rules=[{"op": "put"}])  # type: ignore[list-item]
