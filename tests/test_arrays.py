"""The integer-argument funnel every public entry point goes through."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv import InvalidRequestError
from aiokv._arrays import NonIntegerError, as_int64_array, as_positive_int


@pytest.mark.parametrize(
    "value",
    [[1, 2, 3], (1, 2, 3), np.array([1, 2, 3], dtype=np.uint8), np.array([1, 2, 3], dtype=np.int32)],
)
def test_integer_inputs_become_contiguous_int64(value: object) -> None:
    out = as_int64_array(value, "x")
    assert out.dtype == np.int64 and out.flags.c_contiguous
    assert out.tolist() == [1, 2, 3]


def test_strided_array_is_made_contiguous() -> None:
    out = as_int64_array(np.arange(10, dtype=np.int64)[::3], "x")
    assert out.flags.c_contiguous and out.tolist() == [0, 3, 6, 9]


def test_empty_sequence_is_int64_of_any_declared_ndim() -> None:
    assert as_int64_array([], "x", ndim=2).dtype == np.int64
    assert as_int64_array([], "x", ndim=1).shape == (0,)


@pytest.mark.parametrize(
    "value",
    [[1.0, 2.0], [1, float("nan")], [True, False], np.array([1.5]), ["1", "2"], np.array([1 + 2j])],
)
def test_non_integer_values_are_value_and_type_errors(value: object) -> None:
    with pytest.raises(NonIntegerError, match="x must hold integers") as info:
        as_int64_array(value, "x")
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    assert isinstance(info.value, InvalidRequestError)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1, 2**64], "x must hold integers within int64"),
        # NumPy turns this mix into float64; refused all the same (the message names the dtype).
        ([-1, 2**63], "x must hold integers"),
        (np.array([2**63], dtype=np.uint64), "x has a value past the int64 range"),
        ([1, None], "x must hold integers within int64"),
        ([[1, 2], [3]], "x is not a regular array"),
    ],
)
def test_out_of_range_or_ragged_values(value: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        as_int64_array(value, "x")


def test_largest_uint64_that_fits_is_accepted() -> None:
    top = np.iinfo(np.int64).max
    assert as_int64_array(np.array([top], dtype=np.uint64), "x").tolist() == [top]


@pytest.mark.parametrize("value", ["123", b"12", 5, 5.0, np.int64(5)])
def test_scalars_and_strings_are_type_errors(value: object) -> None:
    with pytest.raises(TypeError, match="x must be a sequence or array of integers"):
        as_int64_array(value, "x")


def test_ndim_is_enforced() -> None:
    with pytest.raises(InvalidRequestError, match=r"x must be 1-dimensional, got shape \(1, 2\)"):
        as_int64_array([[1, 2]], "x", ndim=1)


def test_as_positive_int() -> None:
    assert as_positive_int(np.int32(7), "n") == 7
    assert type(as_positive_int(np.int32(7), "n")) is int
    for bad in (True, 7.0, "7", None):
        with pytest.raises(TypeError, match="n must be an int"):
            as_positive_int(bad, "n")
    for bad in (0, -3):
        with pytest.raises(InvalidRequestError, match="n must be positive"):
            as_positive_int(bad, "n")
