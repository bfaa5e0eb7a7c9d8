"""A step's loads or stores handed to the movers of the engine's KV cache groups, in one call each."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

from ..common.wire import TransferSpec
from .chunk_movers import ChunkMover, ChunkRequest
from .transfer_waits import wait_all

logger = logging.getLogger("aiokv.vllm")


def chunk_requests(specs: Sequence[TransferSpec], group: int) -> tuple[list[int], list[ChunkRequest]]:
    """The specs that move chunks of KV cache ``group`` (their indices), and their requests."""
    moving = [index for index, spec in enumerate(specs) if spec.block_ids[group]]
    return moving, [(specs[i].group_prompt(group), [list(specs[i].block_ids[group])]) for i in moving]


def submit_step(
    kind: str, specs: Sequence[TransferSpec], movers: Sequence[ChunkMover], timeout: float
) -> list[list[concurrent.futures.Future[Any]] | None]:
    """All of a step's loads or stores (``kind``) in one call per KV cache group (``movers[g]`` moves
    group ``g``), handed to aiokv's loop without waiting for it (waiting, once per request, stalled the
    engine's step a millisecond or more each): per spec, the futures of the groups it moves chunks of;
    None for each if refused."""
    if not movers or not specs:
        return [None] * len(specs)
    out: list[list[concurrent.futures.Future[Any]]] = [[] for _ in specs]
    try:
        for group, mover in enumerate(movers):
            moving, requests = chunk_requests(specs, group)
            if not requests:
                continue
            submitted: list[concurrent.futures.Future[Any]] = list(
                mover.load_many(requests, timeout=timeout)
                if kind == "load"
                else mover.store_many(requests, timeout=timeout)
            )
            for index, future in zip(moving, submitted, strict=True):
                out[index].append(future)
    except Exception as exc:
        logger.warning("aiokv: %d %s(s) refused (%s)", len(specs), kind, exc)
        if kind == "store":
            # Futures of groups submitted before the refusal still touch the blocks: keep them.
            return [group_futures or None for group_futures in out]
        for group_futures in out:
            wait_all(group_futures, f"{kind}s refused in part")  # a load's blocks are recomputed
        return [None] * len(specs)
    return list(out)


def warn_if_failed(req_id: str, future: concurrent.futures.Future[Any]) -> None:
    """A store's future is done: a failure here is a refusal or an error, not a failed chunk (those
    are in the result)."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        logger.warning("aiokv: store for %s failed (%s)", req_id, exc)
