"""Permission for AMX tile instructions, which vLLM's CPU kernels use without asking for it.

Linux lets a process execute AMX tile instructions only after it asks (``arch_prctl``
``ARCH_REQ_XCOMP_PERM``); torch asks lazily, before kernels of its own that use AMX (oneDNN, inductor).
vLLM 0.32's CPU attention (its ``amx`` kernels, picked for bf16 on CPUs with AMX) never asks, so in a
process where nothing else asked first, the first attention step dies with SIGILL: seen here on every
engine run with ``TORCHDYNAMO_DISABLE=1`` and on the benchmark's loading engine with AiokvConnector.
Asking is per process, idempotent and harmless where there is no AMX.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def amx_tiles_supported() -> bool:
    """Whether this CPU and kernel offer AMX tiles (what vLLM checks to pick its ``amx`` kernels)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def allow_amx_tiles() -> bool:
    """Ask Linux for AMX tile permission for this process, as torch does before its own AMX kernels.

    True when AMX tiles may now be used, False where the CPU has none (nothing to allow)."""
    if not amx_tiles_supported():
        return False
    import torch

    allowed = bool(torch.cpu._init_amx())
    if not allowed:
        logger.warning("aiokv: the CPU has AMX but Linux refused AMX tile permission to this process")
    return allowed
