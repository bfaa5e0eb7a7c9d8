"""Waiting for a rank's transfers before their blocks may be reused, however long they take."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

logger = logging.getLogger("aiokv.vllm")

WAIT_LOG_S = 5.0  # a wait for in-flight transfers this long is logged (and then every as long)


def wait_all(futures: list[concurrent.futures.Future[Any]], what: str) -> None:
    """Wait until every future is done. Not bounded here: each transfer is bounded by its own timeout
    and the backend's, and the blocks must not be reused while one may still touch them."""
    pending = [future for future in futures if not future.done()]
    started = time.monotonic()
    while pending:
        _, not_done = concurrent.futures.wait(pending, timeout=WAIT_LOG_S)
        pending = list(not_done)
        if pending:
            logger.warning(
                "aiokv: %s still waits for %d transfer(s) after %.0f s",
                what,
                len(pending),
                time.monotonic() - started,
            )
