"""What :class:`~aiokv.backends.disk.DiskBackend` finds in its directory when it opens: the value files
to index, read from their headers only (never their values), and what it removes on the way.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from .disk_format import (
    NAME,
    SHARDS,
    TEMP_DIR,
    TEMP_SUFFIX,
    Found,
    OtherVersion,
    encode_key,
    file_name,
    inspect,
)
from .disk_io import unlink_quietly

SCAN_THREADS = 8  # headers are read in parallel: on a cold cache each is a small random read


class Scan(NamedTuple):
    values: list[Found]  # the newest intact file of each key, oldest first
    temp_files: int  # removed: left by a writer that never renamed them
    damaged: int  # removed: cut short, a bad header, a size the header disagrees with
    older_copies: int  # removed: a key's files but its newest
    other_versions: int  # left alone: files of another format version


def scan(directory: str) -> Scan:
    """The value files under ``directory``, after removing temp files, damaged files and all but the
    newest file of a key. Files not named like values are left alone."""
    temp_dir = os.path.join(directory, TEMP_DIR)
    temps = 0
    for name in os.listdir(temp_dir):
        if name.endswith(TEMP_SUFFIX):
            unlink_quietly(os.path.join(temp_dir, name))
            temps += 1
    with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="aiokv-disk-open") as pool:
        shards = list(pool.map(lambda shard: _scan_shard(directory, shard), SHARDS))
    newest: dict[str, Found] = {}
    damaged = others = older = 0
    for found, bad, other in shards:
        damaged += bad
        others += other
        for item in found:
            kept = newest.get(item.key)
            if kept is not None:
                stale = kept if kept.generation < item.generation else item
                unlink_quietly(os.path.join(directory, file_name(encode_key(stale.key), stale.generation)))
                older += 1
                if stale is item:
                    continue
            newest[item.key] = item
    values = sorted(newest.values(), key=lambda found: found.mtime_ns)
    return Scan(values, temps, damaged, older, others)


def _scan_shard(directory: str, shard: str) -> tuple[list[Found], int, int]:
    """The intact files of one shard directory, how many damaged ones it removed, and how many of
    another format version it left alone."""
    found: list[Found] = []
    damaged = others = 0
    with os.scandir(os.path.join(directory, shard)) as entries:
        for item in entries:
            match = NAME.fullmatch(item.name)
            if match is None or not item.is_file(follow_symlinks=False):
                continue
            try:
                value = inspect(item.path, match[1], int(match[2], 16)) if match[1][:2] == shard else None
            except OtherVersion:
                others += 1
                continue
            except OSError:
                value = None
            if value is None:
                unlink_quietly(item.path)
                damaged += 1
            else:
                found.append(value)
    return found, damaged, others
