"""The one place where aiokv's exceptions live.

Hierarchy::

    AiokvError
    ├── InvalidRequestError (also ValueError)   bad input, caught before any backend call
    ├── WorkerClosedError                       submit after close(), or work failed by terminate()
    ├── TransferTimeoutError (also TimeoutError) a request's deadline passed
    └── BackendError                            a backend call raised or answered a fatal code
        └── BackendUnavailableError             the store (e.g. the Mooncake master) cannot be reached
"""

from __future__ import annotations


class AiokvError(Exception):
    """Base class of every error aiokv raises on purpose."""


class InvalidRequestError(AiokvError, ValueError):
    """An argument is wrong; raised before anything reaches a backend.

    Subclasses ``ValueError`` so callers that validate generically still catch it.
    """


class WorkerClosedError(AiokvError):
    """The worker is closing or closed and takes no more work."""


class TransferTimeoutError(AiokvError, TimeoutError):
    """A request's deadline passed.

    It is raised only once the backend no longer touches the request's memory.
    """


class BackendError(AiokvError):
    """A backend call failed as a whole (an exception, or a code that fails the batch).

    ``code`` is the backend's status code when there is one; the original exception, if any, is
    chained as ``__cause__``.
    """

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class BackendUnavailableError(BackendError):
    """The store cannot be reached (for Mooncake: the master at ``address``)."""

    def __init__(self, message: str, *, code: int | None = None, address: str | None = None) -> None:
        super().__init__(message, code=code)
        self.address = address


class _CircuitOpenError(BackendUnavailableError):
    """The worker's circuit breaker is open: the call was not sent to the store (see docs/reliability.md).

    Internal, hence private: requests never fail with it (refused stores and loads finish with their
    chunks failed ``UNAVAILABLE`` (-900) and lookups answer 0); it only marks refused calls inside the
    engine, so that the tracker tells a refusal from an error.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, code=-900)
