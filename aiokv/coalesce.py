"""Coalescing: which pieces of a chunk's value are adjacent in memory for every chunk of a length.

Stores are charged per (address, size) pair (Mooncake converts each pair holding the GIL, and its TCP
transport moves one slice per pair), so pieces adjacent in memory in value order are sent as one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._arrays import IntArray


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How a chunk of ``per_chunk`` consecutive blocks starting at block ``b`` splits into runs of
    adjacent bytes: run ``r`` is at ``offsets[r] + b * strides[r]``, ``sizes[r]`` bytes long.

    Built once per chunk length from the geometry alone: two pieces merge only when they are adjacent
    for every ``b`` (equal strides and the second's offset at the first's end), so the plan holds for
    every chunk and the value bytes are those of the unmerged pieces in the same order.
    """

    offsets: IntArray
    strides: IntArray
    sizes: IntArray

    @staticmethod
    def build(base: IntArray, lens: IntArray, strides: IntArray, per_chunk: int) -> RunPlan:
        runs: list[list[int]] = []  # [offset, stride, size]
        for addr, blen, stride in zip(base.tolist(), lens.tolist(), strides.tolist(), strict=True):
            # A region's blocks are one piece when they sit back to back, else one piece per block.
            pieces = (
                [(addr, blen * per_chunk)]
                if stride == blen
                else [(addr + j * stride, blen) for j in range(per_chunk)]
            )
            for offset, size in pieces:
                last = runs[-1] if runs else None
                if last is not None and last[1] == stride and last[0] + last[2] == offset:
                    last[2] += size
                else:
                    runs.append([offset, stride, size])
        table = np.array(runs, dtype=np.int64).reshape(-1, 3)
        columns = [np.ascontiguousarray(table[:, c]) for c in range(3)]
        for column in columns:
            column.flags.writeable = False
        return RunPlan(*columns)
