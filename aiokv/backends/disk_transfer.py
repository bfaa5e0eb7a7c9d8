"""One value's bytes between registered memory and its file, for
:class:`~aiokv.backends.disk.DiskBackend`: the header and the value's checksum written with it, both
verified on read.

``O_DIRECT`` moves data between the disk and page-aligned memory only:

- reads into page-aligned regions (a KV cache's blocks usually are) move straight from the file into
  the caller's memory, only a value's last partial block goes through an aligned block of this
  backend's; so do writes of a value that is one aligned region;
- a value of several regions is written from an aligned staging buffer of up to 8 MiB per calling
  thread (gathered, then written): one contiguous ``O_DIRECT`` write ran 15-30% faster than a
  ``pwritev`` of the regions themselves (``python -m benchmarks.disk``, ``aligned`` against
  ``unaligned``), at the same CPU per GB;
- unaligned regions move through the staging buffer both ways (read, then copied). Measured, a direct
  read followed by our copy was faster than a buffered ``preadv`` straight into the regions and took
  a fraction of its CPU time (the page cache's path costs more than one copy), and it leaves the page
  cache to the engine;
- without ``O_DIRECT`` every read and write goes straight between the file and the regions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import xxhash

from .._arrays import BoolArray
from ..errors import BackendError
from ._regions import RegionTable, RegisteredMemory
from .disk_format import ALIGN, Header, aligned, data_offset, pack_header, parse_header
from .disk_io import O_DIRECT, STAGE_BYTES, Scratch, read_all, write_all

Pieces = list[tuple[int, int]]  # a value's regions as (offset in the mapped space, size), merged
Space = tuple[int, memoryview, npt.NDArray[np.uint8]]  # first registered address, views up to the end

_ZEROS = memoryview(bytes(ALIGN))


class MappedSpace:
    """The memory registered with the backend, and views over all of it, from the first registered
    address to the last end (see ``RegisteredMemory.address_space``)."""

    def __init__(self) -> None:
        self._memory = RegisteredMemory()
        self._space: Space | None = None

    def add(self, addr: int, size: int) -> None:
        self._memory.add(addr, size)
        self._map()

    def remove(self, addr: int) -> None:
        self._memory.remove(addr)
        self._map()

    def unmap(self) -> None:
        self._space = None

    def proven(self, table: RegionTable) -> tuple[Space | None, BoolArray]:
        """The mapped space, and per key whether all its regions lie in registered memory and in that
        view (a buffer registered after the view was taken is refused, not read past the view)."""
        space = self._space
        valid = self._memory.valid_keys(table)
        if space is None:
            return None, np.zeros(table.num_keys, dtype=bool)
        base, view, _ = space
        outside = (table.addrs < base) | (table.addrs - base > len(view) - table.sizes)
        if outside.any():
            counts = np.zeros(table.addrs.size + 1, dtype=np.int64)
            np.cumsum(outside, out=counts[1:])
            valid &= counts[table.offsets[1:]] == counts[table.offsets[:-1]]
        return space, valid

    def mapped(self) -> Space:
        space = self._space
        if space is None:
            raise BackendError("DiskBackend has no registered memory")
        return space

    def _map(self) -> None:
        space = self._memory.address_space()
        if space is None:
            self._space = None
            return
        base, array = space
        self._space = (base, memoryview(array).cast("B"), np.ctypeslib.as_array(array))


class DiskTransfer:
    """Writes and reads value files over ``space``'s views. ``direct``: with ``O_DIRECT``; ``fsync``:
    each file synced before its write returns."""

    def __init__(self, space: MappedSpace, *, direct: bool, fsync: bool) -> None:
        self._mapped = space.mapped
        self.direct = direct
        self._fsync = fsync
        self._scratch = Scratch()

    def write(self, temp: str, key: bytes, pieces: Pieces, value_bytes: int) -> None:
        """Create ``temp`` (which must not exist) holding the header and the value."""
        direct = self.direct
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
        fd = os.open(temp, flags, 0o644)
        try:
            if direct and (len(pieces) > 1 or not self._aligned(pieces)):
                self._write_staged(fd, key, pieces, value_bytes)
            else:
                self._write_in_place(fd, key, pieces, value_bytes, direct)
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, fd: int, key: bytes, value_bytes: int, pieces: Pieces) -> bool:
        """Read the value of the file open as ``fd`` into its regions; whether the header is the key's
        and the value whole and intact."""
        if self.direct and not self._aligned(pieces):
            return self._read_staged(fd, key, value_bytes, pieces)
        return self._read_in_place(fd, key, value_bytes, pieces, self.direct)

    # -- writing ---------------------------------------------------------------------------------

    def _write_in_place(self, fd: int, key: bytes, pieces: Pieces, value_bytes: int, direct: bool) -> None:
        """One ``pwritev`` of the header and the regions themselves (aligned ones, with ``O_DIRECT``)."""
        views = self._views(pieces)
        header = self._scratch.get("header", data_offset(len(key)))
        end = pack_header(header.view, key, value_bytes, _digest(views))
        tail = value_bytes % ALIGN
        if not tail:
            write_all(fd, [header.view[:end], *views], 0)
        elif direct:
            # The last partial block goes through an aligned block of ours, padded with zeros.
            block = self._scratch.get("tail", ALIGN)
            body = views[-1][: len(views[-1]) - tail]
            block.view[:tail] = views[-1][len(body) :]
            block.view[tail:ALIGN] = _ZEROS[tail:]
            write_all(fd, [header.view[:end], *views[:-1], body, block.view[:ALIGN]], 0)
        else:
            write_all(fd, [header.view[:end], *views, _ZEROS[: ALIGN - tail]], 0)

    def _write_staged(self, fd: int, key: bytes, pieces: Pieces, value_bytes: int) -> None:
        """``O_DIRECT`` from unaligned regions: copied into an aligned buffer a piece at a time, the
        value first and the header (which holds its checksum) last."""
        _, _, array = self._mapped()
        stage = self._scratch.get("stage", min(STAGE_BYTES, aligned(value_bytes)))
        hasher = xxhash.xxh3_64()
        offset = data_offset(len(key))
        for chunk in _chunks(pieces, len(stage)):
            filled = 0
            for start, size in chunk:
                stage.array[filled : filled + size] = array[start : start + size]
                filled += size
            hasher.update(stage.view[:filled])
            padded = aligned(filled)
            stage.view[filled:padded] = _ZEROS[: padded - filled]
            write_all(fd, [stage.view[:padded]], offset)
            offset += padded
        header = self._scratch.get("header", data_offset(len(key)))
        end = pack_header(header.view, key, value_bytes, hasher.intdigest())
        write_all(fd, [header.view[:end]], 0)

    # -- reading ---------------------------------------------------------------------------------

    def _read_in_place(self, fd: int, key: bytes, value_bytes: int, pieces: Pieces, direct: bool) -> bool:
        """Read the header and the value into the regions in one ``preadv``; whether the header is the
        key's and the bytes read match its checksum."""
        views = self._views(pieces)
        offset = data_offset(len(key))
        header = self._scratch.get("header", offset)
        tail = value_bytes % ALIGN
        if direct and tail:
            block = self._scratch.get("tail", ALIGN)
            body = views[-1][: len(views[-1]) - tail]
            got = read_all(fd, [header.view[:offset], *views[:-1], body, block.view[:ALIGN]], 0)
            views[-1][len(body) :] = block.view[:tail]
            wanted = offset + aligned(value_bytes)
        else:
            got = read_all(fd, [header.view[:offset], *views], 0)
            wanted = offset + value_bytes
        found = parse_header(header.view[:offset])
        return (
            got >= wanted
            and found is not None
            and found.key == key
            and found.value_bytes == value_bytes
            and _digest(views) == found.value_sum
        )

    def _read_staged(self, fd: int, key: bytes, value_bytes: int, pieces: Pieces) -> bool:
        """``O_DIRECT`` into unaligned regions: read into an aligned buffer a piece at a time (the
        header with the first), then copied out; whether the value is whole and intact."""
        _, _, array = self._mapped()
        offset = data_offset(len(key))
        header = self._scratch.get("header", offset)
        stage = self._scratch.get("stage", min(STAGE_BYTES, aligned(value_bytes)))
        hasher = xxhash.xxh3_64()
        found: Header | None = None
        position = offset
        for chunk in _chunks(pieces, len(stage)):
            filled = sum(size for _, size in chunk)
            padded = aligned(filled)
            if position == offset:
                got = read_all(fd, [header.view[:offset], stage.view[:padded]], 0) - offset
                found = parse_header(header.view[:offset])
                if found is None or found.key != key or found.value_bytes != value_bytes:
                    return False
            else:
                got = read_all(fd, [stage.view[:padded]], position)
            if got < padded:
                return False
            hasher.update(stage.view[:filled])
            filled = 0
            for start, size in chunk:
                array[start : start + size] = stage.array[filled : filled + size]
                filled += size
            position += padded
        return found is not None and hasher.intdigest() == found.value_sum

    # -- the regions -----------------------------------------------------------------------------

    def _views(self, pieces: Pieces) -> list[memoryview]:
        _, view, _ = self._mapped()
        return [view[start : start + size] for start, size in pieces]

    def _aligned(self, pieces: Pieces) -> bool:
        """Whether ``O_DIRECT`` can move the regions in place: each starts on a page, and all but the
        last are whole pages long."""
        base = self._mapped()[0]
        last = len(pieces) - 1
        return all(
            (base + start) % ALIGN == 0 and (j == last or size % ALIGN == 0)
            for j, (start, size) in enumerate(pieces)
        )


def value_pieces(table: RegionTable, row: int, space: Space | None) -> Pieces:
    """Key ``row``'s regions as offsets in the mapped space, regions that continue each other merged."""
    if space is None:
        raise BackendError("DiskBackend has no registered memory")
    first, last = int(table.offsets[row]), int(table.offsets[row + 1])
    base = space[0]
    pieces: Pieces = []
    for addr, size in zip(table.addrs[first:last].tolist(), table.sizes[first:last].tolist(), strict=True):
        start = addr - base
        if pieces and pieces[-1][0] + pieces[-1][1] == start:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + size)
        else:
            pieces.append((start, size))
    return pieces


def _chunks(pieces: Pieces, limit: int) -> Iterator[Pieces]:
    """``pieces`` cut into consecutive runs of at most ``limit`` bytes (a piece may be split)."""
    chunk: Pieces = []
    room = limit
    for start, size in pieces:
        while size:
            take = min(size, room)
            chunk.append((start, take))
            start, size, room = start + take, size - take, room - take
            if not room:
                yield chunk
                chunk, room = [], limit
    if chunk:
        yield chunk


def _digest(views: list[memoryview]) -> int:
    """xxh3-64 of the views back to back (the same digest as one call over the joined bytes)."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0])
    hasher = xxhash.xxh3_64()
    for view in views:
        hasher.update(view)
    return hasher.intdigest()
