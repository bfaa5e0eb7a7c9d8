"""The fault-injecting backend wrapper: applies :class:`~aiokv.testing.FaultRule`\\ s, lets a test hold
and release calls and see them enter, and records every call (see :mod:`aiokv.testing`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..backends.base import Backend, Regions, check_backend
from ..errors import BackendError
from .records import Call, region_copy, region_stats, thread_name
from .rulebook import CallFaults, RuleBook
from .rules import DATA_OPS, FaultRule, HangExpiredError

logger = logging.getLogger("aiokv.testing")

__all__ = ["OPS", "FaultInjectingBackend"]

OPS = ("register", "unregister", "exists", "put", "get", "close")
"""The op names of every call the wrapper records (``batch_put`` is ``"put"``, and so on)."""


class FaultInjectingBackend:
    """Wraps ``inner`` (any :class:`~aiokv.Backend`), injecting ``rules`` and recording every call.

    Besides rules, a test can :meth:`block` an op (its calls wait, once entered, until :meth:`release`),
    wait for a call to start (:meth:`entered`, :meth:`count`) and make calls :meth:`fail`.

    Thread-safe: the worker calls it from several executor threads at once.
    """

    # Whatever the inner backend says: a rule may delay or hang any call, so every call goes to a thread.
    exists_in_process = False

    def __init__(self, inner: Backend, *, rules: Iterable[FaultRule] = (), seed: int | None = 0) -> None:
        check_backend(inner)
        self.inner = inner
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._rulebook = RuleBook(seed)
        self._calls: list[Call] = []
        self._started: Counter[str] = Counter()
        self._entered = {op: threading.Event() for op in OPS}
        self._gates: dict[str, tuple[threading.Event, FaultRule]] = {}
        self._hanging = 0
        self._in_flight = 0
        for rule in rules:
            self.add_rule(rule)

    # -- rules ----------------------------------------------------------------------------------

    def add_rule(self, rule: FaultRule) -> FaultRule:
        return self._rulebook.add(rule)

    def remove_rule(self, rule: FaultRule) -> None:
        self._rulebook.remove(rule)

    def clear_rules(self) -> None:
        self._rulebook.clear()

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        return self._rulebook.rules

    def fired(self, rule: FaultRule) -> int:
        """How often ``rule`` fired (calls, or keys for a ``per_key`` rule)."""
        return self._rulebook.fired(rule)

    def fail(self, op: str, exception: BaseException | type[BaseException], times: int = 1) -> FaultRule:
        """The next ``times`` calls of ``op`` raise ``exception`` without reaching the inner backend."""
        return self.add_rule(FaultRule(op=op, exception=exception, times=times))

    # -- holding calls --------------------------------------------------------------------------

    def block(self, op: str, max_wait_s: float = 30.0) -> threading.Event:
        """Make calls of ``op`` wait, once entered, until :meth:`release` (``max_wait_s`` at most, then
        they raise :class:`HangExpiredError`); clears :meth:`entered`. Returns the gate."""
        self.release(op)
        gate = threading.Event()
        rule = FaultRule(op=op, hang=gate, max_hang_s=max_wait_s)
        with self._lock:
            self._entered[op].clear()
            self._gates[op] = (gate, rule)
        self.add_rule(rule)
        return gate

    @contextlib.contextmanager
    def blocked(self, op: str) -> Iterator[threading.Event]:
        """:meth:`block` for the ``with`` body, released on exit, also when the body fails (so a failing
        test leaves no executor thread waiting). The body may :meth:`release` earlier."""
        gate = self.block(op)
        try:
            yield gate
        finally:
            self.release(op)

    def release(self, op: str | None = None) -> None:
        """Let held calls of ``op`` (of every op when None) go on; later calls no longer wait."""
        with self._lock:
            names = [op] if op is not None else list(self._gates)
            held = [self._gates.pop(name) for name in names if name in self._gates]
        for gate, rule in held:
            gate.set()
            self.remove_rule(rule)

    def entered(self, op: str) -> threading.Event:
        """Set as soon as a call of ``op`` starts (since the last :meth:`block` of ``op``)."""
        if op not in self._entered:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        return self._entered[op]

    def count(self, *ops: str) -> int:
        """Calls of ``ops`` (of every op when none given) that have started, returned or not."""
        with self._lock:
            return sum(self._started[op] for op in ops) if ops else sum(self._started.values())

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

    def keys_seen(self, *ops: str) -> list[str]:
        """Keys of every returned call of ``ops`` (of every op when none given), as asked, repeats kept."""
        calls = self.calls_of(*ops) if ops else self.calls
        return [key for call in calls for key in call.keys]

    def threads_seen(self, *ops: str) -> set[str]:
        """Names of the threads that made the returned calls of ``ops`` (of every op when none given)."""
        return {call.thread for call in (self.calls_of(*ops) if ops else self.calls)}

    def registered(self) -> list[tuple[int, int]]:
        """``(addr, size)`` of every successful ``register_buffer`` call, in order."""
        spans = []
        for call in self.calls_of("register"):
            if call.error is None and call.addrs is not None and call.sizes is not None:
                spans.append((int(call.addrs[0, 0]), int(call.sizes[0, 0])))
        return spans

    def data_calls(self) -> list[Call]:
        """Calls of ``batch_exists``, ``batch_put`` and ``batch_get``."""
        return self.calls_of(*DATA_OPS)

    def clear_calls(self) -> None:
        """Forget every record and :meth:`count` so far."""
        with self._lock:
            self._calls.clear()
            self._started.clear()

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
        table = (region_copy([[addr]]), region_copy([[size]]))
        self._start("register")
        plan = self._rulebook.draw("register", None)
        with self._inside():
            try:
                self._delay_and_hang(plan, "register")
                if plan.exception is not None:
                    raise plan.exception
                self.inner.register_buffer(addr, size)
            except BaseException as exc:
                self._record(
                    Call(
                        "register",
                        (),
                        counts,
                        nbytes,
                        error=exc,
                        thread=thread_name(),
                        addrs=table[0],
                        sizes=table[1],
                    )
                )
                raise
        self._record(
            Call("register", (), counts, nbytes, thread=thread_name(), addrs=table[0], sizes=table[1])
        )

    def unregister_buffer(self, addr: int) -> None:
        self._start("unregister")
        unregister = getattr(self.inner, "unregister_buffer", None)
        if callable(unregister):
            unregister(addr)
        self._record(Call("unregister", (), (), (), thread=thread_name(), addrs=region_copy([[addr]])))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        answer = self._data_call("exists", keys, None, None)
        return [bool(v) for v in answer]

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._data_call("put", keys, addrs, sizes)

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        return self._data_call("get", keys, addrs, sizes)

    def close(self) -> None:
        self._start("close")
        self._record(Call("close", (), (), (), thread=thread_name()))
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
        self._start(op)
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            # Not a list of keys: no rule can target it; the inner backend refuses it.
            return self._passthrough(op, keys, addrs, sizes)
        key_list = list(keys)
        counts, nbytes = region_stats(sizes)
        table = (region_copy(addrs), region_copy(sizes))
        made = (op, tuple(key_list), counts, nbytes)
        plan = self._rulebook.draw(op, key_list)
        faulted = tuple(key_list[i] for i in sorted(plan.codes))
        with self._inside():
            try:
                self._delay_and_hang(plan, op)
                if plan.exception is not None:
                    raise plan.exception
            except BaseException as exc:
                self._record(Call(*made, error=exc, thread=thread_name(), addrs=table[0], sizes=table[1]))
                raise
            sent_index = [i for i in range(len(key_list)) if i not in plan.codes]
            sent = tuple(key_list[i] for i in sent_index)
            try:
                answer = self._call_inner(op, key_list, addrs, sizes, sent_index)
            except BaseException as exc:
                self._record(
                    Call(
                        *made, sent, faulted, error=exc, thread=thread_name(), addrs=table[0], sizes=table[1]
                    )
                )
                raise
        merged: list[Any] = [None] * len(key_list)
        for i, code in plan.codes.items():
            merged[i] = False if op == "exists" else code
        for i, value in zip(sent_index, answer, strict=True):
            merged[i] = value
        result = tuple(int(v) for v in merged)
        self._record(Call(*made, sent, faulted, result, thread=thread_name(), addrs=table[0], sizes=table[1]))
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
        answer: list[Any]
        with self._inside():
            try:
                if op == "exists":
                    answer = list(self.inner.batch_exists(keys))
                elif op == "put":
                    answer = list(self.inner.batch_put(keys, addrs, sizes))
                else:
                    answer = list(self.inner.batch_get(keys, addrs, sizes))
            except BaseException as exc:
                self._record(Call(op, (), (), (), error=exc, thread=thread_name()))
                raise
        self._record(Call(op, (), (), (), result=tuple(int(v) for v in answer), thread=thread_name()))
        return answer

    def _delay_and_hang(self, plan: CallFaults, op: str) -> None:
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

    def _start(self, op: str) -> None:
        with self._lock:
            self._started[op] += 1
        self._entered[op].set()

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def _record(self, call: Call) -> None:
        with self._lock:
            self._calls.append(call)


def _select(regions: Regions | None, index: list[int]) -> Any:
    if isinstance(regions, np.ndarray):
        return regions[np.asarray(index, dtype=np.int64)]
    if regions is None:
        return None
    return [regions[i] for i in index]
