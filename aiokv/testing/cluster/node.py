"""One node of a cluster world: a process with its own Mooncake client, a toy paged KV cache and a
``KVWorker``, driven over a pipe by JSON lines.

Run as ``python -m aiokv.testing.cluster.node CONFIG_JSON`` inside a node's namespace (the client side,
:class:`aiokv.testing.cluster.client.NodeClient`, does this). It prints ``{"ready": true}`` once connected,
then answers one line per request line. Requests run concurrently; each names an ``id`` and an ``op``:

=========  =====================================================================================
op         what it does (``seed`` and ``chunks`` name a prompt; ``block_ids``: one id per block)
=========  =====================================================================================
fill       write the prompt's bytes into the blocks (replies their digests)
store      fill the blocks with the prompt's bytes, then ``worker.store``; ``fill: false`` skips it
load       fill the blocks with a sentinel, ``worker.load``, then judge every chunk's bytes
lookup     ``worker.lookup``
direct     the same (address, size) pairs as the worker's, put or got by direct backend calls (on keys
           of their own, or the worker's with ``worker_keys``)
breaker    the worker's circuit breaker: ``worker.stats()["breaker"]`` (None without one)
replicas   where the master places each chunk (``backend.replica_endpoints``): endpoints per key
replica_read  ``backend.read_from_replicas`` of the chunks (sentinel first, bytes judged); ``size_delta``
           shrinks each chunk's last region, ``unregistered`` reads into memory never registered
exists     ``backend.batch_exists`` of the prompt's keys
remove     remove the prompt's keys (the worker's and the ``direct`` ones of ``tag``), forced unless
           ``force: false`` (then a key under a read lease answers -706); replies the codes
health     ``backend.health_check()``
stats      ``worker.stats()``
exit       close the worker and the client, then exit
=========  =====================================================================================

A reply is ``{"id", "ok": true, "result", "elapsed_s"}`` or ``{"id", "ok": false, "error", "message",
"elapsed_s"}`` (``error`` is the exception's class name). The bytes of chunk ``k`` of prompt ``seed`` are
a pure function of both (:func:`chunk_bytes`), so any node can tell right bytes from wrong ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ...backends.mooncake import MooncakeBackend
from ...breaker import BreakerConfig
from ...keys import KeyNamespace, chunk_hashes
from ...layout import KVLayout
from ...leases import LeaseBudget
from ...worker import KVWorker

SENTINEL = 0xEE
MODEL = "cluster"


def prompt_tokens(seed: int, chunks: int, chunk_tokens: int) -> list[int]:
    """Tokens of prompt ``seed``; chunk ``k``'s tokens depend only on (seed, k), so prompts nest."""
    pieces = [np.random.default_rng([seed, k]).integers(0, 32_000, chunk_tokens) for k in range(chunks)]
    return np.concatenate(pieces).tolist() if pieces else []


def chunk_bytes(seed: int, chunk: int, regions: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """The bytes chunk ``chunk`` of prompt ``seed`` holds in each of ``regions`` cache regions."""
    rng = np.random.default_rng([seed, chunk, 0xC0FFEE])
    return np.frombuffer(rng.bytes(regions * nbytes), dtype=np.uint8).reshape(regions, nbytes)


def digest(array: npt.NDArray[np.uint8]) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array).data, digest_size=8).hexdigest()


def worker_options(options: dict[str, Any]) -> dict[str, Any]:
    """KVWorker options from JSON: ``breaker`` and ``lease_budget`` are None (none) or their fields."""
    options = dict(options)
    if options.get("breaker") is not None:
        options["breaker"] = BreakerConfig(**options["breaker"])
    if options.get("lease_budget") is not None:
        options["lease_budget"] = LeaseBudget(**options["lease_budget"])
    return options


class Node:
    """The node's state: cache, layout, backend and worker."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.regions = int(config["regions"])
        self.block_len = int(config["block_len"])
        self.block_size = int(config["block_size"])
        self.chunk_tokens = int(config["chunk_tokens"])
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        num_blocks = int(config["num_blocks"])
        self.cache = np.zeros((self.regions, num_blocks, self.block_len), dtype=np.uint8)
        self.layout = KVLayout(
            [int(self.cache[r].ctypes.data) for r in range(self.regions)],
            [self.block_len],
            self.block_size,
            num_blocks,
        )
        self.namespace = KeyNamespace(MODEL)
        self.backend = MooncakeBackend(config["mooncake"])
        self.worker = KVWorker(
            self.layout,
            self.backend,
            namespace=self.namespace,
            chunk_tokens=self.chunk_tokens,
            close_backend=True,
            **worker_options(config.get("worker", {})),
        )

    # -- helpers --------------------------------------------------------------------------------

    def tokens(self, request: dict[str, Any]) -> list[int]:
        return prompt_tokens(int(request["seed"]), int(request["chunks"]), self.chunk_tokens)

    def keys(self, request: dict[str, Any]) -> list[str]:
        hashes = chunk_hashes(self.tokens(request), self.chunk_tokens)
        return self.namespace.keys(hashes, self.layout.fingerprint, 0)

    def chunk_ids(self, block_ids: Sequence[int], chunk: int) -> npt.NDArray[np.int64]:
        per = self.blocks_per_chunk
        return np.asarray(block_ids[chunk * per : (chunk + 1) * per], dtype=np.int64)

    def expected(self, seed: int, chunk: int) -> npt.NDArray[np.uint8]:
        data = chunk_bytes(seed, chunk, self.regions, self.blocks_per_chunk * self.block_len)
        return data.reshape(self.regions, self.blocks_per_chunk, self.block_len)

    def fill(self, seed: int, chunks: int, block_ids: Sequence[int]) -> list[str]:
        sums = []
        for chunk in range(chunks):
            data = self.expected(seed, chunk)
            self.cache[:, self.chunk_ids(block_ids, chunk), :] = data
            sums.append(digest(data))
        return sums

    def judge(self, seed: int, chunks: int, block_ids: Sequence[int]) -> tuple[list[str], list[str]]:
        """Per chunk: "ok" (the stored bytes), "untouched" (still the sentinel) or "wrong"; and digests."""
        verdicts, sums = [], []
        for chunk in range(chunks):
            actual = self.cache[:, self.chunk_ids(block_ids, chunk), :]
            sums.append(digest(actual))
            if np.array_equal(actual, self.expected(seed, chunk)):
                verdicts.append("ok")
            elif bool((actual == SENTINEL).all()):
                verdicts.append("untouched")
            else:
                verdicts.append("wrong")
        return verdicts, sums

    def direct_keys(self, request: dict[str, Any]) -> list[str]:
        return [
            f"direct/{request.get('tag', '')}/{request['seed']}/{k}" for k in range(int(request["chunks"]))
        ]

    def direct_regions(self, request: dict[str, Any]) -> tuple[list[list[int]], list[list[int]]]:
        """The (address, size) pairs the worker computes for these chunks, one row per chunk."""
        chunks, block_ids = int(request["chunks"]), request["block_ids"]
        spans = [(k * self.chunk_tokens, (k + 1) * self.chunk_tokens) for k in range(chunks)]
        addrs, sizes, _ = self.layout.prepare_values(spans, block_ids)
        return addrs.tolist(), np.ascontiguousarray(sizes).tolist()

    # -- operations -----------------------------------------------------------------------------

    async def run(self, request: dict[str, Any]) -> Any:
        op = request["op"]
        loop = asyncio.get_running_loop()
        timeout = request.get("timeout")
        if op == "store":
            sums = None
            if request.get("fill", True):
                sums = self.fill(int(request["seed"]), int(request["chunks"]), request["block_ids"])
            tokens = self.tokens(request)
            started = time.monotonic()
            result = await self.worker.store(tokens, [request["block_ids"]], timeout=timeout)
            return {
                "transfer_s": time.monotonic() - started,
                "stored": result.stored,
                "skipped": result.skipped,
                "failed": result.failed,
                "failed_chunks": list(result.failed_chunks),
                "errors": {str(k): v for k, v in result.errors.items()},
                "digests": sums,
            }
        if op == "load":
            seed, chunks, block_ids = int(request["seed"]), int(request["chunks"]), request["block_ids"]
            for chunk in range(chunks):
                self.cache[:, self.chunk_ids(block_ids, chunk), :] = SENTINEL
            tokens = self.tokens(request)
            started = time.monotonic()
            loaded = await self.worker.load(tokens, [block_ids], timeout=timeout)
            transfer_s = time.monotonic() - started
            reply: dict[str, Any] = {
                "loaded_tokens": loaded.loaded_tokens,
                "loaded_chunks": loaded.loaded_chunks,
                "failed_block_ids": [list(ids) for ids in loaded.failed_block_ids],
                "errors": {str(k): v for k, v in loaded.errors.items()},
                "transfer_s": transfer_s,
            }
            if request.get("verify", True):
                reply["verdicts"], reply["digests"] = self.judge(seed, chunks, block_ids)
            return reply
        if op == "lookup":
            coro = self.worker.lookup(self.tokens(request))
            return await (asyncio.wait_for(coro, timeout) if timeout is not None else coro)
        if op == "direct":
            return await loop.run_in_executor(None, self.direct, request)
        if op == "replicas":
            return await loop.run_in_executor(None, self.replicas, self.keys(request))
        if op == "fill":
            seed, chunks = int(request["seed"]), int(request["chunks"])
            return await loop.run_in_executor(None, self.fill, seed, chunks, request["block_ids"])
        if op == "remove":
            keys = self.keys(request) + self.direct_keys(request)
            force = bool(request.get("force", True))
            return await loop.run_in_executor(None, lambda: self.backend.batch_remove(keys, force=force))
        if op == "breaker":
            return self.worker.stats()["breaker"]
        if op == "exists":
            return await loop.run_in_executor(None, self.backend.batch_exists, self.keys(request))
        if op == "health":
            return await loop.run_in_executor(None, self.backend.health_check)
        if op == "replica_read":
            return await loop.run_in_executor(None, self.replica_read, request)
        if op == "stats":
            return self.worker.stats()
        raise ValueError(f"unknown op {op!r}")

    def direct(self, request: dict[str, Any]) -> dict[str, Any]:
        """Direct backend calls over the worker's pairs, split as the worker splits them."""
        if request.get("fill", False):
            self.fill(int(request["seed"]), int(request["chunks"]), request["block_ids"])
        addrs, sizes = self.direct_regions(request)
        keys = self.keys(request) if request.get("worker_keys", False) else self.direct_keys(request)
        per_call = max(1, int(self.backend.max_regions_per_call) // max(1, len(addrs[0]) if addrs else 1))
        call = self.backend.batch_put if request["direct_op"] == "put" else self.backend.batch_get
        codes: list[int] = []
        started = time.monotonic()
        for first in range(0, len(keys), per_call):
            part = slice(first, first + per_call)
            codes.extend(call(keys[part], addrs[part], sizes[part]))
        elapsed = time.monotonic() - started
        return {"transfer_s": elapsed, "failed": sum(1 for code in codes if code < 0)}

    def replica_read(self, request: dict[str, Any]) -> dict[str, Any]:
        """``read_from_replicas`` of every chunk of the prompt into ``block_ids`` (or, with
        ``unregistered``, into a fresh array never registered), then each chunk's verdict."""
        seed, chunks, block_ids = int(request["seed"]), int(request["chunks"]), request["block_ids"]
        keys = self.keys(request)
        addrs, sizes = self.direct_regions(request)
        delta = int(request.get("size_delta", 0))
        if delta:
            sizes = [[*row[:-1], row[-1] - delta] for row in sizes]
        if request.get("unregistered", False):
            scratch = np.full(self.cache.shape, SENTINEL, dtype=np.uint8)
            base, offset = int(self.cache.ctypes.data), int(scratch.ctypes.data)
            addrs = [[addr - base + offset for addr in row] for row in addrs]
            codes = self.backend.read_from_replicas(keys, addrs, sizes)
            return {"codes": codes, "scratch_untouched": bool((scratch == SENTINEL).all())}
        for chunk in range(chunks):
            self.cache[:, self.chunk_ids(block_ids, chunk), :] = SENTINEL
        codes = self.backend.read_from_replicas(keys, addrs, sizes)
        verdicts, _ = self.judge(seed, chunks, block_ids)
        return {"codes": codes, "verdicts": verdicts}

    def replicas(self, keys: list[str]) -> dict[str, list[str]]:
        """Endpoints holding each key's replicas, from the master (diagnostics)."""
        return self.backend.replica_endpoints(keys)


def json_value(value: object) -> Any:
    """What a reply holds beyond JSON's types: the worker's stats carry dataclasses (latency summaries)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"a node reply cannot carry {type(value).__name__}")


async def serve(config: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    node = Node(config)
    out = sys.stdout

    def reply(message: dict[str, Any]) -> None:
        out.write(json.dumps(message, default=json_value) + "\n")
        out.flush()

    async def handle(request: dict[str, Any]) -> None:
        started = time.monotonic()
        try:
            result = await node.run(request)
            message = {"id": request.get("id"), "ok": True, "result": result}
        except Exception as exc:  # every failure is answered; the node keeps serving
            message = {"id": request.get("id"), "ok": False, "error": type(exc).__name__, "message": str(exc)}
        message["elapsed_s"] = time.monotonic() - started
        try:
            reply(message)
        except TypeError as exc:  # answered all the same: a driver must never wait for a lost reply
            reply({"id": request.get("id"), "ok": False, "error": "TypeError", "message": str(exc)})

    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    async with node.worker:
        reply({"ready": True, "address": config["mooncake"]["local_hostname"]})
        while line := await reader.readline():  # EOF: the driver is gone
            request = json.loads(line)
            if request.get("op") == "exit":
                break
            task = loop.create_task(handle(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = json.loads(argv[0])
    if config.get("loop") == "uvloop":
        import uvloop

        uvloop.run(serve(config))
    else:
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
