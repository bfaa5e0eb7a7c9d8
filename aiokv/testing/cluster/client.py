"""The driver's side of a cluster: :class:`NodeClient` starts ``aiokv.testing.cluster.node`` in a node's
namespace and talks to it over its pipe (see that module for the operations and replies);
:class:`Cluster` is a started world with the nodes started in it, stopped together."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from types import TracebackType
from typing import Any

from .world import ClusterWorld, stop_process

logger = logging.getLogger("aiokv.testing.cluster")

# Mooncake reads these at setup; the per-peer queues must be deep enough for large cross-node batches.
NODE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_STORE_CLIENT_SETUP_RETRIES": "3",
}


class NodeError(RuntimeError):
    """A node died, did not start, or did not answer in time."""


def node_config(
    world: ClusterWorld,
    index: int,
    *,
    segment_size: int = 0,
    regions: int = 8,
    block_len: int = 16 << 10,
    num_blocks: int = 256,
    block_size: int = 16,
    chunk_tokens: int = 16,
    loop: str = "asyncio",
    worker: dict[str, Any] | None = None,
    **mooncake: Any,
) -> dict[str, Any]:
    """A node's configuration: its cache geometry, its Mooncake client and its worker options."""
    address = world.node_address(index)
    if world.master is None:
        raise RuntimeError("start the world before configuring nodes")
    client = {
        "local_hostname": address,
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": world.master.address,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": segment_size,
        "local_buffer_size": 16 << 20,
        **mooncake,
    }
    return {
        "name": f"node{index}",
        "regions": regions,
        "block_len": block_len,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "chunk_tokens": chunk_tokens,
        "loop": loop,
        "worker": worker or {},
        "mooncake": client,
    }


class NodeClient:
    """A running node process: :meth:`call` sends one request and waits (bounded) for its reply."""

    def __init__(
        self, world: ClusterWorld, index: int, config: dict[str, Any], *, ready_timeout: float = 60.0
    ):
        self.index = index
        self.name = config["name"]
        self.address = world.node_address(index)
        self.config = config
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._ready: Future[dict[str, Any]] = Future()
        fd, log_name = tempfile.mkstemp(prefix=f"aiokv-{self.name}-", suffix=".log")
        self.log_path = Path(log_name)
        env = {**os.environ, **NODE_ENV, "MC_TCP_BIND_ADDRESS": self.address}
        argv = [sys.executable, "-m", "aiokv.testing.cluster.node", json.dumps(config)]
        self.process = world.nodes[index].popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, env=env, text=True, bufsize=1
        )
        os.close(fd)
        self._reader = threading.Thread(target=self._read, name=f"aiokv-{self.name}-reader", daemon=True)
        self._reader.start()
        try:
            self._ready.result(ready_timeout)
        except (FutureTimeout, NodeError) as exc:
            self.kill()
            raise NodeError(
                f"{self.name} did not start within {ready_timeout:.0f} s: {self.log_tail()}"
            ) from exc

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _read(self) -> None:
        stdout = self.process.stdout
        if stdout is None:
            raise RuntimeError("the node was started without a stdout pipe")
        for line in stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s wrote a non-JSON line: %r", self.name, line[:200])
                continue
            if "ready" in message:
                self._ready.set_result(message)
                continue
            with self._lock:
                future = self._pending.pop(message.get("id"), None)
            if future is not None:
                future.set_result(message)
        # EOF: the node is gone; everything still waiting fails now rather than at its timeout.
        error = NodeError(f"{self.name} (pid {self.pid}) exited")
        if not self._ready.done():
            self._ready.set_exception(error)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            future.set_exception(error)

    def submit(self, op: str, **args: Any) -> Future[dict[str, Any]]:
        """Send a request; the future gets the reply (or ``NodeError`` when the node dies)."""
        request_id = next(self._ids)
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            self._pending[request_id] = future
        try:
            if self.process.stdin is None:
                raise ValueError("no stdin pipe")
            self.process.stdin.write(json.dumps({"id": request_id, "op": op, **args}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            raise NodeError(f"{self.name} is gone") from exc
        return future

    def call(self, op: str, *, wait_s: float = 120.0, **args: Any) -> dict[str, Any]:
        """One request's reply (``ok``, ``result`` or ``error``, ``elapsed_s``), waited at most ``wait_s``."""
        future = self.submit(op, **args)
        try:
            return future.result(wait_s)
        except FutureTimeout as exc:
            raise NodeError(f"{self.name}: {op} got no reply within {wait_s:.0f} s") from exc

    def result(self, op: str, *, wait_s: float = 120.0, **args: Any) -> Any:
        """The result of a request that must succeed."""
        reply = self.call(op, wait_s=wait_s, **args)
        if not reply["ok"]:
            raise NodeError(f"{self.name}: {op} failed: {reply['error']}: {reply['message']}")
        return reply["result"]

    def kill(self) -> None:
        """SIGKILL the node (a crash: its Mooncake segment vanishes without unmounting)."""
        stop_process(self.process, 0.0, signal.SIGKILL)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the node to close its worker and client and exit; kill it past ``timeout``."""
        if self.process.poll() is None:
            try:
                self.submit("exit")
                self.process.stdin.close()  # type: ignore[union-attr]
            except (NodeError, BrokenPipeError, OSError):
                pass
            deadline = time.monotonic() + timeout
            try:
                self.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(self.process, 5.0, signal.SIGKILL)
        self._reader.join(5)
        self.log_path.unlink(missing_ok=True)


class Cluster:
    """A started :class:`ClusterWorld` and the nodes started in it; a context manager.
    :meth:`close` kills every node, then closes the world (everything by pid).

    ``Cluster(3, master_args=["--default_kv_lease_ttl=500"])`` builds and starts the world (raises if it
    cannot: check :func:`~aiokv.testing.cluster.world.world_unavailable_reason` first);
    ``cluster.node(0, segment_size=64 << 20)`` starts node 0 (options: :func:`node_config`; nodes with
    an odd index run uvloop unless ``loop`` says otherwise).
    """

    def __init__(self, nodes: int = 3, *, master_args: Sequence[str] = ()) -> None:
        self.world = ClusterWorld(nodes, master_args=master_args).start()
        self.nodes: dict[int, NodeClient] = {}

    def node(self, index: int, **config: Any) -> NodeClient:
        config.setdefault("loop", "uvloop" if index % 2 else "asyncio")
        client = NodeClient(self.world, index, node_config(self.world, index, **config))
        self.nodes[index] = client
        return client

    def close(self) -> None:
        # Killed, not closed: Mooncake's close takes 1-2 s per client and the master goes with them.
        for client in self.nodes.values():
            client.kill()
            client.close(timeout=1)
        self.nodes.clear()
        self.world.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
