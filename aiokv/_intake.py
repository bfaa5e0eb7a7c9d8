"""Calls into requests: what :class:`~aiokv.worker.KVWorker` does with a store, load or lookup once
it is running. The arguments are checked, the request made and tracked, then refused by the circuit
breaker or handed to the dispatcher; a lookup asks the lease budget first and, with leases, answers
once its hit is held (:mod:`aiokv.leases`)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from ._arrays import as_timeout
from ._engine.config import EngineConfig
from ._engine.dispatcher import Dispatcher
from ._engine.guard import BreakerGuard
from ._engine.hashing import hash_prompts
from ._engine.request import Request
from ._engine.tracker import RequestTracker
from ._lifecycle import calling_loop
from ._validate import BlockIds, check_block_ids, check_tokens
from .futures import TransferFuture
from .keys import HashedPrompt, TokenIds
from .leases import LeaseLedger
from .stats import Kind


class Intake:
    """One worker's requests, numbered from 1. Every call takes the worker's loop (the caller must be
    on it) and its dispatcher."""

    def __init__(
        self,
        config: EngineConfig,
        tracker: RequestTracker,
        guard: BreakerGuard | None,
        leases: LeaseLedger | None,
    ) -> None:
        self._config = config
        self._tracker = tracker
        self._guard = guard
        self._leases = leases
        self._ids = itertools.count(1)

    def transfer(
        self,
        kind: Kind,
        tokens: TokenIds | HashedPrompt,
        block_ids: BlockIds,
        timeout: float | None,
        loop: asyncio.AbstractEventLoop,
        dispatcher: Dispatcher,
    ) -> TransferFuture[Any]:
        """A store or a load, submitted; its future."""
        request = self._new_request(kind, tokens, block_ids, timeout, loop)
        if request.num_chunks == 0:
            self._tracker.finish_empty(request, self._config.groups)
        elif self._guard is not None and not self._guard.allow(kind):
            self._tracker.refuse(request)
        else:
            dispatcher.submit(request)
        return request.future

    async def lookup(
        self, tokens: TokenIds | HashedPrompt, loop: asyncio.AbstractEventLoop, dispatcher: Dispatcher
    ) -> int:
        """A lookup's answer (see :meth:`KVWorker.lookup`)."""
        request = self._new_request(Kind.LOOKUP, tokens, None, None, loop)
        leases, claim = self._leases, None
        refused = bool(request.num_chunks) and self._guard is not None and not self._guard.allow(Kind.LOOKUP)
        if request.num_chunks and not refused and leases is not None:
            if request.hashes is None:  # the ledger counts chunks by digest: a repeat then costs nothing
                await self._hash_lookup(request)
            if not request.finished:
                claim = leases.ask(request, self._config.chunk_tokens)
        if refused:
            self._tracker.refuse(request)
        elif request.finished:  # a bad token value failed it while hashing: its future says why
            pass
        elif request.num_chunks == 0:  # empty, or the lease budget is spent: nothing asked, nothing leased
            self._tracker.finish_lookup(request, 0)
        else:
            try:
                dispatcher.submit_lookup(request)
            except BaseException:  # closed while it was hashed: nothing asked, nothing leased
                if leases is not None and claim is not None:
                    leases.settle(claim, 0)
                request.cancel()
                raise
        if leases is None or claim is None or not claim.granted:
            return await request.future
        return await leases.held_until(request, claim, self._config.chunk_tokens)

    def loaded(self, tokens: TokenIds | HashedPrompt, loop: asyncio.AbstractEventLoop) -> None:
        """Another worker loads the chunks of ``tokens`` (see :meth:`KVWorker.lookup_loaded`)."""
        leases = self._leases
        if leases is None:
            return
        calling_loop(loop)
        chunk_tokens = self._config.chunk_tokens
        hashes, token_ids, _ = check_tokens(tokens, chunk_tokens)
        if hashes is None and token_ids is not None:
            hashes = HashedPrompt.from_tokens(token_ids, chunk_tokens).hashes
        leases.loaded(hashes or ())

    async def _hash_lookup(self, request: Request) -> None:
        """A lookup's digests before the lease ledger counts it, hashed in slices as a batch would
        (the batch then skips it); a caller's cancellation cancels the request."""
        config = self._config
        try:
            await hash_prompts([request], config.chunk_tokens, config.seed, self._tracker)
        except BaseException:
            request.cancel()
            raise

    def _new_request(
        self,
        kind: Kind,
        tokens: TokenIds | HashedPrompt,
        block_ids: BlockIds | None,
        timeout: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> Request:
        config = self._config
        hashes, token_ids, num_chunks = check_tokens(tokens, config.chunk_tokens)
        blocks = (
            check_block_ids(block_ids, num_chunks, config.layouts, config.blocks_per_chunk)
            if kind is not Kind.LOOKUP
            else []
        )
        deadline_s = as_timeout(timeout)
        calling_loop(loop)
        request = Request(
            id=next(self._ids),
            kind=kind,
            num_chunks=num_chunks,
            tracker=self._tracker,
            submitted=time.perf_counter(),
            tokens=token_ids,
            hashes=hashes,
            blocks=tuple(blocks),
        )
        request.future = TransferFuture(loop, request.id, kind.value, request)
        self._tracker.track(request, loop, deadline_s)
        return request
