"""The connector's disk tier on its own, in one process (no vLLM): per-rank tier workers over real
DiskBackends in ``disk_path/rank-<n>`` and the scheduler's index, driven through the same orders and
reports the connector passes between vLLM's processes. A tier opened again on the same directory (a
restart) reports what it holds, and the index serves it; every loaded byte is checked."""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path
from typing import Any

import pytest

from aiokv.backends.disk_format import ALIGN
from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
from aiokv.integrations.vllm.common.wire import TierReport
from aiokv.integrations.vllm.scheduler_side.tier_index import SchedulerTier
from aiokv.integrations.vllm.worker_side.tier_stores import DiskTierError, disk_namespace, open_disk_store
from aiokv.integrations.vllm.worker_side.tier_worker import TierWorker
from aiokv.keys import HashedPrompt, KeyNamespace
from aiokv.testing.paged_cache import GroupCache
from tests.helpers import read_only_directory
from tests.test_host_tier import (
    BLOCK_LEN,
    BLOCK_SIZE,
    CHUNK_BYTES,
    CHUNK_TOKENS,
    NUM_BLOCKS,
    REGIONS,
    Rank,
    World,
    prompt_of,
)

FILE_BYTES = CHUNK_BYTES + ALIGN  # a chunk's file on one rank: its header page, then the value


class DiskWorld(World):
    """:class:`World` with each rank's tier on a DiskBackend under ``root`` (the connector's layout),
    its keys under the fingerprint ``engine``; the scheduler's index is fresh, as after a restart."""

    def __init__(self, root: Path, capacity_chunks: int, ranks: int = 2, engine: bytes = b"engine-a") -> None:
        capacity = capacity_chunks * FILE_BYTES
        self.scheduler = SchedulerTier(
            capacity, ranks, REGIONS * BLOCK_LEN, BLOCK_SIZE, behind=False, overhead_bytes=ALIGN
        )
        config = ConnectorConfig.from_extra_config({"backend": "disk", "disk_path": str(root)})
        self.ranks = []
        for rank in range(ranks):
            cache = GroupCache.allocate(
                num_regions=REGIONS,
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                block_lens=BLOCK_LEN,
                fill=0,
            )
            namespace = disk_namespace(KeyNamespace("m", tp_rank=rank), engine)
            prefix = namespace.prefix(cache.layout.fingerprint, 0)
            store, found = open_disk_store(config, rank, capacity, prefix)
            tier = TierWorker(cache.layout, namespace, CHUNK_TOKENS, capacity, rank, store=store, found=found)
            self.ranks.append(Rank(cache, tier))

    def handshake(self) -> None:
        """What vLLM's engine core does at start-up: every rank's listing to the scheduler."""
        for rank in self.ranks:
            found = rank.tier.take_found()
            if found is not None:
                self.scheduler.on_output(found, ())

    def hit(self, prompt: HashedPrompt) -> int:
        (answer,) = self.scheduler.lookup_client(None).lookup_many([prompt])
        return int(answer.result()) // CHUNK_TOKENS

    def stored(self, prompt: HashedPrompt, blocks: list[int]) -> None:
        """Store ``prompt`` and report the writes (the next step's report)."""
        concurrent.futures.wait(self.store(prompt, blocks), timeout=30)
        self.step([])
        self.report()

    def loaded(self, req: str, prompt: HashedPrompt, blocks: list[int]) -> int:
        """Load ``prompt`` into ``blocks`` and report it done; the failed blocks over all ranks (every
        other block checked byte for byte)."""
        results = [future.result(timeout=30) for future in self.load(req, prompt, blocks)]
        failed = self.check_loaded(prompt, blocks, results)
        self.report([req])
        return failed


def stored_then_closed(root: Path, prompts: list[HashedPrompt], **options: Any) -> None:
    world = DiskWorld(root, capacity_chunks=8, **options)
    try:
        world.handshake()
        for n, prompt in enumerate(prompts):
            world.stored(prompt, list(range(1 + 10 * n, 1 + 10 * n + 2 * len(prompt.hashes))))
            assert world.hit(prompt) == len(prompt.hashes)
    finally:
        world.close()


def rank_files(root: Path, rank: int) -> list[Path]:
    return sorted((root / f"rank-{rank}").glob("*/*.kv"))


def file_of(root: Path, rank: int, digest: str) -> Path:
    """The file holding chunk ``digest`` on ``rank`` (its key, with the digest, is in the header)."""
    (path,) = [p for p in rank_files(root, rank) if digest.encode() in p.read_bytes()[:ALIGN]]
    return path


@pytest.mark.parametrize("via", ["handshake", "first report"])
def test_a_restarted_tier_hits_what_it_stored(tmp_path: Path, via: str) -> None:
    """Every rank lists what its disk holds once (at vLLM's handshake, else in its first report); a
    chunk every rank listed is a hit at once and loads the bytes stored before the restart."""
    p, q = prompt_of("p", 3), prompt_of("q", 2)
    stored_then_closed(tmp_path, [p, q])
    world = DiskWorld(tmp_path, capacity_chunks=8)
    try:
        assert world.hit(p) == 0  # nothing reported yet
        if via == "handshake":
            world.handshake()
        else:
            world.step([])
            world.report()
        assert world.hit(p) == 3 and world.hit(q) == 2
        assert all(rank.tier.report() is None for rank in world.ranks)  # listed once only
        assert world.loaded("r1", p, list(range(40, 46))) == 0
        assert world.loaded("r2", q, list(range(50, 54))) == 0
        assert world.scheduler.index.used_bytes == 5 * FILE_BYTES
    finally:
        world.close()


def test_another_engines_values_are_not_reported_and_go_first(tmp_path: Path) -> None:
    """Values under another fingerprint (another model or layout) in the directory are never listed
    nor loaded; they are the first the disk evicts when this engine's writes need the room."""
    p = prompt_of("p", 3)
    stored_then_closed(tmp_path, [p], engine=b"engine-a")
    world = DiskWorld(tmp_path, capacity_chunks=3, engine=b"engine-b")
    try:
        world.handshake()
        assert world.hit(p) == 0 and all(len(rank.tier.store) == 3 for rank in world.ranks)
        own = prompt_of("b", 3)
        world.stored(own, list(range(1, 7)))  # the disk's whole capacity: engine a's values go
        assert world.hit(own) == 3 and world.loaded("r1", own, list(range(20, 26))) == 0
        assert all(len(rank.tier.store) == 3 for rank in world.ranks)
    finally:
        world.close()
    world = DiskWorld(tmp_path, capacity_chunks=3, engine=b"engine-a")
    try:
        world.handshake()
        assert world.hit(p) == 0
    finally:
        world.close()


def test_a_chunk_missing_on_one_rank_is_dropped_everywhere(tmp_path: Path) -> None:
    """A hit must be whole on every rank: a chunk one rank no longer holds is not a hit, and the
    ranks that still hold it are told to remove it."""
    p = prompt_of("p", 3)
    stored_then_closed(tmp_path, [p])
    file_of(tmp_path, 1, p.hashes[1]).unlink()
    world = DiskWorld(tmp_path, capacity_chunks=8)
    try:
        world.handshake()
        assert world.hit(p) == 1 and world.scheduler.index.ready(p.hashes[2])
        assert not world.scheduler.index.known(p.hashes[1])
        world.step([])  # the drop reaches the ranks
        assert [len(rank.tier.store) for rank in world.ranks] == [2, 2]
        assert len(rank_files(tmp_path, 0)) == 2
    finally:
        world.close()


def test_a_damaged_value_is_refused_dropped_and_written_again(tmp_path: Path) -> None:
    """A file whose value changed on disk is listed (headers only are read at open) but refused on
    load: its blocks are reported failed (recomputed), the file is removed, the rank reports the chunk
    lost and the index drops it, so the next store of the prompt writes it again."""
    p = prompt_of("p", 3)
    stored_then_closed(tmp_path, [p])
    damaged = file_of(tmp_path, 0, p.hashes[1])
    with open(damaged, "r+b") as file:
        file.seek(ALIGN + 100)
        byte = file.read(1)
        file.seek(ALIGN + 100)
        file.write(bytes([byte[0] ^ 0xFF]))
    world = DiskWorld(tmp_path, capacity_chunks=8)
    try:
        world.handshake()
        assert world.hit(p) == 3
        failed = world.loaded("r1", p, list(range(40, 46)))
        assert failed >= 2  # chunk 1's two blocks on rank 0 (the chunks after it may not be tried)
        assert not damaged.exists() and world.hit(p) == 1
        world.stored(p, list(range(1, 7)))
        assert world.hit(p) == 3 and world.loaded("r2", p, list(range(50, 56))) == 0
    finally:
        world.close()


def test_a_directory_in_use_by_another_engine_is_refused(tmp_path: Path) -> None:
    world = DiskWorld(tmp_path, capacity_chunks=2, ranks=1)
    try:
        with pytest.raises(
            DiskTierError, match=re.escape(f"kv_connector_extra_config['disk_path'] {tmp_path}")
        ):
            DiskWorld(tmp_path, capacity_chunks=2, ranks=1)
    finally:
        world.close()


def config(**extra: Any) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({"backend": "disk", **extra})


def test_disk_keys_are_checked_at_start(tmp_path: Path) -> None:
    key = re.escape("kv_connector_extra_config['disk_path']")
    with pytest.raises(ValueError, match=key):
        config()
    with pytest.raises(ValueError, match=f"{key} {re.escape(str(tmp_path / 'missing'))} does not exist"):
        config(disk_path=str(tmp_path / "missing"))
    regular = tmp_path / "file"
    regular.write_text("")
    with pytest.raises(ValueError, match=f"{key} {re.escape(str(regular))} is a file"):
        config(disk_path=str(regular), backend="disk-tiered")
    with pytest.raises(ValueError, match="disk_capacity"):
        config(disk_path=str(tmp_path), disk_capacity=0)
    parsed = config(disk_path=str(tmp_path), disk_capacity="2GiB", memory_capacity="1MiB")
    assert parsed.disk_tier and parsed.host_tier and not parsed.remote and parsed.disk_capacity == 2 << 30
    assert ConnectorConfig.from_extra_config({"backend": "disk-tiered", "disk_path": str(tmp_path)}).remote


def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    with (
        read_only_directory(tmp_path) as locked,
        pytest.raises(ValueError, match=re.escape(f"['disk_path'] {locked} is not writable")),
    ):
        config(disk_path=str(locked))


def test_the_index_keeps_restored_chunks_within_its_budget() -> None:
    """Listings larger than the budget (the capacity shrank between runs) keep what fits; the rest is
    removed on the ranks that listed it."""
    tier = SchedulerTier(
        2 * FILE_BYTES, 1, REGIONS * BLOCK_LEN, BLOCK_SIZE, behind=False, overhead_bytes=ALIGN
    )
    tier.on_output(TierReport(found={0: {"a": CHUNK_BYTES, "b": CHUNK_BYTES, "c": CHUNK_BYTES}}), ())
    assert [tier.index.ready(d) for d in "abc"] == [True, True, False]
    step = tier.index.take_step()
    assert step is not None and step.removes == ("c",)
