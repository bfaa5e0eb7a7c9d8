"""A fault-injecting backend whose calls all wait at one gate until a test opens it: the common case of
holding calls (see :mod:`aiokv.testing`)."""

from __future__ import annotations

import threading

from ..backends.base import Backend
from .faults import FaultInjectingBackend
from .rules import FaultRule

__all__ = ["BlockingBackend"]


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

    def release(self, op: str | None = None) -> None:
        self.gate.set()
        super().release(op)

    def block(self, op: str | None = None, max_wait_s: float = 30.0) -> threading.Event:
        if op is not None:
            return super().block(op, max_wait_s)
        self.gate.clear()
        return self.gate
