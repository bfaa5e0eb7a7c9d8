"""Turning caller-supplied integer sequences into checked int64 NumPy arrays.

Every public entry point funnels its integer arguments through here, so that floats, NaN, bools,
strings and values past int64 are refused with a message naming the argument, before any address is
computed or anything reaches native code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import InvalidRequestError

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
IntArrayLike = Sequence[int] | Sequence[Sequence[int]] | npt.NDArray[np.integer[Any]]

_INT64_MAX = np.iinfo(np.int64).max
# Timeouts at least this long (about 31 years) mean no deadline.
NO_DEADLINE_AFTER_S = 1e9


class NonIntegerError(InvalidRequestError, TypeError):
    """Values that are not integers (floats, NaN, bools, strings): a ``ValueError`` as the spec asks,
    and still a ``TypeError`` for callers that caught that before."""


def as_int64_array(value: object, name: str, *, ndim: int | None = None) -> IntArray:
    """Return ``value`` as an int64 array, or raise ``TypeError``/``InvalidRequestError``.

    A non-sequence is a ``TypeError``; non-integer elements raise :class:`NonIntegerError` (both).

    Accepts NumPy integer arrays (any width; unsigned values past int64 are refused) and sequences of
    Python ints. ``ndim`` pins the number of dimensions (an empty sequence is accepted for any).
    """
    if isinstance(value, (str, bytes, bytearray, memoryview)) or np.isscalar(value):
        raise TypeError(f"{name} must be a sequence or array of integers, not {type(value).__name__}")
    if isinstance(value, np.ndarray):
        array: np.ndarray = value
    else:
        try:
            array = np.asarray(value)
        except (OverflowError, ValueError) as exc:
            raise InvalidRequestError(f"{name} is not a regular array of int64 integers: {exc}") from exc
    if array.dtype.kind == "u":
        if array.size and int(array.max()) > _INT64_MAX:
            raise InvalidRequestError(f"{name} has a value past the int64 range")
    elif array.dtype.kind != "i":
        if array.size == 0 and array.dtype.kind == "f":
            # np.asarray([]) is float64; an empty sequence holds no wrong value.
            array = array.astype(np.int64)
        elif _only_ints(value, array):
            # NumPy made floats or objects of Python ints because one is past int64 ([0, 2**63] is
            # float64): name the range, not a dtype the caller never used.
            raise InvalidRequestError(f"{name} must hold integers within int64 (found one past that range)")
        elif array.dtype.kind == "O":
            raise InvalidRequestError(
                f"{name} must hold integers within int64 (found values NumPy cannot store as integers)"
            )
        else:
            raise NonIntegerError(f"{name} must hold integers, found dtype {array.dtype}")
    if ndim is not None and array.ndim != ndim and not (array.size == 0 and array.ndim == 1):
        raise InvalidRequestError(f"{name} must be {ndim}-dimensional, got shape {array.shape}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _only_ints(value: object, array: np.ndarray) -> bool:
    """True when ``value`` (a sequence, not an array) that NumPy stored as floats or objects holds
    only ints (only in the error path: it walks every element)."""
    if isinstance(value, np.ndarray) or array.dtype.kind not in "fO":
        return False
    items = np.asarray(value, dtype=object).ravel().tolist()
    return all(isinstance(item, (int, np.integer)) for item in items)


def as_timeout(value: object, name: str = "timeout") -> float | None:
    """A request timeout in seconds as a float, or None for no deadline.

    Any real number > 0 is accepted (Python or NumPy, int or float); ``None``, ``math.inf`` and values
    too large for a float or past :data:`NO_DEADLINE_AFTER_S` mean no deadline, the same on every event
    loop (asyncio's ``call_later`` overflows on them, uvloop's does not). Bools, NaN, 0, negatives and
    non-numbers are refused.
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidRequestError(f"{name} must be a positive number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past the float range: a deadline nobody will see
        return None
    if not seconds > 0:  # also refuses NaN
        raise InvalidRequestError(f"{name} must be a positive number of seconds, got {value!r}")
    return None if seconds >= NO_DEADLINE_AFTER_S else seconds


def as_positive_int(value: object, name: str) -> int:
    """Return ``value`` as a Python int > 0, refusing bools, floats and anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    result = int(value)
    if result <= 0:
        raise InvalidRequestError(f"{name} must be positive, got {result}")
    if result > _INT64_MAX:
        # Sizes and counts meet int64 arithmetic later (addresses, NumPy), where they would overflow.
        raise InvalidRequestError(f"{name} must fit in int64, got {result}")
    return result
