"""The backend protocol: the cut below which nothing knows about requests, tokens or groups.

A backend speaks plain primitives: string keys, per-key (address, size) regions, integer status
codes (:mod:`aiokv.codes`). The value of a key is the concatenation of its regions. Calls are
synchronous and made from the worker's executor threads, never on the event loop.

:class:`Backend` names every method and attribute the worker uses; the optional ones have documented
defaults, read through :func:`backend_traits`. :func:`check_backend` checks an object against it.
The safety helpers every backend uses (:class:`RegionTable`, :class:`RegisteredMemory`) live in
:mod:`aiokv.backends._regions` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Protocol, Self, runtime_checkable

from ..codes import Code, code_name
from ._regions import Regions, RegionTable, RegisteredMemory, check_keys

# A binding converting this many (address, size) pairs holds the GIL ~1.5 ms (Mooncake, measured).
DEFAULT_REGIONS_PER_CALL: Final = 16384
# The most keys one call carries, whatever its pairs: a backend's per-key Python work holds the GIL for
# the whole call, and the garbage collector walks the call's per-key containers (a 62,500-key put on
# the embedded backend: 6-9 ms per collection of its young lists and sets; 8,192 keys: about 1 ms).
MAX_KEYS_PER_CALL: Final = 4096
# The least a call split across transfer threads moves: below it, one more call costs more than the
# parallel copy saves (a call costs ~0.1-1 ms of bookkeeping; 4 MiB copies in about that).
MIN_SPLIT_BYTES: Final = 4 << 20

REQUIRED_METHODS: Final = ("register_buffer", "batch_exists", "batch_put", "batch_get", "close")

__all__ = [
    "DEFAULT_REGIONS_PER_CALL",
    "MAX_KEYS_PER_CALL",
    "MIN_SPLIT_BYTES",
    "REQUIRED_METHODS",
    "Backend",
    "BackendTraits",
    "Code",
    "RegionTable",
    "Regions",
    "RegisteredMemory",
    "backend_traits",
    "check_backend",
    "check_keys",
    "keys_per_call",
    "code_name",
]


@runtime_checkable
class Backend(Protocol):
    """What a store must offer aiokv. All methods are blocking and thread-safe.

    Optional members (a backend may leave them out; the worker then uses the default):

    - ``unregister_buffer(addr: int) -> None``: forget a buffer registered at ``addr``; called on the
      worker's close once no call touches it. Default: not called.
    - ``max_regions_per_call: int``: the most (address, size) pairs one batch call should carry (what
      the binding converts while it holds the GIL). Default: :data:`DEFAULT_REGIONS_PER_CALL`.
    - ``supports_device_memory: bool``: whether the backend can move device (non-host) memory. Default:
      False, and the worker then refuses a layout whose ``device`` is not ``"cpu"``.
    - ``exists_in_process: bool``: ``batch_exists`` answers from this process's memory at once (no
      I/O, no wait for another call): the worker then answers lookups on the event loop instead of
      handing each to a thread (a thread needing the GIL behind a busy loop waits for it, often
      for milliseconds). Default: False.

    - ``read_lease_s: float``: ``batch_exists`` grants each key it finds a read lease of this many
      seconds (the store neither evicts it nor removes it without ``force`` meanwhile, and no call ends
      the lease early), so a lookup's hit stays loadable until the load. The worker then bounds what its
      lookups hold (:class:`aiokv.leases.LeaseBudget`), counting each found chunk this long. Default: 0,
      no leases (nothing counted).
    - ``batch_remove(keys: Sequence[str], *, force: bool = False) -> list[int]``: drop keys; per key 0,
      ``NOT_FOUND`` (-704) if absent, or a negative code. ``force`` ignores read leases. The worker
      calls it (``force=True``) before rewriting keys that exist but whose reads failed (a dead
      writer's keys). Default: not called; a store then reports such chunks failed
      (``TRANSFER_FAILED``) instead of skipping them.

    Extras the worker never calls (``closed``, ``valid_keys``, ...) are each backend's own.
    """

    def register_buffer(self, addr: int, size: int) -> None:
        """Allow transfers from and to ``[addr, addr + size)``; raises on failure."""
        ...

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; raises ``BackendError`` if the store cannot answer.

        ``worker.lookup`` answers with it, and an engine loads what a lookup found a few milliseconds
        later: a store that evicts should keep each key it answers present for a while (Mooncake grants
        its read lease, ``default_kv_lease_ttl``, 10 s by default). Without that a load still reports a
        chunk evicted in between as failed, never its bytes as loaded.
        """
        ...

    def batch_put(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        """Store each key's regions; per key ``>= 0`` on success, else a negative code.

        A key that already exists keeps its old value (and reports success). So does a key another
        writer is still writing, possibly before its bytes are readable: ``batch_exists`` must answer
        True only for keys whose bytes are all readable, as the worker confirms puts with it.
        """
        ...

    def batch_get(self, keys: Sequence[str], addrs: Regions, sizes: Regions) -> list[int]:
        """Read each key into its regions; per key the bytes read, or a negative code."""
        ...

    def close(self) -> None:
        """Release the store's resources; later calls raise ``BackendError``. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class BackendTraits:
    """A backend's optional protocol members, defaults filled in."""

    max_regions_per_call: int
    supports_device_memory: bool
    exists_in_process: bool
    read_lease_s: float
    can_unregister: bool
    can_remove: bool


def check_backend(backend: object) -> None:
    """Raise ``TypeError`` naming every required method ``backend`` lacks, or an optional member of
    the wrong type."""
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(backend, name, None))]
    if missing:
        names = ", ".join(f"{name}()" for name in missing)
        plural = "s" if len(missing) > 1 else ""
        raise TypeError(f"backend {type(backend).__name__} has no {names} method{plural} (see aiokv.Backend)")
    for optional in ("unregister_buffer", "batch_remove"):
        method = getattr(backend, optional, None)
        if method is not None and not callable(method):
            raise TypeError(f"backend {type(backend).__name__}: {optional} must be a method")
    for flag in ("supports_device_memory", "exists_in_process"):
        value = getattr(backend, flag, False)
        if not isinstance(value, bool):
            raise TypeError(f"backend {type(backend).__name__}: {flag} must be a bool, not {value!r}")
    lease = getattr(backend, "read_lease_s", 0.0)
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0 <= lease < float("inf"):
        raise TypeError(f"backend {type(backend).__name__}: read_lease_s must be seconds >= 0, not {lease!r}")


def backend_traits(backend: Backend) -> BackendTraits:
    """The optional members of a backend :func:`check_backend` accepted, with their defaults."""
    return BackendTraits(
        max_regions_per_call=getattr(backend, "max_regions_per_call", DEFAULT_REGIONS_PER_CALL),
        supports_device_memory=getattr(backend, "supports_device_memory", False),
        exists_in_process=getattr(backend, "exists_in_process", False),
        read_lease_s=float(getattr(backend, "read_lease_s", 0.0)),
        can_unregister=callable(getattr(backend, "unregister_buffer", None)),
        can_remove=callable(getattr(backend, "batch_remove", None)),
    )


def keys_per_call(
    max_regions_per_call: int, regions_per_key: int, *, keys: int = 1, total_bytes: int = 0, threads: int = 1
) -> int:
    """How many keys of ``regions_per_key`` regions one batch call carries: whole keys, at most
    ``max_regions_per_call`` regions and :data:`MAX_KEYS_PER_CALL` keys, and at least one key. The
    worker splits every call by this rule.

    A large move (``keys`` keys of ``total_bytes`` in all) is also cut into a whole number of rounds
    over the ``threads`` transfer threads, when each call then still moves at least
    :data:`MIN_SPLIT_BYTES`: the copies of one batch use every thread (backends copy with the GIL
    released) instead of one call copying alone while the other threads idle.
    """
    per_call = max(1, min(MAX_KEYS_PER_CALL, max_regions_per_call // max(1, regions_per_key)))
    if threads > 1 and keys > 1:
        calls = -(-keys // per_call)
        balanced = -(-calls // threads) * threads
        if total_bytes >= balanced * MIN_SPLIT_BYTES:
            per_call = max(1, -(-keys // balanced))
    return per_call


class ClosingContext:
    """``with backend:`` closes the backend on exit (the embedded and the Mooncake backend alike)."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
