"""Former home of the reference implementations (old imports keep working): see :mod:`.reference`."""

from __future__ import annotations

from .reference import reference_prepare_value, writeup_prepare_values

__all__ = ["reference_prepare_value", "writeup_prepare_values"]
