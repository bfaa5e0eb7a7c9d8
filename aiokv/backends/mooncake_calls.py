"""What a Mooncake transfer hands the binding: the proof of every region, then the call form.

:func:`prove` checks a batch's keys and proves each key's regions inside registered memory; only the
keys that pass reach a native call (:class:`ProvenBatch`). :func:`call_form` then picks how they go:

* ``batch_put_from`` / ``batch_get_into`` (one address and size per key, flat lists) when every key has
  exactly one region: the binding converts flat lists ~2.5x faster while it holds the GIL
  (docs/layouts.md), the block-major case;
* ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` (a list of regions per key) else.

Both forms answer the same codes (measured against the store, tests/test_mooncake_backend.py), except
where the flat form differs, which :class:`CallForm` rules out or maps back:

* a get into a region larger than the value: the flat form reads the value and answers its size, the
  multi-buffer form answers -800: mapped to -800 (the region's first bytes may have been written,
  as a failed get may write its regions in either form);
* a put of a key twice in one batch: the flat form keeps the last value, the multi-buffer form the
  first: such a put takes the multi-buffer form;
* ``prefer_alloc_in_same_node``: the flat put refuses it (-600) and the flat get has no such argument:
  with it set, every call takes the multi-buffer form.

A get naming a key twice fills only one of its regions in either form, yet answers success for both:
such a get is made in rounds of distinct keys (:func:`distinct_rounds`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import IntArray
from ..codes import Code
from ._copies import select_keys
from ._regions import Regions, RegionTable, RegisteredMemory, check_keys

logger = logging.getLogger("aiokv.backends.mooncake")

_INVALID = int(Code.INVALID)
_TRANSFER_FAILED = int(Code.TRANSFER_FAILED)

Lists = list[int] | list[list[int]]


def region_lists(table: RegionTable, rows: IntArray | None) -> tuple[list[list[int]], list[list[int]]]:
    """Per-key lists of Python ints for the keys ``rows`` (all when None).

    Lists of Python ints are what the binding converts fastest: even counting ``tolist``, passing
    arrays is ~2.5x slower (docs/benchmarks.md, "Mooncake argument conversion"). When every key has
    the same sizes (the worker's broadcast ``sizes``) one row is built and shared by all keys.
    """
    counts = np.diff(table.offsets)
    if counts.size and counts[0] > 0 and bool((counts == counts[0]).all()):
        width = int(counts[0])
        addrs = table.addrs.reshape(-1, width)
        sizes = table.sizes.reshape(-1, width)
        if rows is not None:
            addrs, sizes = addrs[rows], sizes[rows]
        if bool((sizes == sizes[0]).all()):
            return addrs.tolist(), [sizes[0].tolist()] * len(sizes)
        return addrs.tolist(), sizes.tolist()
    flat_addrs, flat_sizes, bounds = table.addrs.tolist(), table.sizes.tolist(), table.offsets.tolist()
    selected = range(table.num_keys) if rows is None else rows.tolist()
    return (
        [flat_addrs[bounds[k] : bounds[k + 1]] for k in selected],
        [flat_sizes[bounds[k] : bounds[k + 1]] for k in selected],
    )


@dataclass(frozen=True, slots=True)
class ProvenBatch:
    """The keys of a batch whose regions all lie in registered memory (``rows`` of the caller's keys,
    all of them when ``subset`` is None), and the codes of the whole batch: -600 for every other key,
    the proven rows' to be filled in by the caller."""

    rows: Sequence[int]
    keys: list[str]
    table: RegionTable
    subset: IntArray | None
    codes: list[int]

    def region_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        return region_lists(self.table, self.subset)

    def proven_table(self) -> RegionTable:
        """The proven keys' regions alone, in their order."""
        return self.table if self.subset is None else select_keys(self.table, self.subset)

    def flat_regions(self) -> tuple[list[int], list[int]] | None:
        """One address and one size per proven key, or None when a key has more than one region."""
        table = self.table
        if table.addrs.size != table.num_keys:  # every key has at least one region (proven)
            return None
        addrs, sizes = table.addrs, table.sizes
        if self.subset is not None:
            addrs, sizes = addrs[self.subset], sizes[self.subset]
        if sizes.size and bool((sizes == sizes[0]).all()):
            return addrs.tolist(), [int(sizes[0])] * sizes.size
        return addrs.tolist(), sizes.tolist()


def prove(
    memory: RegisteredMemory, call: str, keys: Sequence[str], addrs: Regions, sizes: Regions
) -> ProvenBatch:
    """Check ``keys`` (raising on bad ones) and prove every key's regions inside ``memory``."""
    check_keys(keys)
    table = RegionTable.from_arguments(keys, addrs, sizes)
    rows = np.flatnonzero(memory.valid_keys(table))
    codes = [_INVALID] * table.num_keys
    if rows.size == table.num_keys:
        return ProvenBatch(range(table.num_keys), list(keys), table, None, codes)
    logger.warning(
        "Mooncake %s: %d of %d keys have no regions or regions outside registered memory; "
        "answered %d without calling Mooncake",
        call,
        table.num_keys - rows.size,
        table.num_keys,
        _INVALID,
    )
    row_list = rows.tolist()
    return ProvenBatch(row_list, [keys[k] for k in row_list], table, rows, codes)


@dataclass(frozen=True, slots=True)
class CallForm:
    """The argument lists of one transfer and the binding's method for them."""

    flat: bool
    addrs: Lists
    sizes: Lists

    @property
    def put_name(self) -> str:
        return "batch_put_from" if self.flat else "batch_put_from_multi_buffers"

    @property
    def get_name(self) -> str:
        return "batch_get_into" if self.flat else "batch_get_into_multi_buffers"

    def only(self, positions: Sequence[int]) -> CallForm:
        """The same form for the keys at ``positions`` (a put's retry)."""
        addrs: Any = [self.addrs[k] for k in positions]
        sizes: Any = [self.sizes[k] for k in positions]
        return CallForm(self.flat, addrs, sizes)

    def put(self, store: Any, keys: list[str], replicate: Any) -> Sequence[int]:
        method: Callable[..., Sequence[int]] = getattr(store, self.put_name)
        return method(keys, self.addrs, self.sizes, replicate)

    def get(self, store: Any, keys: list[str], prefer_same_node: bool) -> Sequence[int]:
        if self.flat:
            return store.batch_get_into(keys, self.addrs, self.sizes)  # type: ignore[no-any-return]
        return store.batch_get_into_multi_buffers(  # type: ignore[no-any-return]
            keys, self.addrs, self.sizes, prefer_same_node
        )

    def get_answers(self, native: Sequence[int]) -> list[int]:
        """The codes the multi-buffer form would answer (``native`` has one per key, checked)."""
        answers = list(native)
        if not self.flat or answers == self.sizes:  # the common case, compared in C
            return answers
        sizes: Any = self.sizes
        # A value smaller than its region: read and answered by its size here, -800 there.
        return [
            code if code < 0 or code == size else _TRANSFER_FAILED
            for code, size in zip(answers, sizes, strict=True)
        ]


def distinct_rounds(keys: list[str]) -> list[list[int]] | None:
    """None when no key repeats; else the positions of ``keys`` in rounds holding each key at most once
    (round i: every key's i-th occurrence). Mooncake reads a key given twice in one get into only the
    last of its regions yet answers success for both (measured, both forms): a get of repeated keys
    goes in one call per round."""
    if len(set(keys)) == len(keys):
        return None
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for position, key in enumerate(keys):
        occurrence = seen[key] = seen.get(key, -1) + 1
        if occurrence == len(rounds):
            rounds.append([])
        rounds[occurrence].append(position)
    return rounds


def call_form(batch: ProvenBatch, op: str, *, prefer_same_node: bool) -> CallForm:
    """The form a transfer of ``batch`` takes (``op`` "put" or "get"; see the module docstring)."""
    flat = None
    if not prefer_same_node and (op == "get" or len(set(batch.keys)) == len(batch.keys)):
        flat = batch.flat_regions()
    if flat is not None:
        return CallForm(True, *flat)
    return CallForm(False, *batch.region_lists())
