"""One aiokv worker per KV cache group of a hybrid engine, over memory registered once.

vLLM's hybrid allocator lays the groups' layers over shared tensors (one pool of blocks serves every
group), so the groups' layouts cover the same memory. Each group gets its own worker (a sliding-window
group moves fewer chunks than a full-attention one), and the store sees one registration of their
union: the workers' own register and unregister calls reach no further than :class:`Preregistered`.
A group's backend may be wrapped (``wrap``: a verifying wrapper with that group's fingerprint); memory
the wrapper registers of its own (its header arena) passes through to the store.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ...._registration import merged_spans
from ....keys import HashedPrompt, KeyNamespace
from ....layout import KVLayout
from ....leases import LeaseBudget
from ....threaded import ThreadedKVWorker
from .backend_handles import safe_call

logger = logging.getLogger("aiokv.vllm")


class Preregistered:
    """``backend`` whose KV cache registration is done: a worker's registrations inside it are checked,
    not repeated; memory outside it (a wrapper's own buffers) is registered with the store as usual."""

    def __init__(self, backend: Any, spans: Sequence[tuple[int, int]]) -> None:
        self.inner = backend
        self._spans = list(spans)
        self._passed: set[int] = set()  # registrations outside the KV cache, passed through

    def register_buffer(self, addr: int, size: int) -> None:
        if any(start <= addr and addr + size <= start + length for start, length in self._spans):
            return
        if any(addr < start + length and start < addr + size for start, length in self._spans):
            raise ValueError(f"[{addr:#x}, +{size}) overlaps the KV cache's registration without lying in it")
        self.inner.register_buffer(addr, size)
        self._passed.add(addr)

    def unregister_buffer(self, addr: int) -> None:
        if addr in self._passed:  # the KV cache itself is released once, by GroupWorkers.close
            self._passed.discard(addr)
            unregister = getattr(self.inner, "unregister_buffer", None)
            if unregister is not None:
                unregister(addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class GroupWorkers:
    """The workers of one engine's groups (``workers[g]`` moves group ``g``), sharing one backend."""

    def __init__(
        self,
        layouts: Sequence[KVLayout],
        backend: Any,
        namespaces: Sequence[KeyNamespace],
        *,
        chunk_tokens: int,
        executor_threads: int,
        max_batch_chunks: int | None = None,
        lease_budgets: Sequence[LeaseBudget] | None = None,
        wrap: Callable[[int, Any], Any] | None = None,
    ) -> None:
        self._backend = backend
        self._spans = merged_spans(layouts)
        self._registered: list[int] = []
        self.workers: list[ThreadedKVWorker] = []
        try:
            for addr, size in self._spans:
                backend.register_buffer(addr, size)
                self._registered.append(addr)
            shared = Preregistered(backend, self._spans)
            # Each group's lease budget if given (the scheduler's lookup clients), else aiokv's default.
            budgets = list(lease_budgets) if lease_budgets is not None else [LeaseBudget()] * len(layouts)
            for group, (layout, namespace, budget) in enumerate(
                zip(layouts, namespaces, budgets, strict=True)
            ):
                self.workers.append(
                    ThreadedKVWorker(
                        layout,
                        wrap(group, Preregistered(backend, self._spans)) if wrap is not None else shared,
                        namespace=namespace,
                        chunk_tokens=chunk_tokens,
                        executor_threads=executor_threads,
                        max_batch_chunks=max_batch_chunks,
                        lease_budget=budget,
                    )
                )
        except BaseException:
            self.close()
            raise

    def lookup_loaded(self, prompt: HashedPrompt) -> None:
        """A load of ``prompt``'s chunks was ordered: each group's lookups that found them hold them no
        more against their lease budget (the load leases them itself)."""
        for worker in self.workers:
            safe_call("releasing a lookup's lease budget", functools.partial(worker.lookup_loaded, prompt))

    def close(self) -> None:
        """Close every worker, then release the memory (the backend stays the caller's)."""
        workers, self.workers = self.workers, []
        for worker in workers:
            safe_call("closing an aiokv worker", functools.partial(worker.close, timeout=30.0))
        registered, self._registered = self._registered, []
        if callable(getattr(self._backend, "unregister_buffer", None)):
            for addr in reversed(registered):
                safe_call(
                    "unregistering the KV cache", functools.partial(self._backend.unregister_buffer, addr)
                )
