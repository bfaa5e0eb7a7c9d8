"""The disk tier's KV event journal (aiokv.integrations.vllm.scheduler_side.event_journal): what a
restarted engine reads back is the last record of each chunk not dropped since; a torn last record is
cut off and the journal goes on after it; past twice the live chunks it is rewritten with them alone.
A restart of two ranks (the scheduler's events on a real index) announces what both ranks found, once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("msgspec")

from aiokv.integrations.vllm.scheduler_side import event_journal
from aiokv.integrations.vllm.scheduler_side.event_journal import EventJournal, read_records


def fields(n: int) -> list[Any]:
    return [[bytes([n]) * 32], None, [n, n + 1], 2, None, None, [None], None]


def test_records_survive_a_restart_and_drops_remove_them(tmp_path: Path) -> None:
    path = str(tmp_path / "kv.journal")
    journal = EventJournal(path)
    assert journal.load() == {}
    for n in range(5):
        journal.admitted(f"d{n}", fields(n))
    journal.dropped("d1")
    journal.admitted("d2", fields(9))  # admitted again: its last record counts
    journal.close()
    again = EventJournal(path)
    assert again.load() == {"d0": fields(0), "d2": fields(9), "d3": fields(3), "d4": fields(4)}
    again.close()


def test_a_torn_last_record_is_cut_off(tmp_path: Path) -> None:
    path = str(tmp_path / "kv.journal")
    journal = EventJournal(path)
    journal.load()
    journal.admitted("a", fields(1))
    journal.admitted("b", fields(2))
    journal.close()
    size = os.path.getsize(path)
    with open(path, "r+b") as file:
        file.truncate(size - 3)  # the last record torn
    again = EventJournal(path)
    assert again.load() == {"a": fields(1)}
    again.admitted("c", fields(3))
    again.close()
    assert read_records(path)[0] == {"a": fields(1), "c": fields(3)}
    with open(path, "r+b") as file:  # a flipped byte in the last record: its checksum fails
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 1]))
    assert read_records(path)[0] == {"a": fields(1)}


def test_the_journal_is_rewritten_with_the_live_chunks(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(event_journal, "_COMPACT_FLOOR", 8)
    path = str(tmp_path / "kv.journal")
    journal = EventJournal(path)
    journal.load()
    for n in range(40):
        journal.admitted(f"d{n}", fields(n))
        if n >= 3:
            journal.dropped(f"d{n - 3}")  # three live at a time
    journal.close()
    live, count, _ = read_records(path)
    assert live == {f"d{n}": fields(n) for n in range(37, 40)}
    assert count <= 2 * 8  # rewritten, not 77 records
    again = EventJournal(path)
    again.load()
    again.retain(["d39"])  # a restart found only d39
    for _ in range(10):
        again.admitted("d39", fields(39))
    again.close()
    assert read_records(path)[0] == {"d39": fields(39)}
    assert read_records(path)[1] <= 8


def test_a_tp2_restart_announces_the_chunks_every_rank_found_once(tmp_path: Path, monkeypatch: Any) -> None:
    """Two ranks list what their disks held: nothing is announced until both have; then each chunk both
    hold and the journal describes is announced once, one rank alone holds is not (the index drops
    it), one the journal lacks is counted; a found chunk lost later is announced removed."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")  # whole hashes, as the journal holds
    from types import SimpleNamespace

    from aiokv.integrations.vllm.common.connector_config import ConnectorConfig
    from aiokv.integrations.vllm.common.wire import TierReport
    from aiokv.integrations.vllm.scheduler_side.event_payloads import Chunk, Tier
    from aiokv.integrations.vllm.scheduler_side.kv_events import ConnectorEvents
    from aiokv.integrations.vllm.scheduler_side.tier_index import SchedulerTier

    path = str(tmp_path / "kv.journal")
    first = EventJournal(path)
    first.load()
    for n in range(3):
        first.admitted(f"d{n}", fields(n))
    first.close()
    tier = SchedulerTier(1 << 30, 2, 1 << 17, 128, behind=False, overhead_bytes=4096)
    tails = SimpleNamespace(enabled=False)
    journal = EventJournal(path)
    events = ConnectorEvents(
        ConnectorConfig(),
        2,
        tails,
        tier,
        None,
        1,
        load_async=True,
        local=Tier("STORAGE", "LOCAL"),
        journal=journal,
    )
    held = {
        0: {"d0": 1 << 17, "d1": 1 << 17, "d2": 1 << 17, "d9": 1 << 17},
        1: {"d0": 1 << 17, "d1": 1 << 17, "d9": 1 << 17},
    }
    for rank in (0, 1):
        report = TierReport(found={rank: held[rank]})
        tier.on_output(report, ())
        events.on_found(report)
        if rank == 0:
            assert events.take() == []
    stored = events.take()
    assert sorted(e.block_hashes[0] for e in stored) == [bytes([0]) * 32, bytes([1]) * 32]
    assert stored[0].medium == "STORAGE" and stored[0].token_ids in ([0, 1], [1, 2])
    assert events.unannounceable == 1  # d9: on both disks, not in the journal
    events.on_found(TierReport(found={0: held[0]}))  # listed again: nothing new
    assert events.take() == []
    lost = TierReport(lost={0: {"d1"}})
    tier.on_output(lost, ())
    (gone,) = events.take()
    assert type(gone).__name__ == "BlockRemoved" and gone.block_hashes == [bytes([1]) * 32]
    events.close()
    live = read_records(path)[0]
    assert "d0" in live and "d1" not in live  # d1 dropped (d2's record goes at the next rewrite)
    assert Chunk.from_fields(fields(0)).fields() == fields(0)
