"""Fault injection for tests: a backend wrapper that fails, delays or hangs calls on cue, and records
every call it saw.

Like httpx's ``MockTransport``, this ships with aiokv so that aiokv's own tests and yours can drive a
:class:`~aiokv.KVWorker` through the failures a real store produces, without a real store::

    import threading

    from aiokv import KVWorker, MemoryBackend
    from aiokv.backends.base import NOT_FOUND, TRANSFER_FAILED
    from aiokv.testing import FaultInjectingBackend, FaultRule

    release = threading.Event()
    backend = FaultInjectingBackend(
        MemoryBackend(),
        rules=[
            FaultRule(op="put", per_key=True, probability=0.1, code=TRANSFER_FAILED),  # ~10% of keys
            FaultRule(op="get", keys=lambda key: key.endswith(bad_hash), code=NOT_FOUND),
            FaultRule(op="exists", times=1, exception=ConnectionError),  # the first exists raises
            FaultRule(op="put", hang=release),  # puts block until release.set() (30 s at most)
        ],
        seed=1,
    )
    async with KVWorker(layout, backend, namespace="model", chunk_tokens=256) as worker:
        ...
    written = backend.sent_keys("put")  # keys that reached the MemoryBackend's batch_put

How a rule applies to a call:

- ``op`` picks the calls: ``"exists"``, ``"put"``, ``"get"``, ``"register"`` or ``"*"`` (the three data
  calls). ``keys`` picks the keys it targets: ``None`` (all), a collection of keys, or a predicate. A
  call with no targeted key is left alone.
- The rule *fires* with ``probability``, at most ``times`` times (``None``: no limit). With
  ``per_key=False`` (the default) it draws once per call and fires for all the call's targeted keys;
  with ``per_key=True`` each targeted key draws on its own and ``times`` counts keys.
- When it fires: ``delay_s`` sleeps (``time.sleep``, which releases the GIL, as a native store does);
  ``hang`` waits on a :class:`threading.Event` until it is set or ``max_hang_s`` passes (then
  :class:`HangExpiredError` is raised, so a forgotten event fails a test instead of hanging it);
  ``exception`` is raised before the inner backend is called (nothing is stored or read); ``code`` is
  answered for the fired keys, which are *not* passed to the inner backend, so their bytes are never
  touched, while the other keys go through. On ``exists`` a fired key answers ``False``.
- Every rule is consulted for every call, in order: delays add up, the first exception wins, and a
  key gets the code of the first rule that fired on it.

Random draws come from one ``random.Random(seed)``, so a run is reproducible for a given order of
calls (with several executor threads that order can vary; use ``probability=1.0`` with ``keys`` or
``times`` where a test needs exact faults). Rules whose probability is 1 consume no randomness.

:class:`BlockingBackend` is the common special case: every call of one op blocks until ``release()``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends.base import Backend, Regions
from .errors import BackendError

logger = logging.getLogger("aiokv")

__all__ = [
    "BlockingBackend",
    "Call",
    "FaultInjectingBackend",
    "FaultRule",
    "HangExpiredError",
    "InjectedFault",
]

DATA_OPS = ("exists", "put", "get")
_RULE_OPS = frozenset({*DATA_OPS, "register", "*"})

KeySelector = Collection[str] | Callable[[str], bool] | None


class InjectedFault(BackendError):
    """The default exception of a rule that names an exception class without arguments."""


class HangExpiredError(TimeoutError):
    """A hang rule's event was not set within ``max_hang_s``: the test forgot to release it."""


@dataclass(frozen=True, eq=False, slots=True)
class FaultRule:
    """One fault: which calls and keys it targets, how often it fires, and what it does.

    Rules compare by identity, so two equal-looking rules keep separate ``times`` budgets.
    """

    op: str = "*"
    keys: KeySelector = None
    probability: float = 1.0
    code: int | None = None
    exception: BaseException | type[BaseException] | None = None
    delay_s: float = 0.0
    hang: threading.Event | None = None
    max_hang_s: float = 30.0
    times: int | None = None
    per_key: bool = False
    _match: Callable[[str], bool] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.op not in _RULE_OPS:
            raise ValueError(f"op must be one of {sorted(_RULE_OPS)}, got {self.op!r}")
        if isinstance(self.probability, bool) or not isinstance(self.probability, (int, float)):
            raise TypeError(f"probability must be a number, got {self.probability!r}")
        if not 0.0 <= self.probability <= 1.0:  # also refuses NaN
            raise ValueError(f"probability must be within [0, 1], got {self.probability!r}")
        if self.code is not None:
            if isinstance(self.code, bool) or not isinstance(self.code, int) or self.code >= 0:
                raise ValueError(f"code must be a negative int status code, got {self.code!r}")
            if self.op == "register":
                raise ValueError("register_buffer answers no code: use exception= for op='register'")
        if self.exception is not None and not (
            isinstance(self.exception, BaseException)
            or (isinstance(self.exception, type) and issubclass(self.exception, BaseException))
        ):
            raise TypeError(f"exception must be an exception instance or class, got {self.exception!r}")
        if self.code is not None and self.exception is not None:
            raise ValueError("give code or exception, not both")
        if (
            isinstance(self.delay_s, bool)
            or not isinstance(self.delay_s, (int, float))
            or not 0.0 <= self.delay_s < math.inf
        ):
            raise ValueError(f"delay_s must be a finite number >= 0, got {self.delay_s!r}")
        if self.hang is not None and not isinstance(self.hang, threading.Event):
            raise TypeError(f"hang must be a threading.Event, got {type(self.hang).__name__}")
        if (
            isinstance(self.max_hang_s, bool)
            or not isinstance(self.max_hang_s, (int, float))
            or not 0.0 < self.max_hang_s < math.inf
        ):
            raise ValueError(f"max_hang_s must be a finite number > 0, got {self.max_hang_s!r}")
        if self.times is not None and (
            isinstance(self.times, bool) or not isinstance(self.times, int) or self.times < 0
        ):
            raise ValueError(f"times must be None or an int >= 0, got {self.times!r}")
        if self.code is None and self.exception is None and not self.delay_s and self.hang is None:
            raise ValueError("a FaultRule needs at least one of code, exception, delay_s or hang")
        object.__setattr__(self, "_match", _key_matcher(self.keys, self.op))

    def applies_to(self, op: str) -> bool:
        return self.op == op or (self.op == "*" and op in DATA_OPS)

    def targets(self, key: str) -> bool:
        return self._match is None or self._match(key)

    def make_exception(self, op: str) -> BaseException:
        exc = self.exception
        if isinstance(exc, BaseException):
            return exc
        if exc is None or exc is InjectedFault:
            return InjectedFault(f"injected fault in {op}")
        return exc(f"injected fault in {op}")


def _key_matcher(keys: KeySelector, op: str) -> Callable[[str], bool] | None:
    if keys is None:
        return None
    if op == "register":
        raise ValueError("op='register' has no keys: leave keys=None")
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a collection of keys or a predicate, not a single string")
    if callable(keys):
        return keys
    if isinstance(keys, Collection):
        wanted = frozenset(keys)
        return wanted.__contains__
    raise TypeError(f"keys must be None, a collection of keys or a predicate, got {type(keys).__name__}")


@dataclass(frozen=True, slots=True)
class Call:
    """One call the wrapper saw, recorded when it returned or raised.

    ``keys``, ``region_counts`` and ``nbytes`` describe the call as made (per key: regions and total
    bytes); ``sent`` the keys passed on to the inner backend (none when an injected exception came
    first); ``faulted`` the keys answered by an injected code; ``result`` what the caller got (1/0
    for ``exists``; ``None`` when the call raised, and for ``register``); ``error`` what it raised.
    """

    op: str
    keys: tuple[str, ...]
    region_counts: tuple[int, ...]
    nbytes: tuple[int, ...]
    sent: tuple[str, ...] = ()
    faulted: tuple[str, ...] = ()
    result: tuple[int, ...] | None = None
    error: BaseException | None = None
    thread: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)


@dataclass(slots=True)
class _Plan:
    delay_s: float = 0.0
    hangs: list[tuple[threading.Event, float]] = field(default_factory=list)
    exception: BaseException | None = None
    codes: dict[int, int] = field(default_factory=dict)  # key index -> injected code


class FaultInjectingBackend:
    """Wraps ``inner`` (any :class:`~aiokv.Backend`), injecting ``rules`` and recording every call.

    Thread-safe: the worker calls it from several executor threads at once.
    """

    def __init__(self, inner: Backend, *, rules: Iterable[FaultRule] = (), seed: int | None = 0) -> None:
        for name in ("register_buffer", "batch_exists", "batch_put", "batch_get", "close"):
            if not callable(getattr(inner, name, None)):
                raise TypeError(f"inner backend {type(inner).__name__} has no {name}() method")
        self.inner = inner
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._rng = random.Random(seed)
        self._rules: list[FaultRule] = []
        self._fired: dict[int, int] = {}
        self._calls: list[Call] = []
        self._hanging = 0
        self._in_flight = 0
        for rule in rules:
            self.add_rule(rule)

    # -- rules ----------------------------------------------------------------------------------

    def add_rule(self, rule: FaultRule) -> FaultRule:
        if not isinstance(rule, FaultRule):
            raise TypeError(f"rules must be FaultRule objects, got {type(rule).__name__}")
        with self._lock:
            self._rules.append(rule)
            self._fired.setdefault(id(rule), 0)
        return rule

    def remove_rule(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules = [r for r in self._rules if r is not rule]

    def clear_rules(self) -> None:
        with self._lock:
            self._rules = []

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        with self._lock:
            return tuple(self._rules)

    def fired(self, rule: FaultRule) -> int:
        """How often ``rule`` fired (calls, or keys for a ``per_key`` rule)."""
        with self._lock:
            return self._fired.get(id(rule), 0)

    # -- records --------------------------------------------------------------------------------

    @property
    def calls(self) -> list[Call]:
        """A copy of every call recorded so far, in the order they returned."""
        with self._lock:
            return list(self._calls)

    def calls_of(self, *ops: str) -> list[Call]:
        with self._lock:
            return [c for c in self._calls if c.op in ops]

    def sent_keys(self, op: str) -> list[str]:
        """Keys passed on to the inner backend by every ``op`` call, in order (repeats kept)."""
        return [key for call in self.calls_of(op) for key in call.sent]

    def data_calls(self) -> list[Call]:
        """Calls of ``batch_exists``, ``batch_put`` and ``batch_get``."""
        return self.calls_of(*DATA_OPS)

    def clear_calls(self) -> None:
        with self._lock:
            self._calls.clear()

    @property
    def hanging(self) -> int:
        """Calls now waiting on a hang event."""
        with self._lock:
            return self._hanging

    @property
    def in_flight(self) -> int:
        """Calls now inside this wrapper (delayed, hanging or in the inner backend)."""
        with self._lock:
            return self._in_flight

    def wait_hanging(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Block until at least ``count`` calls hang; False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._hanging >= count, timeout)

    async def wait_hanging_async(self, count: int = 1, timeout: float = 10.0) -> None:
        """:meth:`wait_hanging` for a coroutine (the loop keeps running); raises ``TimeoutError``."""
        if not await asyncio.to_thread(self.wait_hanging, count, timeout):
            raise TimeoutError(f"fewer than {count} backend calls hung within {timeout} s")

    # -- the protocol ---------------------------------------------------------------------------

    def register_buffer(self, addr: int, size: int) -> None:
        counts, nbytes = (1,), (size if isinstance(size, int) else -1,)
        plan = self._draw("register", None)
        with self._entered():
            try:
                self._delay_and_hang(plan, "register")
                if plan.exception is not None:
                    raise plan.exception
                self.inner.register_buffer(addr, size)
            except BaseException as exc:
                self._record(Call("register", (), counts, nbytes, error=exc, thread=_thread()))
                raise
        self._record(Call("register", (), counts, nbytes, thread=_thread()))

    def unregister_buffer(self, addr: int) -> None:
        unregister = getattr(self.inner, "unregister_buffer", None)
        if callable(unregister):
            unregister(addr)
        self._record(Call("unregister", (), (), (), thread=_thread()))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        answer = self._data_call("exists", keys, None, None)
        return [bool(v) for v in answer]

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._data_call("put", keys, addrs, sizes)

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._data_call("get", keys, addrs, sizes)

    def close(self) -> None:
        self._record(Call("close", (), (), (), thread=_thread()))
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Extras of the inner backend (MemoryBackend.batch_remove, used_bytes, ...) pass through,
        # unrecorded and without faults.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return True  # not ``len() > 0``: an empty store is still a backend

    # -- internals ------------------------------------------------------------------------------

    def _data_call(self, op: str, keys: Sequence[str], addrs: Regions | None, sizes: Regions | None) -> Any:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            # Not a list of keys: no rule can target it; the inner backend refuses it.
            return self._passthrough(op, keys, addrs, sizes)
        key_list = list(keys)
        counts, nbytes = _region_stats(sizes)
        plan = self._draw(op, key_list)
        faulted = tuple(key_list[i] for i in sorted(plan.codes))
        with self._entered():
            try:
                self._delay_and_hang(plan, op)
                if plan.exception is not None:
                    raise plan.exception
            except BaseException as exc:
                self._record(Call(op, tuple(key_list), counts, nbytes, error=exc, thread=_thread()))
                raise
            sent_index = [i for i in range(len(key_list)) if i not in plan.codes]
            sent = tuple(key_list[i] for i in sent_index)
            try:
                answer = self._call_inner(op, key_list, addrs, sizes, sent_index)
            except BaseException as exc:
                self._record(
                    Call(op, tuple(key_list), counts, nbytes, sent, faulted, error=exc, thread=_thread())
                )
                raise
        merged: list[Any] = [None] * len(key_list)
        for i, code in plan.codes.items():
            merged[i] = False if op == "exists" else code
        for i, value in zip(sent_index, answer, strict=True):
            merged[i] = value
        result = tuple(int(v) for v in merged)
        self._record(Call(op, tuple(key_list), counts, nbytes, sent, faulted, result, thread=_thread()))
        return merged

    def _call_inner(
        self,
        op: str,
        keys: list[str],
        addrs: Regions | None,
        sizes: Regions | None,
        sent_index: list[int],
    ) -> list[Any]:
        if not sent_index:
            return []
        everything = len(sent_index) == len(keys)
        sub_keys = keys if everything else [keys[i] for i in sent_index]
        if op == "exists":
            answer = list(self.inner.batch_exists(sub_keys))
        else:
            if not everything:
                addrs, sizes = _select(addrs, sent_index), _select(sizes, sent_index)
            call = self.inner.batch_put if op == "put" else self.inner.batch_get
            answer = list(call(sub_keys, addrs, sizes))  # type: ignore[arg-type]
        if len(answer) != len(sub_keys):
            raise BackendError(f"the inner batch_{op} answered {len(answer)} values for {len(sub_keys)} keys")
        return answer

    def _passthrough(self, op: str, keys: Any, addrs: Any, sizes: Any) -> Any:
        with self._entered():
            try:
                if op == "exists":
                    answer = list(self.inner.batch_exists(keys))
                elif op == "put":
                    answer = list(self.inner.batch_put(keys, addrs, sizes))
                else:
                    answer = list(self.inner.batch_get(keys, addrs, sizes))
            except BaseException as exc:
                self._record(Call(op, (), (), (), error=exc, thread=_thread()))
                raise
        self._record(Call(op, (), (), (), result=tuple(int(v) for v in answer), thread=_thread()))
        return answer

    def _draw(self, op: str, keys: list[str] | None) -> _Plan:
        """Decide, under the lock, which rules fire for this call and on which keys."""
        plan = _Plan()
        with self._lock:
            for rule in self._rules:
                if not rule.applies_to(op):
                    continue
                budget = self._budget(rule)
                if budget == 0:
                    continue
                if keys is None:
                    targeted: list[int] = []
                elif rule._match is None:
                    targeted = list(range(len(keys)))
                else:
                    targeted = [i for i, key in enumerate(keys) if rule._match(key)]
                if keys is not None and not targeted:
                    continue
                if rule.per_key and keys is not None:
                    fired = []
                    for i in targeted:
                        if budget == 0:
                            break
                        if self._chance(rule):
                            fired.append(i)
                            budget -= 1
                    self._fired[id(rule)] += len(fired)
                    if not fired:
                        continue
                else:
                    if not self._chance(rule):
                        continue
                    self._fired[id(rule)] += 1
                    fired = targeted
                plan.delay_s += rule.delay_s
                if rule.hang is not None:
                    plan.hangs.append((rule.hang, rule.max_hang_s))
                if rule.exception is not None and plan.exception is None:
                    plan.exception = rule.make_exception(f"batch_{op}" if op in DATA_OPS else op)
                if rule.code is not None:
                    for i in fired:
                        plan.codes.setdefault(i, rule.code)
        return plan

    def _budget(self, rule: FaultRule) -> int:
        if rule.times is None:
            return -1  # unlimited: never reaches 0 by decrementing
        return max(0, rule.times - self._fired[id(rule)])

    def _chance(self, rule: FaultRule) -> bool:
        return rule.probability >= 1.0 or self._rng.random() < rule.probability

    def _delay_and_hang(self, plan: _Plan, op: str) -> None:
        if plan.delay_s:
            time.sleep(plan.delay_s)
        for event, max_wait in plan.hangs:
            with self._changed:
                self._hanging += 1
                self._changed.notify_all()
            try:
                released = event.wait(max_wait)
            finally:
                with self._changed:
                    self._hanging -= 1
                    self._changed.notify_all()
            if not released:
                logger.error("aiokv.testing: a hung %s was never released (%.1f s)", op, max_wait)
                raise HangExpiredError(f"{op} hung for {max_wait} s and was never released")

    def _entered(self) -> _InFlight:
        return _InFlight(self)

    def _record(self, call: Call) -> None:
        with self._lock:
            self._calls.append(call)


class _InFlight:
    __slots__ = ("_backend",)

    def __init__(self, backend: FaultInjectingBackend) -> None:
        self._backend = backend

    def __enter__(self) -> None:
        with self._backend._lock:
            self._backend._in_flight += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._backend._lock:
            self._backend._in_flight -= 1


class BlockingBackend(FaultInjectingBackend):
    """Every call of ``op`` blocks until :meth:`release` (or ``max_wait_s``), recording like its base.

    Starts blocked unless ``blocked=False``; :meth:`block` closes the gate again for later calls.
    """

    def __init__(
        self, inner: Backend, *, op: str = "*", blocked: bool = True, max_wait_s: float = 30.0
    ) -> None:
        self.gate = threading.Event()
        if not blocked:
            self.gate.set()
        super().__init__(inner, rules=[FaultRule(op=op, hang=self.gate, max_hang_s=max_wait_s)])

    def release(self) -> None:
        self.gate.set()

    def block(self) -> None:
        self.gate.clear()


def _thread() -> str:
    return threading.current_thread().name


def _region_stats(sizes: Regions | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per key: number of regions and total bytes (empty when the arguments are malformed)."""
    if sizes is None:
        return (), ()
    try:
        if isinstance(sizes, np.ndarray) and sizes.ndim == 2:
            totals = sizes.sum(axis=1, dtype=np.int64).tolist()
            return (int(sizes.shape[1]),) * int(sizes.shape[0]), tuple(int(t) for t in totals)
        return tuple(len(row) for row in sizes), tuple(int(sum(row)) for row in sizes)
    except (TypeError, ValueError, OverflowError):
        return (), ()


def _select(regions: Regions | None, index: list[int]) -> Any:
    if isinstance(regions, np.ndarray):
        return regions[np.asarray(index, dtype=np.int64)]
    if regions is None:
        return None
    return [regions[i] for i in index]
