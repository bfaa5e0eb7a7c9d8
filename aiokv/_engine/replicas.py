"""Gets that failed -800 read once more from another replica, inside the same backend call.

For a key stored with more than one replica, Mooncake keeps reading a dead node's replica for ~10 s,
until its master drops the node; :meth:`MooncakeBackend.read_from_replicas` reads the live one instead.
The retry runs in the transfer thread right after the get, as part of the one call the tracker admitted:
the request is *transferring* throughout, so no cancel or deadline settles it while the retry writes its
blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..codes import Code

logger = logging.getLogger("aiokv")

ReadFromReplicas = Callable[[Sequence[str], Any, Any], Sequence[int]]


def replica_reader(backend: object) -> ReadFromReplicas | None:
    """The backend's ``read_from_replicas`` when it has one, whatever its own ``replica_num``: how many
    replicas a key has is the stored object's (its writer's) setting, which the backend asks the master
    for."""
    read = getattr(backend, "read_from_replicas", None)
    return read if callable(read) else None


class RetryingGet:
    """``get(keys, addrs, sizes)``, then ``read`` for the keys it failed -800, unless ``stop_at``
    (``time.monotonic()``) has passed. A key counts only when the retry read its whole value;
    ``recovered`` is how many did (read on the loop once the call has returned)."""

    def __init__(
        self,
        get: Callable[[Sequence[str], Any, Any], Any],
        read: ReadFromReplicas,
        stop_at: float | None,
    ) -> None:
        self._get = get
        self._read = read
        self._stop_at = stop_at
        self.retried = 0
        self.recovered = 0

    def __call__(self, keys: Sequence[str], addrs: Any, sizes: Any) -> Any:
        answer = self._get(keys, addrs, sizes)
        if self._stop_at is not None and time.monotonic() >= self._stop_at:
            return answer
        try:
            codes = np.asarray(answer, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return answer  # a malformed answer is judged by the caller, not retried
        if codes.shape != (len(keys),):
            return answer
        retry = np.flatnonzero(codes == Code.TRANSFER_FAILED)
        if not retry.size:
            return answer
        expected = np.asarray(sizes)[retry].sum(axis=1)
        self.retried = int(retry.size)
        try:
            again = np.asarray(
                self._read([keys[i] for i in retry.tolist()], addrs[retry], sizes[retry]), dtype=np.int64
            )
        except Exception as exc:  # the first answer stands; the chunks stay failed
            logger.warning("aiokv: reading %d chunks from other replicas failed: %s", retry.size, exc)
            return answer
        if again.shape != retry.shape:
            return answer
        full = again == expected
        codes[retry[full]] = again[full]
        self.recovered = int(full.sum())
        return codes.tolist()


def monotonic_deadline(loop_whens: Sequence[float], loop_now: float) -> float | None:
    """The earliest of the requests' deadlines (event-loop times) as a ``time.monotonic()`` time."""
    if not loop_whens:
        return None
    return time.monotonic() + (min(loop_whens) - loop_now)
