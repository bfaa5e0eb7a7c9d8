"""The operating system's name for aiokv's threads (Linux: what ``top -H``, ``ps -L`` and
``/proc/PID/task/TID/comm`` show), so the CPU a process spends can be told apart by thread. Python
names its threads for itself only. Best effort: elsewhere, or if the call fails, nothing happens."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15
_MAX_NAME = 15  # bytes; the kernel keeps at most 16 with the terminating zero


def _prctl() -> ctypes._NamedFuncPointer | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (cut to 15 bytes) in the operating system's listings."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_MAX_NAME]), 0, 0, 0)
