"""A worker rank's tier, opened (:func:`open_tier_worker`): its store is a bounded ``MemoryBackend``,
or for a disk tier a :class:`~aiokv.backends.disk.DiskBackend` in ``disk_path/rank-<n>``, which
:class:`.tier_worker.TierWorker` and the scheduler's index run as they run the memory. What the disk
already held for this engine when it opened is reported to the scheduler, so a restarted engine hits
what the last one stored.

Keys: the tier's namespace adds a digest of the engine's value fingerprint (model path and revision,
dtype, block geometry, attention kind, layout: :func:`..common.block_keys.value_fingerprint`) to the
model name, so values another model or layout wrote into the directory never match this engine's
prefix: they are neither reported nor loaded. They are left on disk and count against its capacity;
never read, they are the first the DiskBackend evicts when a write needs room (this engine's values
are moved behind them in its LRU order at open).

Budget: the scheduler's index charges each chunk its file's bytes (the value in whole pages plus one
page of header, as long as a key fits in it: checked here), and the DiskBackend evicts only when a
write would pass its capacity (both watermarks 1.0). So among this engine's values the index alone
decides what is dropped, as it does for the memory tier.

``memory_cache_capacity`` puts a memory level in front of each rank's disk (its share of it): a
:class:`~aiokv.backends.memory_disk.MemoryDiskBackend`, whose listing, presence and budget are the
disk's, so the scheduler's index tracks the disk unchanged; the memory level starts empty.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import xxhash

from ....backends.disk import DiskBackend
from ....backends.disk_format import ALIGN, data_offset, encode_key
from ....backends.memory_disk import MemoryDiskBackend
from ....errors import BackendError
from ....keys import KeyNamespace
from ....layout import KVLayout
from ....threaded import ThreadedKVWorker
from ..common.connector_config import ConnectorConfig, tier_capacity_per_rank
from .tier_worker import TierWorker

logger = logging.getLogger("aiokv.vllm")

_DIGEST_ROOM = 128  # bytes a chunk digest may take after the prefix (aiokv's are 64 hex characters)


class DiskTierError(ValueError):
    """A disk tier that cannot open (the configuration's fault): the engine must not start without it."""


def disk_namespace(namespace: KeyNamespace, fingerprint: bytes) -> KeyNamespace:
    """``namespace`` with the value fingerprint's digest in its model name."""
    return dataclasses.replace(namespace, model=f"{namespace.model}@v{xxhash.xxh3_64_hexdigest(fingerprint)}")


def open_disk_store(
    config: ConnectorConfig, rank: int, capacity: int, prefix: str, memory_capacity: int = 0
) -> tuple[DiskBackend | MemoryDiskBackend, dict[str, int]]:
    """Rank ``rank``'s DiskBackend of ``capacity`` bytes (behind ``memory_capacity`` bytes of memory if
    positive), and the chunks it holds under ``prefix`` (digest -> value bytes, least recently used
    first). :class:`DiskTierError` naming ``disk_path`` when the directory cannot be used (not a
    directory, not writable, another engine's)."""
    if data_offset(len(encode_key(prefix)) + _DIGEST_ROOM) > ALIGN:
        raise DiskTierError(
            f"the disk tier's keys ({prefix!r} and a digest) must fit a {ALIGN}-byte file header: "
            "shorten kv_connector_extra_config['model_name'] or 'cache_prefix'"
        )
    path = os.path.join(str(config.disk_path), f"rank-{rank}")
    store: DiskBackend | MemoryDiskBackend
    try:
        if memory_capacity > 0:
            store = MemoryDiskBackend(path, capacity, memory_capacity, high_watermark=1.0, low_watermark=1.0)
        else:
            store = DiskBackend(path, capacity, high_watermark=1.0, low_watermark=1.0)
    except (ValueError, OSError, BackendError) as exc:
        raise DiskTierError(
            f"kv_connector_extra_config['disk_path'] {config.disk_path}: rank {rank}: {exc}"
        ) from exc
    try:
        held = store.listing(prefix)
        store.batch_exists([key for key, _ in held])  # this engine's values behind any others in LRU order
    except BaseException:
        store.close()
        raise
    found = {key[len(prefix) :]: size for key, size in held}
    others = len(store) - len(found)
    logger.info(
        "aiokv: disk tier of rank %d in %s%s: %d chunk(s) of this engine found (reported to the scheduler)%s",
        rank,
        path,
        f" behind {memory_capacity} bytes of memory" if memory_capacity > 0 else "",
        len(found),
        f"; {others} value(s) of other engines or layouts left, evicted first when room is needed"
        if others
        else "",
    )
    return store, found


def open_tier_worker(
    layout: KVLayout,
    namespace: KeyNamespace,
    chunk_tokens: int,
    config: ConnectorConfig,
    *,
    behind: ThreadedKVWorker | None,
    behind_writes: bool,
    fingerprint: bytes = b"",
) -> TierWorker:
    """The host tier of a single-group engine's worker, for this process's TP and PP ranks, in front of
    ``behind`` (the store's worker, if any; ``behind_writes``: whether this rank writes to it). A disk
    tier's keys name ``fingerprint`` (the engine's value fingerprint, :mod:`.disk_tier`)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    ranks = int(tp.world_size) * int(pp.world_size)
    rank = int(tp.rank_in_group) + int(tp.world_size) * int(pp.rank_in_group)
    capacity = tier_capacity_per_rank(config, ranks)
    store, found = None, None
    if config.disk_tier:
        namespace = disk_namespace(namespace, fingerprint)
        memory = config.memory_cache_capacity // ranks
        store, found = open_disk_store(
            config, rank, capacity, namespace.prefix(layout.fingerprint, 0), memory
        )
    return TierWorker(
        layout,
        namespace,
        chunk_tokens,
        capacity,
        rank,
        behind=behind,
        behind_writes=behind_writes,
        store=store,
        found=found,
    )
