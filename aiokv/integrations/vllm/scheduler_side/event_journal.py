"""A disk tier's event journal: what each chunk the tier holds was announced as (its ``BlockStored``
fields), kept beside the tier so that a restarted engine announces the chunks its disk tier found. The
workers report those by their digests alone; vLLM's block hashes, tokens and parent are only in the
requests that stored them, gone with the engine that served them.

One file per engine in ``disk_path`` (its key namespace in the name, as the tier's keys), appended by a
thread of its own: a step never waits on the disk. A record is its body's length and CRC-32 (4 bytes
each, little-endian) and its body, msgpack: ``[digest, fields]`` when the tier admits a chunk,
``[digest]`` when it drops one. Read at start-up up to its first bad record (short, or failing its
checksum: torn by a crash), where the file is cut. Rewritten, into a file renamed over it, with the
live chunks' records alone once it holds more than twice as many records as live chunks. Values are
not synced record by record, as the disk tier's own are not: a chunk whose record a crash lost is
found without one, and is not announced.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import zlib
from collections.abc import Iterable
from typing import Any

import msgspec

logger = logging.getLogger("aiokv.vllm")

_HEAD = struct.Struct("<II")  # body length, CRC-32 of the body
_COMPACT_FLOOR = 1024  # records below which the file is never rewritten
_CLOSE = object()


def read_records(path: str) -> tuple[dict[str, list[Any]], int, int]:
    """The live records of the journal at ``path`` (digest -> fields, the last admission not dropped
    since), the count of records read and the offset of the first bad one (the file's end if none)."""
    live: dict[str, list[Any]] = {}
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return live, 0, 0
    decoder = msgspec.msgpack.Decoder(list)
    offset = count = 0
    while offset + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, offset)
        body = data[offset + _HEAD.size : offset + _HEAD.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break
        try:
            record = decoder.decode(body)
        except msgspec.DecodeError:
            break
        if len(record) == 2:
            live[record[0]] = record[1]
        elif record:
            live.pop(record[0], None)
        offset += _HEAD.size + length
        count += 1
    return live, count, offset


def _framed(body: bytes) -> bytes:
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


class EventJournal:
    """The journal at ``path``: :meth:`load` once at start-up, then :meth:`admitted` / :meth:`dropped`
    as the tier changes (queued for the writer thread), :meth:`close` at shutdown."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: set[str] = set()  # the writer's: digests with a live record in the file
        self._records = 0  # records in the file
        self._thread: threading.Thread | None = None
        self._failed = False

    def load(self) -> dict[str, list[Any]]:
        """The live records (digest -> fields), the file cut after its last good record; then the
        writer starts."""
        live: dict[str, list[Any]] = {}
        try:
            live, self._records, end = read_records(self.path)
            if os.path.exists(self.path) and os.path.getsize(self.path) > end:
                logger.warning("aiokv: KV event journal %s: a torn last record cut off", self.path)
                os.truncate(self.path, end)
        except OSError as exc:
            self._fail(exc)
        self._live = set(live)
        self._thread = threading.Thread(target=self._run, name="aiokv-event-journal", daemon=True)
        self._thread.start()
        return live

    def admitted(self, digest: str, fields: list[Any]) -> None:
        self._queue.put((digest, fields))  # encoded by the writer: off the step's path

    def dropped(self, digest: str) -> None:
        self._queue.put((digest, None))

    def retain(self, digests: Iterable[str]) -> None:
        """Only ``digests`` are live (the chunks a restart found and announced): the others' records
        go at the next rewrite."""
        self._queue.put(frozenset(digests))

    def close(self, timeout: float | None = 10.0) -> None:
        """Write what is queued, then stop the writer."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_CLOSE)
            self._thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while not self._queue.empty() and len(batch) < 4096:  # one write for what piled up
                batch.append(self._queue.get())
            closing = any(entry is _CLOSE for entry in batch)
            if not self._failed:
                try:
                    self._write([entry for entry in batch if entry is not _CLOSE])
                    if self._records > max(_COMPACT_FLOOR, 2 * len(self._live)):
                        self._compact()
                except OSError as exc:
                    self._fail(exc)
            if closing:
                return

    def _write(self, batch: list[Any]) -> None:
        out = []
        for entry in batch:
            if isinstance(entry, frozenset):
                self._live &= entry
                continue
            digest, fields = entry
            if fields is None:
                self._live.discard(digest)
                out.append(_framed(self._encoder.encode([digest])))
            else:
                self._live.add(digest)
                out.append(_framed(self._encoder.encode([digest, fields])))
        if out:
            with open(self.path, "ab") as file:
                file.write(b"".join(out))
            self._records += len(out)

    def _compact(self) -> None:
        live, _, _ = read_records(self.path)
        kept = [
            _framed(self._encoder.encode([digest, live[digest]])) for digest in self._live if digest in live
        ]
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as file:
            file.write(b"".join(kept))
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path)
        self._records = len(kept)

    def _fail(self, exc: OSError) -> None:
        self._failed = True
        logger.warning(
            "aiokv: KV event journal %s cannot be written (%s): a restart will not announce the disk "
            "tier's chunks",
            self.path,
            exc,
        )
