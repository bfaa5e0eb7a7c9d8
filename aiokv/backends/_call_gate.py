"""A local backend's calls in progress: refused once it closes, and waited for by its close."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import BackendError


class CallGate:
    """Calls of the backend ``owner`` run inside :meth:`call`; :meth:`shut` refuses new ones and waits
    for those in progress. It shares the backend's ``lock``, so the backend's own state under that
    lock and the gate's agree (close() shuts the gate and tears down in one hold of the lock)."""

    def __init__(self, lock: threading.Lock, owner: str) -> None:
        self._lock = lock
        self._idle = threading.Condition(lock)
        self._active = 0
        self._owner = owner
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise BackendError(f"{self._owner} is closed")

    @contextmanager
    def call(self) -> Iterator[None]:
        """A call in progress: refused once closed, and waited for by :meth:`shut`."""
        with self._lock:
            self.check_open()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    def shut(self) -> bool:
        """With the lock held: refuse new calls and wait for those in progress. False if it was shut
        already (close() is idempotent)."""
        if self.closed:
            return False
        self.closed = True
        while self._active:
            self._idle.wait()
        return True
