"""A private multi-node network world for Mooncake cluster tests and benchmarks.

One network namespace per machine (a master and N nodes), each joined to a bridge by a veth pair. The
bridge lives in a namespace of its own (the "switch"), so the namespace this process runs in is never
touched: no interface is added to it and nothing any node starts can reach beyond the world. Each
namespace is held open by a ``sleep`` process started with ``unshare -n``; programs are started inside
one with ``nsenter -t PID -n`` (which execs, so the pid we hold is the program's). Every process we start
is bounded: holders sleep at most ``lifetime_s``, and all children get SIGKILL when this process dies
(``PR_SET_PDEATHSIG``), so a crashed test leaves nothing behind. :meth:`ClusterWorld.close` stops
everything by pid, even after a failure half way through :meth:`ClusterWorld.start`.

It needs Linux, ``unshare``, ``nsenter`` and ``ip``, and the right to create network namespaces: real
root, or root inside a user namespace (``unshare -rn``, as ``scripts/test.sh`` runs the suite).
:func:`world_unavailable_reason` says, by trying, why it cannot run here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ...backends.mooncake_master import MooncakeMaster, find_master_executable

logger = logging.getLogger("aiokv.testing.cluster")

SUBNET = "10.77.0"
MASTER_HOST = f"{SUBNET}.254"
MASTER_RPC_PORT = 50051  # every namespace is private, so fixed ports are free
MASTER_METRICS_PORT = 9003
_TOOLS = ("unshare", "nsenter", "ip")
_PR_SET_PDEATHSIG = 1


# Resolved once in the parent: the child between fork and exec must not dlopen (another thread may hold
# the loader's lock at fork time).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def stop_process(process: subprocess.Popen[Any], timeout: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig``, SIGKILL after ``timeout``; always reaps. Only this pid is signalled."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            process.send_signal(sig)
        if sig == signal.SIGKILL:
            process.wait(10)
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored signal %d for %.1f s; killing it", process.pid, sig, timeout)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait(10)


class Namespace:
    """A network namespace held open by a bounded ``sleep``; programs run in it through ``nsenter``."""

    def __init__(self, name: str, lifetime_s: float) -> None:
        self.name = name
        self._holder = subprocess.Popen(
            ["unshare", "-n", "--", "sleep", str(int(lifetime_s))],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        self.pid = self._holder.pid
        # unshare execs sleep once the namespace exists: wait for that, so nsenter enters the new one.
        own = _netns_id("self")
        deadline = time.monotonic() + 10
        while True:
            if self._holder.poll() is not None:
                error = self._holder.stderr.read().decode(errors="replace") if self._holder.stderr else ""
                raise OSError(f"unshare -n failed for namespace {name}: {error.strip()}")
            try:
                if _netns_id(str(self.pid)) != own:
                    break
            except FileNotFoundError:
                pass  # exiting: poll() says so next time round
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"namespace {name} was not created within 10 s")
            time.sleep(0.005)

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-n", "--", *argv]

    def check(self, *argv: str, timeout: float = 10.0) -> str:
        """Run a short command in the namespace; raise with its stderr when it fails."""
        done = subprocess.run(
            self.command(argv), capture_output=True, text=True, timeout=timeout, preexec_fn=_die_with_parent
        )
        if done.returncode != 0:
            raise OSError(f"[{self.name}] {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(argv), preexec_fn=_die_with_parent, **options)

    def wait_port(self, host: str, port: int, timeout: float) -> None:
        """Until a TCP connect to ``host:port`` from inside the namespace succeeds."""
        probe = f"until (exec 3<>/dev/tcp/{host}/{port}) 2>/dev/null; do sleep 0.05; done"
        try:
            self.check("timeout", str(timeout), "bash", "-c", probe, timeout=timeout + 5)
        except OSError as exc:
            raise TimeoutError(f"nothing answered on {host}:{port} within {timeout:.0f} s") from exc

    def close(self) -> None:
        stop_process(self._holder, 5.0, signal.SIGKILL)


def _netns_id(pid: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@dataclass
class MasterProcess:
    """``mooncake_master`` in the master's namespace, on the world's address (restartable, freezable)."""

    namespace: Namespace
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None  # the master's log (kept across restarts), deleted by close()

    @property
    def address(self) -> str:
        return f"{MASTER_HOST}:{MASTER_RPC_PORT}"

    def command(self) -> list[str]:
        loopback = MooncakeMaster(
            rpc_port=MASTER_RPC_PORT, metrics_port=MASTER_METRICS_PORT, extra_args=self.extra_args
        ).command()
        # The same flags as the loopback master, bound to the world's address instead.
        return [arg.replace("=127.0.0.1", f"={MASTER_HOST}") for arg in loopback]

    def start(self, timeout: float = 15.0) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the master is already running")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="aiokv-cluster-master-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with self.log_path.open("ab") as log:
            self.process = self.namespace.popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self.namespace.wait_port(MASTER_HOST, MASTER_RPC_PORT, timeout)
        logger.info("mooncake_master pid %d answers on %s", self.process.pid, self.address)

    def kill(self) -> None:
        if self.process is not None:
            stop_process(self.process, 0.0, signal.SIGKILL)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 10.0)

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        self.stop()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def freeze(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)


class ClusterWorld:
    """The namespaces, the bridge, the links and the master; a context manager.

    ``nodes`` node namespaces ``node0..`` get addresses ``10.77.0.1..``; the master has ``10.77.0.254``.
    Node processes run in ``nodes[i]`` (started there by :class:`aiokv.testing.cluster.client.NodeClient`).
    """

    def __init__(self, nodes: int = 3, *, lifetime_s: float = 900.0, master_args: Sequence[str] = ()) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be 1..200, got {nodes}")
        self.num_nodes = nodes
        self.lifetime_s = lifetime_s
        self.master_args = tuple(master_args)
        self._namespaces: list[Namespace] = []
        self.switch: Namespace | None = None
        self.nodes: list[Namespace] = []
        self.master: MasterProcess | None = None

    def node_address(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def start(self) -> ClusterWorld:
        try:
            self.switch = self._namespace("switch")
            self.switch.check("ip", "link", "add", "br0", "type", "bridge")
            self.switch.check("ip", "link", "set", "br0", "up")
            master_ns = self._namespace("master")
            self._link(master_ns, "pm", MASTER_HOST)
            for index in range(self.num_nodes):
                namespace = self._namespace(f"node{index}")
                self._link(namespace, f"p{index}", self.node_address(index))
                self.nodes.append(namespace)
            self.master = MasterProcess(master_ns, self.master_args)
            self.master.start()
        except BaseException:
            self.close()
            raise
        return self

    def _namespace(self, name: str) -> Namespace:
        namespace = Namespace(name, self.lifetime_s)
        self._namespaces.append(namespace)
        return namespace

    def _link(self, namespace: Namespace, port: str, address: str) -> None:
        """A veth pair: ``port`` on the bridge, ``eth0`` with ``address`` inside ``namespace``."""
        if self.switch is None:
            raise RuntimeError("the switch namespace does not exist yet")
        self.switch.check(
            "ip",
            "link",
            "add",
            "name",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            str(namespace.pid),
        )
        self.switch.check("ip", "link", "set", port, "master", "br0", "up")
        namespace.check("ip", "addr", "add", f"{address}/24", "dev", "eth0")
        namespace.check("ip", "link", "set", "eth0", "up")
        namespace.check("ip", "link", "set", "lo", "up")

    def cut_link(self, index: int) -> None:
        """Take node ``index``'s bridge port down: its packets vanish, as when a machine loses power."""
        if self.switch is None:
            raise RuntimeError("the world is not started")
        self.switch.check("ip", "link", "set", f"p{index}", "down")

    def close(self) -> None:
        """Stop the master and every namespace holder, by pid; idempotent."""
        if self.master is not None:
            self.master.close()
        for namespace in reversed(self._namespaces):
            namespace.close()
        self._namespaces.clear()

    def __enter__(self) -> ClusterWorld:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


@functools.cache
def world_unavailable_reason() -> str | None:
    """Why a cluster world cannot be built here (found by trying), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install util-linux iproute2)"
    try:
        find_master_executable()
        from ...backends.mooncake_binding import import_store

        import_store()
    except (ImportError, FileNotFoundError) as exc:
        return f"Mooncake is not usable here: {exc}"
    probe: list[Namespace] = []
    try:
        probe.append(Namespace("probe-a", 30))
        probe.append(Namespace("probe-b", 30))
        probe[0].check(
            "ip",
            "link",
            "add",
            "name",
            "p0",
            "type",
            "veth",
            "peer",
            "name",
            "p1",
            "netns",
            str(probe[1].pid),
        )
    except (OSError, TimeoutError, subprocess.SubprocessError) as exc:
        return (
            "cannot create network namespaces and veth links here (needs root, or root in a user "
            f"namespace: unshare -rn): {exc}"
        )
    finally:
        for namespace in probe:
            namespace.close()
    return None
