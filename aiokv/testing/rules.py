"""Fault rules: which backend calls and keys a fault targets, how often it fires, and what it does.

See :mod:`aiokv.testing` for how a :class:`~aiokv.testing.FaultInjectingBackend` applies them.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ..errors import BackendError

__all__ = ["DATA_OPS", "FaultRule", "HangExpiredError", "InjectedFault", "KeySelector"]

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
            # A fresh copy per firing: re-raising one instance grows its traceback without bound.
            fresh = copy.copy(exc)
            fresh.__traceback__ = None
            return fresh
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
