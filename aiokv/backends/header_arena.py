"""Registered memory for value headers: pages of header slots lent to one batch call at a time.

Several transfer threads call a backend at once; each call borrows one page (a header slot per key,
up to :data:`SLOTS_PER_PAGE` keys) and returns it when the call is over, so no two calls share a slot.
A call finding every page lent waits for one: a call holds one page at a time, so the wait ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np

from .base import MAX_KEYS_PER_CALL
from .value_header import HEADER_BYTES, HEADER_DTYPE, Headers

SLOTS_PER_PAGE = MAX_KEYS_PER_CALL  # the most keys the worker puts in one call
DEFAULT_PAGES = 16  # 16 x 4096 x 64 B = 4 MiB: more pages than transfer threads in any deployment here


class HeaderArena:
    """``pages`` pages of :data:`SLOTS_PER_PAGE` header slots in one buffer (to register once)."""

    def __init__(self, pages: int = DEFAULT_PAGES) -> None:
        if isinstance(pages, bool) or not isinstance(pages, int) or pages <= 0:
            raise ValueError(f"pages must be a positive int, got {pages!r}")
        self._buffer = np.zeros(pages * SLOTS_PER_PAGE, dtype=HEADER_DTYPE)
        self._free = list(range(pages))
        self._available = threading.Condition()

    @property
    def address(self) -> int:
        return int(self._buffer.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self._buffer.nbytes)

    @contextlib.contextmanager
    def page(self, slots: int) -> Iterator[tuple[Headers, int]]:
        """A page's first ``slots`` headers (zeroed) and their first address, for one call."""
        if not 0 < slots <= SLOTS_PER_PAGE:
            raise ValueError(f"a page holds 1 to {SLOTS_PER_PAGE} headers, not {slots}")
        with self._available:
            while not self._free:
                self._available.wait()
            index = self._free.pop()
        try:
            start = index * SLOTS_PER_PAGE
            headers = self._buffer[start : start + slots]
            # Zeroed for each call: a get that reports success without writing a header must not find
            # the previous call's header there.
            headers.view(np.uint8)[:] = 0
            yield headers, self.address + start * HEADER_BYTES
        finally:
            with self._available:
                self._free.append(index)
                self._available.notify()
