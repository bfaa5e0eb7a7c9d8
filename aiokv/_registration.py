"""The caller's memory a worker registers with its backend, and its release.

:class:`Registration` is the one owner of what is registered: every layout's regions with overlapping
or touching spans merged (stores refuse overlapping registrations), registered in order and
unregistered in reverse, the backend closed afterwards when the worker was asked to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .layout import KVLayout

logger = logging.getLogger("aiokv")


def merged_spans(layouts: Sequence[KVLayout]) -> list[tuple[int, int]]:
    """All regions of all groups with overlapping or touching spans merged."""
    spans = sorted(span for layout in layouts for span in layout.region_spans())
    merged: list[list[int]] = []
    for addr, size in spans:
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], addr + size - merged[-1][0])
        else:
            merged.append([addr, size])
    return [(addr, size) for addr, size in merged]


class Registration:
    def __init__(
        self, layouts: Sequence[KVLayout], backend: Any, *, can_unregister: bool, close_backend: bool
    ) -> None:
        self._spans = merged_spans(layouts)
        self._backend = backend
        self._can_unregister = can_unregister
        self._close_backend = close_backend
        self._registered: list[int] = []

    async def register(self, run: Callable[..., Awaitable[Any]]) -> None:
        """Register every span through ``run(fn, *args)`` (the worker's transfer lane)."""
        for addr, size in self._spans:
            await run(self._backend.register_buffer, addr, size)
            self._registered.append(addr)

    async def release(self) -> None:
        """Unregister what was registered and, if asked to, close the backend (on fresh threads: after
        terminate() the worker's lanes take no more work)."""
        if self._can_unregister:
            for addr in reversed(self._registered):
                try:
                    await asyncio.to_thread(self._backend.unregister_buffer, addr)
                except Exception as exc:
                    logger.warning("aiokv: unregister_buffer(%#x) failed: %s", addr, exc)
        self._registered.clear()
        if self._close_backend:
            await asyncio.to_thread(self._backend.close)
