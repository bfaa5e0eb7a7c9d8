"""Start and stop a loopback-only ``mooncake_master`` from the installed ``mooncake`` package.

Tests, the benchmark CLI and the examples need a master of their own; this is the one place that knows
how to run it. Nothing here imports ``mooncake`` (finding the executable only locates the package), so
it is cheap to import and works on hosts where the native library cannot load.

The master is bound to 127.0.0.1, but some Mooncake sockets listen on all interfaces whatever is
configured: run it inside a private network namespace when nothing may leave the machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from .mooncake_config import INSTALL_HINT, parse_size

logger = logging.getLogger("aiokv.backends.mooncake")

HOST = "127.0.0.1"
EXECUTABLE_NAME = "mooncake_master"

# Ports picked by binding to port 0 can be taken by someone else before the master binds them.
_START_ATTEMPTS = 3


def find_master_executable(name: str = EXECUTABLE_NAME) -> Path:
    """The ``mooncake_master`` (or another of its executables, ``name``) shipped inside the installed
    ``mooncake`` package, else on ``PATH``."""
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which(name)
    if on_path is not None:
        return Path(on_path)
    raise FileNotFoundError(f"{name} not found in the mooncake package or on PATH: {INSTALL_HINT}")


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback TCP ports that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((HOST, 0))  # all held open together, so the kernel cannot hand out one twice
        return [int(sock.getsockname()[1]) for sock in socks]


def _terminate(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL once ``timeout`` has passed; always reaps the process."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning(
            "mooncake_master (pid %d) ignored SIGTERM for %.1f s; killing it", process.pid, timeout
        )
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()


class MooncakeMaster:
    """A ``mooncake_master`` child process on loopback ports; a context manager.

    Ports default to free ones picked at :meth:`start`; a stopped master can be started again on the
    same ports (clients reconnect to it, though it has lost every key). Its log goes to ``log_path``,
    or to a temporary file that :meth:`stop` deletes.
    """

    def __init__(
        self,
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout: float = 15.0,
        stop_timeout: float = 10.0,
        log_path: str | os.PathLike[str] | None = None,
        executable: str | os.PathLike[str] | None = None,
    ) -> None:
        if ready_timeout <= 0 or stop_timeout <= 0:
            raise ValueError("ready_timeout and stop_timeout must be positive")
        self._executable = Path(executable) if executable is not None else None
        self._given_rpc_port = rpc_port
        self._given_metrics_port = metrics_port
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.extra_args = tuple(extra_args)
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self._log_path = Path(log_path) if log_path is not None else None
        self._own_log = log_path is None
        self._process: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    # -- state ----------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``"127.0.0.1:PORT"``: what clients pass as ``master_server_address``."""
        if self.rpc_port is None:
            raise RuntimeError("the master has not been started")
        return f"{HOST}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        if self.metrics_port is None:
            raise RuntimeError("the master has not been started")
        return f"http://{HOST}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def log_tail(self, lines: int = 20) -> str:
        """The end of the master's log, for error messages."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with self._log_path.open("rb") as log:
            return b"".join(log.readlines()[-lines:]).decode(errors="replace")

    def command(self) -> list[str]:
        executable = self._executable or find_master_executable()
        return [
            str(executable),
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr=true",
            # Nothing else that listens: no HTTP metadata server (its default host is 0.0.0.0), no HA.
            "--enable_http_metadata_server=false",
            f"--http_metadata_server_host={HOST}",
            "--enable_ha=false",
            *self.extra_args,
        ]

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> MooncakeMaster:
        """Start the master and wait (bounded by ``ready_timeout``) until its RPC port answers."""
        if self.running:
            raise RuntimeError(f"mooncake_master is already running (pid {self.pid})")
        if self._executable is None:
            self._executable = find_master_executable()
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        # A restart keeps the ports of the last run (given or picked) so that clients reconnect.
        restart = self.rpc_port is not None and self.metrics_port is not None
        attempts = 1 if restart else _START_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if not restart:
                rpc_port, metrics_port = free_ports(2)
                self.rpc_port = self._given_rpc_port or rpc_port
                self.metrics_port = self._given_metrics_port or metrics_port
            if self._launch(self._log_path):
                return self
            logger.warning("mooncake_master exited at start (attempt %d of %d)", attempt, attempts)
        raise RuntimeError(f"mooncake_master did not start on {self.address}; log tail:\n{self.log_tail()}")

    def _launch(self, log_path: Path) -> bool:
        """Run the master once; True when its RPC port answers, False when it exited at start."""
        command = self.command()
        port = int(self.address.rpartition(":")[2])
        logger.debug("starting %s", " ".join(command))
        with log_path.open("ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self._process = process
        # Safety net: a master still running when the interpreter exits is stopped.
        self._finalizer = weakref.finalize(self, _terminate, process, self.stop_timeout)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self._finalizer.detach()
                return False
            try:
                with socket.create_connection((HOST, port), timeout=0.2):
                    logger.info("mooncake_master pid %d answers on %s", process.pid, self.address)
                    return True
            except OSError:
                time.sleep(0.02)
        message = (
            f"mooncake_master did not answer on {self.address} within {self.ready_timeout:.0f} s; "
            f"log tail:\n{self.log_tail()}"
        )
        self.stop()
        raise TimeoutError(message)

    def stop(self) -> None:
        """SIGTERM the master, SIGKILL it after ``stop_timeout``; idempotent."""
        process = self._process
        if process is not None:
            _terminate(process, self.stop_timeout)
            if self._finalizer is not None:
                self._finalizer.detach()
            logger.info("mooncake_master pid %d stopped (exit status %s)", process.pid, process.returncode)
        if self._own_log and self._log_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._log_path.unlink()
            self._log_path = None

    def kill(self) -> None:
        """SIGKILL the master at once (a crash, for fault tests); keeps its ports for a restart."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        if self._finalizer is not None:
            self._finalizer.detach()
        logger.info("mooncake_master pid %d killed", process.pid)

    def __enter__(self) -> MooncakeMaster:
        return self.start() if not self.running else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        where = self.address if self.rpc_port is not None else "no port yet"
        return f"MooncakeMaster({where}, {state})"


_HOLDER_SCRIPT = """
import sys
from aiokv import MooncakeBackend
backend = MooncakeBackend.from_master(sys.argv[1], global_segment_size=sys.argv[2])
print("ready", flush=True)
sys.stdin.read()  # until the parent closes our stdin
backend.close()
"""


@contextlib.contextmanager
def segment_holder(
    master_address: str, segment_size: int | str = "64MiB", *, graceful: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """Another process whose client mounts a global segment of ``segment_size`` on the master: the
    store's bytes live there, so this process's clients (pure clients, ``global_segment_size`` 0) and
    engines move every byte across processes, and the KV outlives whoever wrote it.

    ``graceful``: on exit close its stdin so it closes its client and exits (check ``returncode``);
    otherwise kill it (its segment's contents are no longer needed, and after its master died an
    unmount would wait out RPC timeouts).
    """
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER_SCRIPT, master_address, str(segment_size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        if holder.stdout is None or holder.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the process mounting a segment on {master_address} did not start")
        yield holder
        if graceful:
            holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)


@contextlib.contextmanager
def client_service(
    master_address: str, segment_size: int | str = "64MiB", *, log_path: str | os.PathLike[str] | None = None
) -> Iterator[str]:
    """Mooncake's client service (``mooncake_client``) on loopback, mounting ``segment_size`` on the
    master; yields its ``"host:port"`` for ``MooncakeConfig.client_service``. Clients attached to it
    share memory with it, so it must run on their host (and in their network namespace: it announces
    itself on an abstract Unix socket). Killed on exit: its segment's contents are not needed after,
    but the master keeps the segment listed for a while and places new puts on it (they fail -800), so
    a service started on a master that outlives it should mount none (``segment_size=0``: the values
    then live in the other segments, reached over TCP).
    """
    port = free_ports(1)[0]
    command = [
        str(find_master_executable("mooncake_client")),
        f"--master_server_address={master_address}",
        "--metadata_server=P2PHANDSHAKE",
        f"--host={HOST}",
        f"--port={port}",
        f"--global_segment_size={parse_size(segment_size, 'segment_size')}",
        "--local_buffer_size=0",
    ]
    with open(log_path or os.devnull, "ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 30
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"mooncake_client exited {process.returncode} before answering")
                try:
                    with socket.create_connection((HOST, port), timeout=0.2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"mooncake_client did not answer on {HOST}:{port}") from None
                    time.sleep(0.02)
            logger.info("mooncake_client pid %d answers on %s:%d", process.pid, HOST, port)
            yield f"{HOST}:{port}"
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(30)
