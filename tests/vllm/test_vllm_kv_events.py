"""KV events for the connector's tiers, as a router consumes them: vLLM's publisher over ZeroMQ
(``kv_events_config``), a pyzmq subscriber bound on loopback, vLLM's own event classes to decode.

- Host tier, under vLLM's OpenAI server (``backend "memory"``, a tier of 24 chunks for 37 distinct ones:
  evictions). The test rebuilds the tier from the events alone (``medium "CPU"``, ``locality
  "LOCAL"``). Before each request it waits until the events stop and predicts the request's hit from the
  rebuilt index: every prediction equals the server's ``cached_tokens`` (with
  ``--no-enable-prefix-caching`` every hit is the tier's). Each chunk is announced stored once and
  removed once. At the end the rebuilt index equals, chunk for chunk, what the scheduler's index holds
  (logged at DEBUG as the server stops), the events' block hashes mapped to aiokv's chunk digests as the
  connector derives them.
- A restarted disk tier (``backend "disk"``, ``medium "STORAGE"``): a server stores prompts and is
  stopped (SIGINT); a new server on the same ``disk_path`` announces every chunk it found, once, to a
  fresh subscriber, then evicts some of them. The index that subscriber rebuilt from the new server's
  events alone equals the scheduler's as it stops, and its first announcements are the found chunks.
- The store behind the engine (``locality "REMOTE"``), in an in-process engine on the embedded store
  whose gets all fail (a key the store lists but cannot serve): every chunk is announced once the worker
  confirmed it; asked again, the load fails and its first chunk is announced removed; recomputed and
  stored again, only that chunk is announced again.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aiokv.keys import HashedPrompt
from aiokv.testing.tiny_model import write_tiny_llama, write_word_tokenizer
from aiokv.testing.vllm_server import running_server
from tests.vllm.support import (
    BLOCK,
    MOONCAKE_ENV,
    ROOT,
    connector,
    generate,
    require_vllm,
    run_engine,
    store_world,
    tokens,
)

A = tokens(21, 1000)  # 7 full blocks and a tail: 8 chunks
PROMPTS = {
    "a": A,
    "b": tokens(22, 1000),
    "c": A[:640] + tokens(23, 360),  # A's first 5 blocks, then 3 chunks of its own
    "d": tokens(24, 1200),  # 10 chunks
    "e": tokens(25, 900),  # 8 chunks
}
TIER = "3MiB"  # 24 chunks of the tiny model's 128 KiB blocks (2 layers x 64 KiB)
QUIET_S = 1.5  # no event for this long: the engine is idle and its index settled
HELD_LINE = "aiokv: host tier holds "
P = tokens(60, 2000)  # 15 full blocks and a tail: 16 chunks


@contextmanager
def subscriber() -> Iterator[tuple[Any, str]]:
    """A SUB socket bound on a free loopback port (vLLM's publisher connects to an endpoint without a
    wildcard), and the ``kv_events_config`` that publishes to it."""
    import zmq

    from aiokv.backends.mooncake_master import free_ports

    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.bind(endpoint)
    try:
        yield socket, endpoint
    finally:
        socket.close(linger=0)


def events_config(endpoint: str) -> dict[str, Any]:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}


def tier_events(socket: Any, quiet_s: float, medium: str = "CPU") -> Iterator[Any]:
    """The BlockStored / BlockRemoved events of the connector's tiers in ``medium`` ("CPU", ``locality``
    "LOCAL": the host tier, "REMOTE": the store behind; "STORAGE": a disk tier), until none came for
    ``quiet_s``."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    while socket.poll(int(quiet_s * 1000)):
        _topic, _seq, payload = socket.recv_multipart()
        for event in decoder.decode(payload).events:
            if isinstance(event, (BlockStored, BlockRemoved)) and event.medium == medium:
                yield event


class RebuiltTier:
    """A tier as a subscriber sees it: block hashes held, and the hash each stored event named, by its
    parent and tokens (one block per chunk)."""

    def __init__(self) -> None:
        self.held: set[Any] = set()
        self.by_content: dict[tuple[Any, tuple[int, ...]], Any] = {}
        self.parents: dict[Any, Any] = {}
        self.stored = self.removed = 0
        self.order: list[Any] = []  # hashes stored, in the order announced
        self.repeats: list[str] = []  # a store of a held hash, or a removal of one not held

    def apply(self, event: Any) -> None:
        from vllm.distributed.kv_events import BlockStored

        if isinstance(event, BlockStored):
            (block_hash,) = event.block_hashes  # chunk_blocks 1: one block per chunk
            assert event.block_size == len(event.token_ids)
            self.by_content[(event.parent_block_hash, tuple(event.token_ids))] = block_hash
            self.parents[block_hash] = event.parent_block_hash
            if block_hash in self.held:
                self.repeats.append(f"stored twice: {block_hash!r}")
            self.held.add(block_hash)
            self.order.append(block_hash)
            self.stored += 1
            return
        for block_hash in event.block_hashes:
            if block_hash not in self.held:
                self.repeats.append(f"removed, not held: {block_hash!r}")
            self.held.discard(block_hash)
            self.removed += 1

    def chain(self, prompt: Sequence[int]) -> list[Any]:
        """The block hashes of ``prompt``'s chunks (full blocks, then its tail) as far as events named
        them."""
        hashes: list[Any] = []
        parent = None
        for start in range(0, len(prompt), BLOCK):
            block_hash = self.by_content.get((parent, tuple(prompt[start : start + BLOCK])))
            if block_hash is None:
                break
            hashes.append(block_hash)
            parent = block_hash
        return hashes

    def hit(self, prompt: Sequence[int]) -> int:
        """The tokens a lookup of ``prompt`` finds, by this index: its leading held chunks."""
        held = 0
        for block_hash in self.chain(prompt):
            if block_hash not in self.held:
                break
            held += 1
        return min(held * BLOCK, len(prompt))

    def digests(self, hashes: Iterable[Any] | None = None) -> set[str]:
        """aiokv's digest of each held chunk (or of ``hashes``): chained over the block hashes from its
        prompt's first."""
        out = set()
        for block_hash in self.held if hashes is None else hashes:
            chain = [block_hash]
            while (parent := self.parents[chain[-1]]) is not None:
                chain.append(parent)
            out.add(HashedPrompt.from_block_hashes(chain[::-1], BLOCK, BLOCK).hashes[-1])
        return out


def logged_tier(log: str) -> set[str]:
    """The chunk digests the scheduler's index held as the engine stopped (its last such line)."""
    lines = [line for line in log.splitlines() if HELD_LINE in line]
    assert lines, "the scheduler did not log the tier's contents as it stopped"
    count, _, listed = lines[-1].split(HELD_LINE, 1)[1].partition(" chunk(s): ")
    held = set(listed.split())
    assert int(count) == len(held)
    return held


def logging_config(path: Path) -> Path:
    """vLLM's records at INFO, aiokv's at DEBUG (the tier's contents as the server stops)."""
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
        "handlers": {"out": handler},
        "loggers": {
            "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
            "aiokv": {"handlers": ["out"], "level": "DEBUG", "propagate": False},
        },
    }
    path.write_text(json.dumps(config))
    return path


def test_events_rebuild_the_host_tier_chunk_for_chunk(tmp_path: Path) -> None:
    require_vllm()
    model = write_word_tokenizer(write_tiny_llama(tmp_path / "tiny-llama"))
    kv = connector({"backend": "memory", "memory_capacity": TIER, "chunk_blocks": 1})
    env = {
        "PYTHONPATH": str(ROOT),
        "VLLM_LOGGING_CONFIG_PATH": str(logging_config(tmp_path / "log.json")),
        # Whole block hashes in events (vLLM's default truncates them to 64-bit ints): the test derives
        # aiokv's chunk digests from them.
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
    }
    log_path = tmp_path / "server.log"
    tier = RebuiltTier()
    hits: list[tuple[str, int, int]] = []
    with subscriber() as (socket, endpoint):
        # A grace period at shutdown: vLLM's default kills the engine core before the connector's shutdown.
        args = ("--kv-events-config", json.dumps(events_config(endpoint)), "--shutdown-timeout", "30")
        with running_server(model, log_path, kv_transfer_config=kv, env=env, extra_args=args) as server:
            # Stored (evicting), then asked again newest first: whole hits, partial ones, misses.
            for name, prompt in [*PROMPTS.items(), *reversed(PROMPTS.items())]:
                for event in tier_events(socket, QUIET_S):
                    tier.apply(event)
                predicted = tier.hit(prompt)
                hits.append((name, predicted, server.complete(prompt, max_tokens=2, logprobs=None).cached))
            for event in tier_events(socket, QUIET_S):
                tier.apply(event)
    assert [(name, got) for name, _, got in hits] == [(name, want) for name, want, _ in hits], hits
    assert not tier.repeats, tier.repeats[:5]
    assert tier.removed > 0 and tier.stored > 24  # the tier evicted: more stored than it holds
    lengths = [len(PROMPTS[name]) for name, _, _ in hits]
    assert any(got == length for (_, _, got), length in zip(hits, lengths, strict=True)), hits  # tails too
    assert any(0 < got < length for (_, _, got), length in zip(hits, lengths, strict=True)), hits
    held = logged_tier(log_path.read_text(errors="replace"))
    assert len(held) == len(tier.held) <= 24
    assert tier.digests() == held


def test_a_restarted_disk_tier_announces_what_it_found_once(tmp_path: Path) -> None:
    """Server one stores PROMPTS (37 chunks, a tier of 40: nothing evicted) and stops; server two, on
    the same directory, is asked A (found whole) then two prompts of its own (evicting found chunks)."""
    require_vllm()
    model = write_word_tokenizer(write_tiny_llama(tmp_path / "tiny-llama"))
    disk = tmp_path / "disk"
    disk.mkdir()
    # 40 chunks of 128 KiB, each with its file's header page.
    kv = connector(
        {"backend": "disk", "disk_path": str(disk), "disk_capacity": 40 * 132 * 1024, "chunk_blocks": 1}
    )
    env = {
        "PYTHONPATH": str(ROOT),
        "VLLM_LOGGING_CONFIG_PATH": str(logging_config(tmp_path / "log.json")),
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
    }
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    tiers = [RebuiltTier(), RebuiltTier()]
    for log_path, tier, prompts in zip(
        logs, tiers, [PROMPTS.values(), [A, tokens(26, 800), tokens(27, 600)]], strict=True
    ):
        with subscriber() as (socket, endpoint):
            args = ("--kv-events-config", json.dumps(events_config(endpoint)), "--shutdown-timeout", "30")
            with running_server(model, log_path, kv_transfer_config=kv, env=env, extra_args=args) as server:
                for prompt in [*prompts, None]:  # events drained before each request, and at the end
                    for event in tier_events(socket, QUIET_S, "STORAGE"):
                        tier.apply(event)
                    if prompt is not None:
                        server.complete(prompt, max_tokens=2, logprobs=None)
    first, second = tiers
    found = logged_tier(logs[0].read_text(errors="replace"))
    assert len(found) == 37 and first.digests() == found and first.removed == 0
    log = logs[1].read_text(errors="replace")
    assert "KV events: 37 chunk(s) the disk tier held at start announced; 0 not announceable" in log
    assert not second.repeats, second.repeats[:5]
    restart = second.order[:37]
    assert second.digests(restart) == found  # the restart's, first, each once
    assert all(second.parents[h] in (None, *restart[:i]) for i, h in enumerate(restart))  # parents first
    assert second.removed > 0  # found chunks evicted, and announced removed
    assert second.digests() == logged_tier(log)


def engine_with_events(
    root: Path, name: str, steps: list[dict[str, Any]], kv: dict[str, Any], env: dict[str, str] | None = None
) -> tuple[dict[str, Any], list[Any]]:
    """An in-process engine run (``support.run_engine``) publishing KV events, and the events of the
    connector's tiers it published, collected while it runs (a publisher closing its socket drops what
    it has not sent yet)."""
    model = write_tiny_llama(root / "tiny-llama")
    events: list[Any] = []
    with subscriber() as (socket, endpoint):
        done = threading.Event()

        def collect() -> None:
            while not done.is_set():
                events.extend(tier_events(socket, 0.2))

        collector = threading.Thread(target=collect)
        collector.start()
        try:
            run = run_engine(
                root,
                name,
                model=model,
                steps=steps,
                kv_transfer_config=kv,
                engine={"kv_events_config": events_config(endpoint)},
                env=env,
            )
        finally:
            done.set()
            collector.join()
    return run, events


def rebuilt(events: list[Any], locality: str) -> RebuiltTier:
    tier = RebuiltTier()
    for event in events:
        if event.locality == locality:
            tier.apply(event)
    return tier


def test_store_events_follow_confirmed_writes_and_failed_reads(tmp_path: Path) -> None:
    require_vllm()
    kv = connector({"backend": "tests.vllm.support:failing_gets_memory", "chunk_blocks": 1})
    steps = [
        generate("first", [P], max_tokens=2, logprobs=False),
        {"op": "evict"},  # vLLM's prefix cache dropped: P's hit is the store's, and its load fails
        generate("again", [P], max_tokens=2, logprobs=False),
        {"op": "drain"},
    ]
    run, events = engine_with_events(tmp_path, "store-events", steps, kv)
    assert run["again"]["outputs"][0]["tokens"] == run["first"]["outputs"][0]["tokens"]  # recomputed
    assert {event.locality for event in events} == {"REMOTE"}
    tier = rebuilt(events, "REMOTE")
    chunks = {block_hash: index for index, block_hash in enumerate(tier.chain(P))}  # P's, by hash
    sequence = [
        ("stored" if type(event).__name__ == "BlockStored" else "removed", chunks[block_hash])
        for event in events
        for block_hash in event.block_hashes
        if block_hash in chunks
    ]
    assert sorted(sequence[:16]) == [("stored", index) for index in range(16)], sequence
    assert sequence[16:] == [("removed", 0), ("stored", 0)], sequence
    assert not tier.repeats, tier.repeats


def test_tiered_events_name_promotions_and_each_store_once(tmp_path: Path, mooncake_master: Any) -> None:
    """The host tier (8 chunks) in front of Mooncake: P's 16 chunks go to both, the tier keeping what
    fits; P asked again is read from both, the tier promoting what Mooncake served. The host tier's
    events rebuild the scheduler's index exactly; Mooncake's name each of P's chunks once."""
    with store_world(tmp_path, mooncake_master.address) as world:
        kv = connector(
            {
                "backend": "tiered",
                "mooncake_config": str(world["mooncake_config"]),
                "memory_capacity": "1MiB",
                "chunk_blocks": 1,
            }
        )
        steps = [
            generate("first", [P], max_tokens=2, logprobs=False),
            {"op": "flush"},
            {"op": "evict"},
            generate("again", [P], max_tokens=2, logprobs=False),
            {"op": "drain"},
            {"op": "stats"},
        ]
        env = {
            **MOONCAKE_ENV,
            "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
            "VLLM_LOGGING_CONFIG_PATH": str(logging_config(tmp_path / "log.json")),
        }
        run, events = engine_with_events(tmp_path, "tiered-events", steps, kv, env)
    assert run["again"]["outputs"][0]["cached"] == len(P)
    assert run["stats"]["host_tier"]["promotions"] > 0
    local, remote = rebuilt(events, "LOCAL"), rebuilt(events, "REMOTE")
    assert not local.repeats and not remote.repeats, (local.repeats, remote.repeats)
    assert local.removed > 0  # the tier evicted
    assert local.digests() == logged_tier(run["log"])
    chain = remote.chain(P)
    assert len(chain) == 16 and set(chain) <= remote.held and remote.removed == 0
    stored_p = [h for event in events if event.locality == "REMOTE" for h in event.block_hashes if h in chain]
    assert sorted(stored_p) == sorted(chain)  # each once, though stored twice (the load is stored again)
