"""aiokv's log records inside vLLM's processes."""

from __future__ import annotations

import logging


def log_through_vllm() -> None:
    """Inside vLLM, aiokv's records go where vLLM's go, unless the application configured logging.

    vLLM configures only its own ``vllm`` logger; with no handler on ``aiokv`` or the root logger, the
    connector's INFO lines (registration, key scope) would never show and its warnings would lose
    vLLM's format."""
    ours, root, theirs = logging.getLogger("aiokv"), logging.getLogger(), logging.getLogger("vllm")
    if ours.handlers or root.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
