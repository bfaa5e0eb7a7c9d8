"""GIL held by one request on the Mooncake path, per layout, for :mod:`benchmarks.layouts`: the pieces
(``regions_for_chunks``, MooncakeBackend's own Python, the binding's conversion), for the call form the
backend takes and for the multi-buffer form as the baseline, in one run."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from aiokv._arrays import IntArray
from aiokv.backends._regions import RegisteredMemory
from aiokv.backends.mooncake_calls import CallForm, call_form, prove
from aiokv.keys import KeyNamespace, chunk_hashes

from .gil import best_ms as _best_ms
from .layout_caches import VOCAB, LayoutCache, Scenario


class ConversionProbe:
    """A raw ``mooncake.store`` client: ``convert(form, keys)`` hands the binding a call's argument lists
    with one key more than they have, which it converts (holding the GIL) and then refuses with -600
    per key for the length mismatch, moving nothing and asking nothing of the master."""

    def __init__(self, master_address: str) -> None:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address)
        if rc != 0:
            raise RuntimeError(f"mooncake setup for the conversion probe failed: {rc}")

    def convert(self, form: CallForm, keys_and_one: list[str]) -> None:
        codes = list(form.get(self.store, keys_and_one, False))
        if codes != [-600] * len(keys_and_one):
            raise RuntimeError(f"the conversion probe answered {sorted(set(codes))}, expected only -600")

    def close(self) -> None:
        self.store.close()


def _memory_of(cache: LayoutCache) -> RegisteredMemory:
    memory = RegisteredMemory()
    for array in cache.arrays:
        memory.add(array.ctypes.data, array.nbytes)
    return memory


def gil_per_request(
    cache: LayoutCache,
    matrix: IntArray,
    keys: list[str],
    max_regions_per_call: int,
    probe: ConversionProbe | None,
    repeats: int,
) -> dict[str, Any]:
    """GIL-held pieces of one request on the Mooncake path in ms (best of ``repeats``, summed over the
    request's calls, split as the worker splits them): ``prepare`` (``regions_for_chunks``),
    ``backend`` (MooncakeBackend's own Python: the keys' checks, the memory proof, the lists of the form
    it calls, the answers; :mod:`aiokv.backends.mooncake_calls`), and ``conversion`` (the binding
    converting keys and lists; Mooncake only). The ``multi_`` figures: the same with the multi-buffer
    form every call took before (the baseline, same run)."""
    layout = cache.layout
    prepare_ms = _best_ms(lambda: layout.regions_for_chunks(matrix), repeats)
    memory = _memory_of(cache)
    calls: list[tuple[list[str], IntArray, IntArray]] = []
    for batch in layout.regions_for_chunks(matrix):
        per_call = max(1, max_regions_per_call // batch.addrs.shape[1])
        calls.extend(
            (
                [keys[r] for r in batch.rows[s : s + per_call].tolist()],
                batch.addrs[s : s + per_call],
                batch.sizes[s : s + per_call],
            )
            for s in range(0, batch.rows.size, per_call)
        )

    def backend_part(
        call_keys: list[str], addrs: IntArray, sizes: IntArray, answers: list[int], multi: bool
    ) -> CallForm:
        proven = prove(memory, "put", call_keys, addrs, sizes)
        form = call_form(proven, "put", prefer_same_node=multi)  # the option rules the flat form out
        form.get_answers(answers)
        return form

    figures: dict[str, Any] = {"prepare_ms": prepare_ms, "calls": len(calls)}
    for prefix, multi in (("", False), ("multi_", True)):
        backend_ms, conversion_ms, flat = 0.0, 0.0, True
        for call_keys, addrs, sizes in calls:
            answers = sizes.sum(axis=1).tolist()  # a get's answers as the store gives them
            part = functools.partial(backend_part, call_keys, addrs, sizes, answers, multi)
            backend_ms += _best_ms(part, repeats)
            form = part()
            flat = flat and form.flat
            if probe is not None:
                convert = functools.partial(probe.convert, form, [*call_keys, "aiokv-probe-one-more"])
                conversion_ms += _best_ms(convert, repeats)
        figures[f"{prefix}backend_ms"] = backend_ms
        figures[f"{prefix}conversion_ms"] = conversion_ms if probe is not None else None
        figures[f"{prefix}total_ms"] = prepare_ms + backend_ms + conversion_ms
        figures[f"{prefix}flat"] = flat
    return figures


def request_keys(cache: LayoutCache, s: Scenario) -> list[str]:
    """One request's keys as the worker names them (namespace prefix, chunk hashes)."""
    prefix = KeyNamespace("aiokv-layouts-gil").prefix(cache.layout.fingerprint, 0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=s.tokens, dtype=np.int64)
    return [prefix + h for h in chunk_hashes(tokens, s.chunk_tokens)]
